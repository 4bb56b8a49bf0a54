"""The reference executor with fakes only (no Kafka, no PostgreSQL): what it records and how
often it reaches the provider. The events are read back through the codec, as the projector
would read them, and folded, so the assertions are about the recorded history."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.fold import Applied, apply_delivery, apply_execution
from ledger.domain.ids import content_ref
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import DeliveryTimeoutError
from ledger.metrics import Metrics
from ledger.results import ResultStore
from ledger.settings import Settings
from ledger.transport import OutgoingRecord
from producers.executor import Executor
from producers.provider import (
    DeliveryReceipt,
    FakeDestination,
    FakeProvider,
    IdempotencyConflictError,
    ProviderResponse,
    ResponseLost,
)
from producers.recorder import TransitionRecorder

DESTS = ("webhook:crm", "queue:billing")


class CapturingTransport:
    """Acknowledges everything at once and keeps what was sent."""

    def __init__(self) -> None:
        self.records: list[OutgoingRecord] = []

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass

    def events(self) -> list[Transition]:
        codec = default_codec()
        return [codec.decode(r.value) for r in self.records]


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


class CountingProvider:
    """Wraps a provider and counts every call that reached it."""

    def __init__(self, inner: FakeProvider) -> None:
        self.inner = inner
        self.calls = 0

    def call(self, tool_name: str, arguments: Any, idempotency_key: str) -> ProviderResponse:
        self.calls += 1
        return self.inner.call(tool_name, arguments, idempotency_key)

    def lookup(self, idempotency_key: str) -> ProviderResponse | None:
        return self.inner.lookup(idempotency_key)


class ScriptedDestination:
    """Answers with the given statuses in order, then 202 forever."""

    def __init__(self, name: str, statuses: Sequence[int]) -> None:
        self.name = name
        self._statuses = list(statuses)
        self.calls = 0

    def deliver(self, operation_id: str, result_ref: str) -> DeliveryReceipt:
        self.calls += 1
        return DeliveryReceipt(self._statuses.pop(0) if self._statuses else 202)


def _setup(
    provider: FakeProvider, destinations: dict[str, Any] | None = None, max_attempts: int = 3
) -> tuple[Executor, CapturingTransport, CountingProvider, MemoryResults, list[float]]:
    transport = CapturingTransport()
    results = MemoryResults()
    recorder = TransitionRecorder(Settings(home=Path("/nonexistent")), transport, results=results)
    counting = CountingProvider(provider)
    slept: list[float] = []
    dests = destinations or {name: FakeDestination(name, 0.0) for name in DESTS}
    executor = Executor(
        recorder,
        counting,
        dests,
        max_delivery_attempts=max_attempts,
        sleep=slept.append,
        clock=lambda: datetime(2026, 1, 1, tzinfo=UTC),
    )
    return executor, transport, counting, results, slept


def _fold_all(events: Sequence[Transition]) -> None:
    """Every recorded event is a legal, first-time step (no duplicates, no anomalies)."""
    execution = None
    deliveries: dict[str, Any] = {}
    for event in events:
        if isinstance(event, ExecutionTransitioned):
            outcome: Any = apply_execution(execution, event)
            assert isinstance(outcome, Applied), outcome
            execution = outcome.record
        else:
            assert isinstance(event, DeliveryTransitioned)
            outcome = apply_delivery(deliveries.get(event.destination), event, execution)
            assert isinstance(outcome, Applied), outcome
            deliveries[event.destination] = outcome.record


def _states(events: Sequence[Transition]) -> list[str]:
    return [
        str(e.state) if isinstance(e, ExecutionTransitioned) else f"{e.destination}:{e.state}"
        for e in events
    ]


def test_success_records_result_ref_and_delivers_to_every_destination() -> None:
    executor, transport, provider, results, _ = _setup(FakeProvider(failure_rate=0, lost_rate=0))
    report = executor.execute("acme", "agent-1", "send_email", {"to": "a@example.com"}, DESTS)
    events = transport.events()
    _fold_all(events)
    assert report.state is ExecutionState.SUCCEEDED
    assert provider.calls == report.provider_calls == 1
    assert _states(events) == [
        "INTENT_RECORDED",
        "DISPATCHED",
        "SUCCEEDED",
        "webhook:crm:PENDING",
        "webhook:crm:SENT",
        "webhook:crm:ACKED",
        "queue:billing:PENDING",
        "queue:billing:SENT",
        "queue:billing:ACKED",
    ]
    dispatched, succeeded = events[1], events[2]
    assert isinstance(dispatched, ExecutionTransitioned)
    assert isinstance(succeeded, ExecutionTransitioned)
    # The provider_ref is the idempotency key, which is the operation id (ledger.domain.ids).
    assert dispatched.provider_ref == report.operation_id
    assert provider.inner.received_keys == [report.operation_id]
    # Only the reference travels; the payload is in the result store under that reference.
    assert succeeded.result_ref is not None
    assert ("acme", succeeded.result_ref) in results.payloads
    assert all(e.result_ref == succeeded.result_ref for e in events[3:])
    assert report.deliveries == dict.fromkeys(DESTS, DeliveryState.ACKED)


def test_lost_response_is_unknown_with_exactly_one_call_and_no_delivery() -> None:
    inner = FakeProvider(failure_rate=0, lost_rate=1.0)
    executor, transport, provider, _, _ = _setup(inner)
    report = executor.execute("acme", "agent-1", "charge_card", {"amount": 5}, DESTS)
    events = transport.events()
    _fold_all(events)
    assert report.state is ExecutionState.UNKNOWN
    assert _states(events) == ["INTENT_RECORDED", "DISPATCHED", "UNKNOWN"]
    assert provider.calls == 1, "UNKNOWN must never be blind-retried"
    last = events[-1]
    assert isinstance(last, ExecutionTransitioned)
    assert last.error is not None and "ResponseLost" in last.error
    # The side effect did happen; reconciliation will find it by the key.
    assert inner.side_effects() == {report.operation_id: 1}
    looked_up = inner.lookup(report.operation_id)
    assert looked_up is not None and looked_up.succeeded


def test_unexpected_error_after_dispatch_is_unknown_too() -> None:
    class Exploding(FakeProvider):
        def call(self, tool_name: str, arguments: Any, idempotency_key: str) -> ProviderResponse:
            raise TimeoutError("read timed out")

    executor, transport, provider, _, _ = _setup(Exploding())
    report = executor.execute("acme", "agent-1", "charge_card", {}, DESTS)
    assert report.state is ExecutionState.UNKNOWN
    assert provider.calls == 1
    assert _states(transport.events())[-1] == "UNKNOWN"


def test_confirmed_failure_is_failed_without_side_effect_or_delivery() -> None:
    inner = FakeProvider(failure_rate=1.0, lost_rate=0)
    executor, transport, provider, _, _ = _setup(inner)
    report = executor.execute("globex", "agent-2", "create_invoice", {"n": 1}, DESTS)
    events = transport.events()
    _fold_all(events)
    assert report.state is ExecutionState.FAILED
    assert _states(events) == ["INTENT_RECORDED", "DISPATCHED", "FAILED"]
    assert provider.calls == 1
    assert inner.side_effects() == {}
    assert report.deliveries == {}


def test_delivery_retries_never_call_the_provider_again() -> None:
    crm = ScriptedDestination("webhook:crm", [503, 503])
    billing = ScriptedDestination("queue:billing", [])
    executor, transport, provider, _, slept = _setup(
        FakeProvider(failure_rate=0, lost_rate=0), {crm.name: crm, billing.name: billing}
    )
    report = executor.execute("acme", "agent-1", "send_email", {}, DESTS)
    events = transport.events()
    _fold_all(events)
    assert provider.calls == 1
    assert crm.calls == 3 and billing.calls == 1
    assert report.deliveries == dict.fromkeys(DESTS, DeliveryState.ACKED)
    assert report.delivery_attempts == {"webhook:crm": 3, "queue:billing": 1}
    crm_states = [s for s in _states(events) if s.startswith("webhook:crm")]
    assert crm_states == [
        "webhook:crm:PENDING",
        "webhook:crm:SENT",
        "webhook:crm:PENDING",
        "webhook:crm:SENT",
        "webhook:crm:PENDING",
        "webhook:crm:SENT",
        "webhook:crm:ACKED",
    ]
    retries = [
        e
        for e in events
        if isinstance(e, DeliveryTransitioned) and e.state is DeliveryState.PENDING and e.error
    ]
    assert [r.next_attempt_at for r in retries] == [
        datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 0, 2, tzinfo=UTC),
    ]
    assert all(r.error == "HTTP 503 from webhook:crm" for r in retries)
    assert slept == [1.0, 2.0]


def test_delivery_is_dead_lettered_after_max_attempts() -> None:
    crm = ScriptedDestination("webhook:crm", [503] * 10)
    executor, transport, provider, _, _ = _setup(
        FakeProvider(failure_rate=0, lost_rate=0), {crm.name: crm}, max_attempts=2
    )
    report = executor.execute("acme", "agent-1", "send_email", {}, ["webhook:crm"])
    events = transport.events()
    _fold_all(events)
    assert report.deliveries == {"webhook:crm": DeliveryState.DEAD_LETTERED}
    assert crm.calls == 2 and provider.calls == 1
    last = events[-1]
    assert isinstance(last, DeliveryTransitioned)
    assert last.error == "gave up after 2 attempts: HTTP 503 from webhook:crm"


def test_unknown_destination_is_refused_before_anything_is_recorded() -> None:
    executor, transport, provider, _, _ = _setup(FakeProvider())
    with pytest.raises(ValueError, match="queue:nowhere"):
        executor.execute("acme", "agent-1", "send_email", {}, ["queue:nowhere"])
    assert transport.records == [] and provider.calls == 0


def test_fake_provider_is_idempotent_per_key() -> None:
    provider = FakeProvider(failure_rate=0, lost_rate=1.0, seed=3)
    with pytest.raises(ResponseLost):
        provider.call("send_email", {"to": "x"}, "op_1")
    # A repeat of the same request replays the outcome without a second side effect.
    again = provider.call("send_email", {"to": "x"}, "op_1")
    assert again.succeeded
    assert provider.side_effects() == {"op_1": 1}
    assert provider.duplicate_keys_seen == 1
    assert provider.received_keys == ["op_1", "op_1"]
    with pytest.raises(IdempotencyConflictError):
        provider.call("send_email", {"to": "y"}, "op_1")
    assert provider.max_side_effects_per_key() == 1
    assert provider.lookup("op_2") is None


def test_fake_destination_deduplicates_on_operation_id() -> None:
    dest = FakeDestination("webhook:crm", failure_rate=0.0, ack_lost_rate=1.0)
    first = dest.deliver("op_1", "sha256:" + "0" * 64)
    second = dest.deliver("op_1", "sha256:" + "0" * 64)
    assert (first.status, first.duplicate) == (504, False)
    assert (second.status, second.duplicate) == (504, True)
    assert dest.accepted == {"op_1": "sha256:" + "0" * 64}
    assert dest.duplicates_seen == 1


def test_rates_are_roughly_honoured() -> None:
    provider = FakeProvider(failure_rate=0.1, lost_rate=0.08, seed=1)
    outcomes = {"ok": 0, "failed": 0, "lost": 0}
    for i in range(2000):
        try:
            response = provider.call("t", {}, f"op_{i}")
        except ResponseLost:
            outcomes["lost"] += 1
            continue
        outcomes["ok" if response.succeeded else "failed"] += 1
    assert 150 <= outcomes["failed"] <= 250
    assert 110 <= outcomes["lost"] <= 210
    assert provider.max_side_effects_per_key() == 1


class AckLosingTransport(CapturingTransport):
    """Keeps every record (the write is durable) but loses the acknowledgement of chosen sends."""

    def __init__(self, lose: set[int]) -> None:
        super().__init__()
        self._lose = lose
        self._sends = 0

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        super().send(records)
        self._sends += 1
        if self._sends in self._lose:
            raise DeliveryTimeoutError("acknowledgement lost")


def test_a_lost_append_ack_is_retried_as_a_repeat_never_as_a_new_call() -> None:
    # Lose the acks of the intent (send 1), the dispatch (send 3) and the success (send 5).
    transport = AckLosingTransport({1, 3, 5})
    recorder = TransitionRecorder(
        Settings(home=Path("/nonexistent")), transport, results=MemoryResults()
    )
    provider = CountingProvider(FakeProvider(failure_rate=0, lost_rate=0))
    dests = {name: FakeDestination(name, 0.0) for name in DESTS}
    executor = Executor(recorder, provider, dests, sleep=lambda _s: None)
    report = executor.execute("acme", "agent-1", "send_email", {"to": "a@example.com"}, DESTS)

    events = transport.events()
    assert report.state is ExecutionState.SUCCEEDED
    assert provider.calls == 1, "a retried append must never call the provider again"
    assert {e.operation_id for e in events} == {report.operation_id}
    execution = [e for e in events if isinstance(e, ExecutionTransitioned)]
    assert [(str(e.state), e.attempt) for e in execution] == [
        ("INTENT_RECORDED", 0),
        ("INTENT_RECORDED", 0),
        ("DISPATCHED", 1),
        ("DISPATCHED", 1),
        ("SUCCEEDED", 1),
        ("SUCCEEDED", 1),
    ]
    # Each repeat is the very same event (same event id), resent while its outcome was in
    # doubt: the fold calls it a duplicate, so the projection applies it once.
    assert len({e.event_id for e in execution}) == 3
    assert [e.event_id for e in execution[::2]] == [e.event_id for e in execution[1::2]]
    sent = [r.value for r in transport.records if r.topic.endswith(".execution.v1")]
    assert sent[0::2] == sent[1::2], "a resend carries byte-identical records"
    record = None
    outcomes = []
    for event in execution:
        outcome: Any = apply_execution(record, event)
        outcomes.append(type(outcome).__name__)
        if isinstance(outcome, Applied):
            record = outcome.record
    assert outcomes == ["Applied", "Duplicate"] * 3


def test_an_append_that_keeps_timing_out_is_raised_after_the_retries() -> None:
    transport = AckLosingTransport(set(range(1, 100)))
    recorder = TransitionRecorder(
        Settings(home=Path("/nonexistent")), transport, results=MemoryResults()
    )
    provider = CountingProvider(FakeProvider(failure_rate=0, lost_rate=0))
    executor = Executor(recorder, provider, {}, record_retries=2)
    with pytest.raises(DeliveryTimeoutError):
        executor.execute("acme", "agent-1", "send_email", {"to": "a@example.com"}, [])
    assert len(transport.records) == 3  # the first try and two retries of the intent
    assert provider.calls == 0, "nothing reaches the provider before DISPATCHED is durable"


def test_recorder_metrics_count_acknowledged_appends_only() -> None:
    registry = CollectorRegistry()
    transport = AckLosingTransport({2})  # the dispatch's first ack is lost, then retried
    recorder = TransitionRecorder(
        Settings(home=Path("/nonexistent")),
        transport,
        results=MemoryResults(),
        metrics=Metrics.create(registry),
    )
    executor = Executor(
        recorder,
        CountingProvider(FakeProvider(failure_rate=0, lost_rate=0)),
        {"webhook:crm": FakeDestination("webhook:crm", 0.0)},
    )
    executor.execute("acme", "agent-1", "send_email", {"to": "a@example.com"}, ["webhook:crm"])

    def appended(machine: str) -> float | None:
        return registry.get_sample_value("opledger_records_appended_total", {"machine": machine})

    # intent, dispatched (sent twice, acknowledged once), succeeded; pending, sent, acked.
    assert len(transport.records) == 7
    assert appended("execution") == 3
    assert appended("delivery") == 3
    assert registry.get_sample_value("opledger_append_seconds_count") == 6
