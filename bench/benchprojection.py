"""Helpers of the benchmarks that need the projection: the projector driven in this process, and
a policy grant folded into it."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain import ids
from ledger.domain.events import PolicyChanged
from ledger.domain.policy import PolicyChange
from ledger.log import KafkaTransport, OutgoingRecord, end_offsets
from ledger.metrics import Metrics
from ledger.policy_keys import ensure_local_keys
from ledger.settings import Settings
from processors.batch_reader import BatchProjector
from projections.writer import PostgresProjection


class Projector:
    """The batch projector in this process, driven step by step: :meth:`catch_up` folds what the
    private topics hold into the private database (what a running projector would do)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._topics = [settings.execution_topic, settings.delivery_topic, settings.policy_topic]
        self._sink = PostgresProjection.connect(settings.dsn)
        self._projector = BatchProjector(
            settings, self._sink, default_codec(), Metrics.create(CollectorRegistry())
        )
        self._projector._consumer = self._projector._open()

    def catch_up(self, timeout_s: float = 120.0) -> None:
        ends = end_offsets(self._settings, self._topics)
        deadline = time.monotonic() + timeout_s
        while True:
            stored = self._sink.positions(self._settings.projector_group, self._topics)
            if all(stored.get(k, 0) >= high for k, high in ends.items()):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the in-process projector did not catch up in {timeout_s}s")
            self._projector.run_once()

    def close(self) -> None:
        self._projector.close()
        self._sink.close()


def grant(settings: Settings, tenant: str, actor: str, tool: str, *, repeat_safe: bool) -> None:
    """Grant ``tool`` to ``actor`` as ``opledger policy grant`` does (one record on the policy
    topic) and fold it, so policy checks read a real grant from the projection."""
    change = PolicyChanged(
        event_id=ids.event_id(time.time_ns() // 1_000_000, os.urandom(10)),
        tenant_id=tenant,
        actor_id="bench",
        occurred_at=datetime.now(UTC),
        change=PolicyChange.GRANT,
        principal=actor,
        tool_name=tool,
        repeat_safe=repeat_safe,
        reason="benchmark",
    )
    change = ensure_local_keys(settings).sign(change)  # as `opledger policy grant` signs it
    transport = KafkaTransport(settings)
    try:
        value = default_codec().encode(change)
        transport.send([OutgoingRecord(settings.policy_topic, change.subject_key(), value, [])])
    finally:
        transport.close()
    projector = Projector(settings)
    try:
        projector.catch_up(60)
    finally:
        projector.close()
