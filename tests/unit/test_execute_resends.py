"""``recorder.execute`` when the broker's acknowledgement of an append is lost (the record itself
is durable): the step is resent as the identical event, never taken as a reason to call the
provider again, and the recorder's metrics count acknowledged appends only. In-memory transport,
result store and provider (no Kafka, no PostgreSQL); the events are read back through the codec
and folded, as the projector would.

(These were the reference executor's tests; ``execute`` is the SDK's form of it now.)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.fold import Applied, apply_execution
from ledger.domain.ids import content_ref
from ledger.domain.states import ExecutionState
from ledger.errors import DeliveryTimeoutError
from ledger.log import OutgoingRecord
from ledger.metrics import Metrics
from ledger.results import ResultStore
from ledger.settings import Settings
from opledger.fakes.memory import MemoryProvider
from producers import TransitionRecorder
from producers.execution import RESENDS

SETTINGS = Settings(home=Path("/nonexistent"))


class AckLosingTransport:
    """Keeps every record (the write is durable) but loses the acknowledgement of the sends
    whose numbers (1-based) are in ``lose``."""

    def __init__(self, lose: set[int]) -> None:
        self.records: list[OutgoingRecord] = []
        self._lose = lose
        self._sends = 0

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        self.records.extend(records)
        self._sends += 1
        if self._sends in self._lose:
            raise DeliveryTimeoutError("acknowledgement lost")

    def close(self) -> None:
        pass

    def execution_events(self) -> list[ExecutionTransitioned]:
        codec = default_codec()
        return [
            event
            for event in (codec.decode(r.value) for r in self.records)
            if isinstance(event, ExecutionTransitioned)
        ]


class MemoryResults(ResultStore):
    """A result store without a database."""

    def __init__(self) -> None:
        self.payloads: dict[tuple[str, str], bytes] = {}

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        ref = content_ref(payload)
        self.payloads[(tenant_id, ref)] = payload
        return ref


def _recorder(
    transport: AckLosingTransport, provider: MemoryProvider, metrics: Metrics | None = None
) -> TransitionRecorder:
    return TransitionRecorder(
        SETTINGS, transport, results=MemoryResults(), providers=[provider], metrics=metrics
    )


def test_a_lost_append_ack_is_resent_as_a_repeat_never_as_a_new_call() -> None:
    # Sends: intent (1, ack lost), its resend (2), dispatch (3, lost), resend (4), success
    # (5, lost), resend (6).
    transport = AckLosingTransport({1, 3, 5})
    provider = MemoryProvider("send_email")
    done = _recorder(transport, provider).execute(
        "acme", "agent-1", "send_email", {"to": "a@example.com"}
    )

    assert done.state is ExecutionState.SUCCEEDED
    counts = provider.state.tool_stats("send_email").keys[done.operation_id]
    assert (counts.calls, counts.side_effects) == (1, 1), "a resent append never calls again"
    events = transport.execution_events()
    assert [(str(e.state), e.attempt) for e in events] == [
        ("INTENT_RECORDED", 0),
        ("INTENT_RECORDED", 0),
        ("DISPATCHED", 1),
        ("DISPATCHED", 1),
        ("SUCCEEDED", 1),
        ("SUCCEEDED", 1),
    ]
    # Each repeat is the very same event (same id, same bytes): the fold calls it a duplicate,
    # so the projection applies it once.
    assert [e.event_id for e in events[::2]] == [e.event_id for e in events[1::2]]
    sent = [r.value for r in transport.records]
    assert sent[0::2] == sent[1::2], "a resend carries byte-identical records"
    record = None
    outcomes = []
    for event in events:
        outcome: Any = apply_execution(record, event)
        outcomes.append(type(outcome).__name__)
        if isinstance(outcome, Applied):
            record = outcome.record
    assert outcomes == ["Applied", "Duplicate"] * 3


def test_an_intent_whose_ack_keeps_getting_lost_is_raised_and_nothing_is_called() -> None:
    transport = AckLosingTransport(set(range(1, 100)))
    provider = MemoryProvider("send_email")
    with pytest.raises(DeliveryTimeoutError):
        _recorder(transport, provider).execute(
            "acme", "agent-1", "send_email", {"to": "a@example.com"}
        )
    # The intent, its resend, then RESENDS more before execute gives up.
    assert len(transport.records) == 2 + RESENDS
    assert provider.state.tool_stats("send_email").calls == 0, "no call before DISPATCHED"


def test_recorder_metrics_count_acknowledged_appends_only() -> None:
    registry = CollectorRegistry()
    transport = AckLosingTransport({2})  # the dispatch's first ack is lost, then resent
    _recorder(transport, MemoryProvider("send_email"), Metrics.create(registry)).execute(
        "acme", "agent-1", "send_email", {"to": "a@example.com"}
    )
    # intent, dispatched (sent twice, acknowledged once), succeeded
    assert len(transport.records) == 4
    assert (
        registry.get_sample_value("opledger_records_appended_total", {"machine": "execution"}) == 3
    )
    assert registry.get_sample_value("opledger_append_seconds_count") == 3
