"""The recorder's contract with an in-memory transport: in-doubt handles, the tenant boundary on
every write path, and errors that say what to do. Whether records reach Kafka is the integration
tier's business; here it is which records the recorder *decides* to send."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pytest
from factories import RESULT, TENANT, delivery, execution

from ledger.codec import default_codec
from ledger.domain.events import Transition
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.log import OutgoingRecord
from ledger.settings import Settings
from producers import (
    AsyncTransitionRecorder,
    DeliveryError,
    DeliveryTimeoutError,
    IllegalTransitionError,
    InDoubtError,
    InvalidTransitionError,
    RecordError,
    TrackedOperation,
    TransitionRecorder,
)

X = ExecutionState
D = DeliveryState
SETTINGS = Settings(home=Path("/nonexistent"))


class FlakyTransport:
    """Keeps what it acknowledged; fails the sends whose numbers are in ``fail`` (1-based)
    either before anything is written (``lost``) or after (the ack, not the write, is lost)."""

    def __init__(self, fail: Sequence[int] = (), *, written: bool = True) -> None:
        self.fail = set(fail)
        self.written = written
        self.records: list[OutgoingRecord] = []
        self.sends = 0

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        self.sends += 1
        if self.sends in self.fail and not self.written:
            raise DeliveryError("broker refused")
        self.records.extend(records)
        if self.sends in self.fail:
            raise DeliveryTimeoutError("acknowledgement lost")

    def close(self) -> None:
        pass

    def events(self) -> list[Transition]:
        return [default_codec().decode(r.value) for r in self.records]


def _recorder(transport: FlakyTransport) -> TransitionRecorder:
    return TransitionRecorder(SETTINGS, transport)


def test_a_failed_append_leaves_the_handle_in_doubt_until_the_same_event_is_resent() -> None:
    transport = FlakyTransport(fail=[2])
    recorder = _recorder(transport)
    op = recorder.intent(TENANT, "agent-1", "send_email", {"to": "a@example.com"})
    with pytest.raises(DeliveryTimeoutError) as failure:
        recorder.dispatched(op, provider_ref="p-1")
    assert failure.value.handle is op
    assert op.in_doubt is not None
    assert op.execution is not None and op.execution.state is X.INTENT_RECORDED
    # Any other step is refused, whatever it is: the recorder cannot know what is written.
    for step in (
        lambda: recorder.failed(op, "gave up"),
        lambda: recorder.dispatched(op, provider_ref="p-1"),
        lambda: recorder.unknown(op, "lost"),
    ):
        with pytest.raises(InDoubtError, match="resend"):
            step()
    sends_before = transport.sends
    assert recorder.resend(op) is True
    assert transport.sends == sends_before + 1
    assert op.in_doubt is None and op.execution.state is X.DISPATCHED
    dispatched = [e for e in transport.events() if e.state is X.DISPATCHED]
    assert len(dispatched) == 2
    assert dispatched[0] == dispatched[1], "the resend is the identical event, same event id"
    assert recorder.resend(op) is False, "nothing is in doubt any more"
    assert recorder.failed(op, "provider said no") is True


def test_a_refused_append_is_in_doubt_too_and_the_intent_handle_comes_with_the_error() -> None:
    transport = FlakyTransport(fail=[1], written=False)
    recorder = _recorder(transport)
    with pytest.raises(DeliveryError) as failure:
        recorder.intent(TENANT, "agent-1", "send_email", {"to": "a@example.com"})
    handle = failure.value.handle
    assert handle.in_doubt is not None and handle.execution is None
    assert recorder.resend(handle) is True
    assert handle.execution is not None and handle.execution.state is X.INTENT_RECORDED
    assert len(transport.records) == 1


def test_an_in_doubt_append_batch_marks_every_handle_it_touched() -> None:
    transport = FlakyTransport(fail=[1])
    recorder = _recorder(transport)
    first = [execution(X.INTENT_RECORDED, 0)]
    with pytest.raises(DeliveryTimeoutError) as failure:
        recorder.append(first)
    (handle,) = failure.value.handles.values()
    with pytest.raises(InDoubtError):
        recorder.append([execution(X.DISPATCHED, 1)], known=[handle])
    assert recorder.resend(handle) is True
    assert recorder.append([execution(X.DISPATCHED, 1)], known=[handle])


def test_delivery_needs_the_execution_on_every_write_path() -> None:
    transport = FlakyTransport()
    recorder = _recorder(transport)
    # The batch API folds a delivery onto an empty history when its operation is not known:
    # no execution, no tenant to check against, so it is refused and nothing is sent.
    with pytest.raises(IllegalTransitionError, match="no recorded execution"):
        recorder.append([delivery(D.PENDING, 0)])
    # A handle that knows only deliveries cannot record another one either.
    orphan = TrackedOperation.unknown(delivery(D.PENDING, 0).operation_id)
    with pytest.raises(IllegalTransitionError, match="not known"):
        recorder.delivery_pending(orphan, "webhook:crm")
    assert transport.records == []


@pytest.mark.parametrize("state", [X.INTENT_RECORDED, X.DISPATCHED, X.UNKNOWN, X.FAILED])
def test_a_delivery_opens_only_after_success(state: ExecutionState) -> None:
    recorder = _recorder(FlakyTransport())
    path = {
        X.INTENT_RECORDED: [(X.INTENT_RECORDED, 0)],
        X.DISPATCHED: [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1)],
        X.UNKNOWN: [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.UNKNOWN, 1)],
        X.FAILED: [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.FAILED, 1)],
    }[state]
    (op,) = recorder.append([execution(s, a) for s, a in path]).values()
    with pytest.raises(IllegalTransitionError, match="before the execution succeeded"):
        recorder.delivery_pending(op, "webhook:crm")
    with pytest.raises(IllegalTransitionError, match="before the execution succeeded"):
        recorder.append([delivery(D.PENDING, 0)], known=[op])


def test_another_tenants_delivery_event_is_refused_and_names_no_tenant() -> None:
    recorder = _recorder(FlakyTransport())
    history = [execution(s, a) for s, a in ((X.INTENT_RECORDED, 0), (X.DISPATCHED, 1))]
    history.append(execution(X.SUCCEEDED, 1, result_ref=RESULT))
    (op,) = recorder.append(history).values()
    for state, attempt in ((D.PENDING, 0), (D.SENT, 1), (D.ACKED, 1), (D.DEAD_LETTERED, 0)):
        foreign = delivery(state, attempt, tenant_id="globex")
        with pytest.raises(IllegalTransitionError) as refused:
            recorder.append([foreign], known=[op])
        assert "globex" not in str(refused.value) and TENANT not in str(refused.value)


def test_naive_datetimes_and_unstorable_text_are_clear_record_errors() -> None:
    transport = FlakyTransport()
    recorder = _recorder(transport)
    history = [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.SUCCEEDED, 1, result_ref=RESULT),
    ]
    (op,) = recorder.append(history).values()
    recorder.delivery_pending(op, "webhook:crm")
    recorder.delivery_sent(op, "webhook:crm")
    other = recorder.intent(TENANT, "agent-1", "send_email", {"n": 1})
    recorder.dispatched(other, provider_ref="p-2")
    sent = len(transport.records)
    with pytest.raises(InvalidTransitionError, match="timezone-aware") as naive:
        recorder.delivery_retry(op, "webhook:crm", datetime(2026, 1, 1), "503")
    assert isinstance(naive.value, RecordError)
    # PostgreSQL cannot store NUL: refused here rather than written to a topic forever.
    with pytest.raises(InvalidTransitionError, match="NUL"):
        recorder.failed(other, "boom\x00")
    with pytest.raises(InvalidTransitionError, match=r"unicode string|surrogate"):
        recorder.failed(other, "boom \ud800")
    assert len(transport.records) == sent, "nothing refused was sent"


def test_the_asyncio_recorder_follows_the_same_rules() -> None:
    transport = FlakyTransport(fail=[2])

    async def scenario() -> None:
        recorder = AsyncTransitionRecorder(SETTINGS, transport)
        op = await recorder.intent(TENANT, "agent-1", "send_email", {"to": "a@example.com"})
        with pytest.raises(DeliveryTimeoutError):
            await recorder.dispatched(op, provider_ref="p-1")
        with pytest.raises(InDoubtError):
            await recorder.failed(op, "no")
        assert await recorder.resend(op) is True
        assert await recorder.succeeded(op, RESULT) is True
        await recorder.close()

    asyncio.run(scenario())
    states = [(e.state, e.attempt) for e in transport.events()]
    assert states == [
        (X.INTENT_RECORDED, 0),
        (X.DISPATCHED, 1),
        (X.DISPATCHED, 1),
        (X.SUCCEEDED, 1),
    ]
