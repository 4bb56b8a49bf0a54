"""faust-streaming workers. The projector folds the execution and delivery topics into the
PostgreSQL projections; the delivery and reconciler workers come with their issues."""
