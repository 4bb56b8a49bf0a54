"""The kernel every opledger component shares: the pure domain, and the edges to Kafka and
PostgreSQL."""
