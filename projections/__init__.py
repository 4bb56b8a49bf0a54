"""PostgreSQL projections: the versioned SQL migrations, the writer that folds event batches into
``agent_operations``, ``deliveries`` and ``operation_history``, and the analysts' queries."""
