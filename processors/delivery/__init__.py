"""The delivery worker (``opledger deliver run``): the outbox that opens one PENDING delivery per
configured destination for every SUCCEEDED execution, and the sender that delivers each result
to its destination (a signed webhook, or a Kafka topic) until it is acknowledged or given up.

It reads results from the result store and never calls a tool: no module of this package may
import a provider client (``tests/unit/test_import_direction.py`` checks it).
"""
