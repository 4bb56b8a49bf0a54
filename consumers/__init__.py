"""Downstream consumers: deduplication on operation_id through a compacted key store, and the
``POST /events`` receiver that answers 202 for receipt (not execution). Built by the consumer
deduplication issue; nothing lives here until then."""
