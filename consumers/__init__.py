"""Downstream consumers: what a receiving service embeds to apply each delivered result once,
and the reference receiver.

- :mod:`consumers.contract`: the ``POST /events`` contract (key, body, fingerprint, problems);
- :mod:`consumers.signatures`: Standard Webhooks verification over the raw body;
- :mod:`consumers.inbox`: check and change in one PostgreSQL transaction;
- :mod:`consumers.keystore`: the compacted key store (publisher, restore, key view);
- :mod:`consumers.dedup`, :mod:`consumers.runtime`: the two put together, one instance;
- :mod:`consumers.receiver`: the reference receiver, served by :mod:`consumers.server` (a small
  HTTP/1.1 server on asyncio and httptools); :mod:`consumers.queue`: the Kafka side.

A 202 acknowledges receipt, never execution. Decision: docs/decisions/009-consumer-dedup.md.
"""
