"""The workers, each a subpackage or module of small passes: the projector (``batch_reader``)
folds the execution, delivery and policy topics into the PostgreSQL projections; the recovery
worker (``recovery``) resumes orphaned intents and reconciles UNKNOWN operations; the delivery
worker (``delivery``) turns SUCCEEDED executions into deliveries and sends them. ``app`` hosts
any of them with ``/metrics`` and ``/healthz``; ``opledger/`` wires them."""
