"""How ``opledger audit`` labels an operation's events and answers "execution or delivery?"
for each retry, from events alone (the reads from the broker are
tests/integration/test_demo.py's)."""

from __future__ import annotations

from datetime import timedelta

from ledger.domain.states import DeliveryState, ExecutionState
from opledger.audit import Audit, _describe
from tests.unit.factories import T0, decided, delivery, execution

X, D = ExecutionState, DeliveryState


def _audit(events: list[object], claimed: int | None = None) -> Audit:
    result = Audit("op", "tenant-a")
    coords = [("p.execution.v1", 0, n) for n in range(len(events))]
    listed = [(c, e, "sdk") for c, e in zip(coords, events, strict=True)]
    known = {c: ("X", 0, None) for c in coords[: len(events) if claimed is None else claimed]}
    _describe(result, listed, known)  # type: ignore[arg-type]
    return result


def test_a_new_attempt_is_an_execution_retry_naming_the_decision_that_permitted_it() -> None:
    decision = decided(1)
    events = [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.UNKNOWN, 1, occurred_at=T0 + timedelta(seconds=1, milliseconds=100)),
        decision,
        execution(X.DISPATCHED, 2, decision_id=decision.event_id),
        execution(X.SUCCEEDED, 2),
    ]
    result = _audit(events)
    assert len(result.retries) == 1
    assert result.retries[0].startswith("attempt 2 was an execution retry: the tool was called")
    assert "permitted by decision NEW_ATTEMPT (lookup NOT_FOUND" in result.retries[0]
    assert decision.policy_version is not None and decision.policy_version in result.retries[0]
    kinds = [line.kind for line in result.lines]
    assert kinds == ["execution", "execution", "execution", "decision", "execution", "execution"]
    assert result.lines[4].text.startswith("DISPATCHED attempt 2")


def test_a_resend_is_a_delivery_retry_and_the_tool_ran_once() -> None:
    events = [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.SUCCEEDED, 1, occurred_at=T0 + timedelta(seconds=1, milliseconds=1)),
        delivery(D.PENDING, 0, occurred_at=T0 + timedelta(seconds=2)),
        delivery(D.SENT, 1, occurred_at=T0 + timedelta(seconds=3)),
        delivery(D.SENT, 2, occurred_at=T0 + timedelta(seconds=4)),
        delivery(D.ACKED, 2, occurred_at=T0 + timedelta(seconds=5)),
    ]
    result = _audit(events)
    assert len(result.retries) == 1
    assert "1 resend(s) to" in result.retries[0]
    assert "were delivery retries" in result.retries[0]
    assert "the tool was not called again" in result.retries[0]
    assert "a delivery retry" in result.lines[5].text


def test_one_call_and_one_send_is_no_retry_and_unprojected_events_are_counted() -> None:
    events = [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.SUCCEEDED, 1, occurred_at=T0 + timedelta(seconds=1, milliseconds=1)),
    ]
    result = _audit(events, claimed=2)
    assert result.retries == [
        "no retry: the tool was called at most once, and each destination was sent to once"
    ]
    assert result.unprojected == 1
    assert [line.projected for line in result.lines] == [True, True, False]
