"""The tests' independent fold (``tests/independent_fold.py``): its rules, one at a time, and
the same outcomes and rows as the projector's fold (``ledger.domain.fold``) on generated
histories, resends, rival versions, mutated copies and stray events.

The integration tier compares the projections with the independent fold; this tier shows the
two folds agree event by event (a difference names the first event they disagree on), so a
defect in either one fails here, fast, before it can hide in the other.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from factories import OP, RESULT, decided, delivery, execution, fresh_event_id, owned
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    Duplicate,
    ExecutionRecord,
    apply_control,
    apply_delivery,
    apply_execution,
)
from ledger.domain.ids import content_ref, request_hash
from ledger.domain.reconcile import Decision
from ledger.domain.states import DeliveryState, ExecutionState
from tests import independent_fold
from tests.independent_fold import (
    DECISIONS_IN,
    DELIVERY_NEXT,
    EXECUTION_NEXT,
    IndependentFold,
    delivery_row,
    operation_row,
)

X = ExecutionState
D = DeliveryState
DESTINATIONS = ("https://hooks.example.com/a", "queue:orders")


# --- its rules --------------------------------------------------------------------------------


def _folded(*events: OperationEvent) -> tuple[IndependentFold, list[str]]:
    fold = IndependentFold()
    return fold, [fold.fold(e) for e in events]


def _unknown() -> list[OperationEvent]:
    return [execution(X.INTENT_RECORDED, 0), execution(X.DISPATCHED, 1), execution(X.UNKNOWN, 1)]


def test_unknown_is_not_permission_to_retry() -> None:
    _, outcomes = _folded(*_unknown(), execution(X.DISPATCHED, 2))
    assert outcomes[-1] == "anomaly"


def test_a_new_attempt_needs_the_decision_that_permits_it_and_uses_it_up() -> None:
    permit = decided(1, Decision.NEW_ATTEMPT)
    refused = decided(1, Decision.REFUSE)
    other = fresh_event_id()
    fold, outcomes = _folded(
        *_unknown(),
        refused,
        execution(X.DISPATCHED, 2, decision_id=refused.event_id),  # a refusal permits nothing
        permit,
        execution(X.DISPATCHED, 2, decision_id=other),  # cites another decision
        execution(X.DISPATCHED, 2, decision_id=permit.event_id),
    )
    assert outcomes[3:] == ["applied", "anomaly", "applied", "anomaly", "applied"]
    op = fold.operations[OP]
    assert (op.state, op.attempt, op.permit, op.parked, op.decision) == (
        X.DISPATCHED,
        2,
        None,
        None,
        "NEW_ATTEMPT",
    )


def test_a_resend_is_a_duplicate_and_a_rival_version_an_anomaly() -> None:
    intent = execution(X.INTENT_RECORDED, 0)
    fold, outcomes = _folded(
        intent, intent, intent.model_copy(update={"event_id": fresh_event_id()})
    )
    assert outcomes == ["applied", "duplicate", "anomaly"]
    assert fold.operations[OP].version == 1


def test_another_tenant_or_request_is_an_anomaly_even_with_a_recorded_event_id() -> None:
    intent = execution(X.INTENT_RECORDED, 0)
    _, outcomes = _folded(
        intent,
        intent.model_copy(update={"tenant_id": "intruder"}),
        intent.model_copy(update={"request_hash": request_hash("other", {})}),
    )
    assert outcomes == ["applied", "anomaly", "anomaly"]


def test_a_lower_lease_token_is_fenced() -> None:
    _, outcomes = _folded(
        execution(X.INTENT_RECORDED, 0, lease_token=1),
        owned(3),
        execution(X.DISPATCHED, 1, lease_token=1),
        owned(3),  # a new owner's token is greater than every earlier one
        execution(X.DISPATCHED, 1, lease_token=3),
    )
    assert outcomes == ["applied", "applied", "anomaly", "anomaly", "applied"]


def test_nothing_is_decided_or_owned_after_the_execution_finished() -> None:
    cancel = decided(1, Decision.CANCEL)
    _, outcomes = _folded(
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        cancel,
        execution(X.FAILED, 1),
        decided(1, Decision.PARK),
        owned(5),
        cancel,  # its resend is still recognised
    )
    assert outcomes == ["applied"] * 4 + ["anomaly", "anomaly", "duplicate"]


def test_a_delivery_needs_the_result_of_a_succeeded_execution() -> None:
    steps = [
        (delivery(D.PENDING, 0), "anomaly"),  # no execution at all
        (execution(X.INTENT_RECORDED, 0), "applied"),
        (execution(X.DISPATCHED, 1), "applied"),
        (delivery(D.PENDING, 0), "anomaly"),  # not SUCCEEDED yet
        (execution(X.SUCCEEDED, 1), "applied"),
        (delivery(D.PENDING, 0, result_ref=content_ref(b"another result")), "anomaly"),
        (delivery(D.SENT, 1), "anomaly"),  # a delivery starts PENDING
        (delivery(D.PENDING, 0), "applied"),
    ]
    _, outcomes = _folded(*(event for event, _ in steps))
    assert outcomes == [outcome for _, outcome in steps]


def test_a_redrive_opens_a_new_round() -> None:
    first = delivery(D.PENDING, 0)
    sent = delivery(D.SENT, 1)
    fold, outcomes = _folded(
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.SUCCEEDED, 1),
        first,
        sent,
        delivery(D.DEAD_LETTERED, 1),
        delivery(D.PENDING, 1),  # a redrive says why
        delivery(D.PENDING, 1, error="sent again by alice: the endpoint is back"),
        sent,  # a late resend of the first round's send
        delivery(D.SENT, 2),
    )
    assert outcomes[3:] == ["applied"] * 3 + ["anomaly", "applied", "duplicate", "applied"]
    d = fold.deliveries[(OP, first.destination)]
    assert (d.redrives, d.attempts, d.state) == (1, 2, D.SENT)
    assert first.event_id in d.retired and d.round_started_at is not None


def test_the_tables_name_every_state_and_decision_of_the_schemas() -> None:
    # (the module asserts it on import; here so a reader finds it)
    assert set(EXECUTION_NEXT) == {s.value for s in X}
    assert set(DELIVERY_NEXT) == {s.value for s in D}
    assert set().union(*DECISIONS_IN.values()) == {d.value for d in Decision}


def test_the_independent_fold_imports_nothing_of_the_projectors_fold() -> None:
    """Only the event models and the state enums: the rules are its own."""
    source = Path(independent_fold.__file__).read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert {m for m in imported if m.split(".")[0] in ("ledger", "processors", "projections")} == {
        "ledger.domain.events",
        "ledger.domain.states",
    }


# --- the same as the projector's fold ---------------------------------------------------------


class DomainFold:
    """The projector's fold driven the same way, for comparison."""

    def __init__(self) -> None:
        self.operation: ExecutionRecord | None = None
        self.deliveries: dict[str, DeliveryRecord] = {}

    def fold(self, event: OperationEvent) -> str:
        outcome: Any
        if isinstance(event, ExecutionTransitioned):
            outcome = apply_execution(self.operation, event)
        elif isinstance(event, OwnershipTaken | ReconciliationDecided):
            outcome = apply_control(self.operation, event)
        else:
            current = self.deliveries.get(event.destination)
            outcome = apply_delivery(current, event, self.operation)
            if isinstance(outcome, Applied):
                self.deliveries[event.destination] = outcome.record
                return "applied"
        if isinstance(outcome, Applied):
            self.operation = outcome.record
            return "applied"
        return "duplicate" if isinstance(outcome, Duplicate) else "anomaly"


def _valid(event: OperationEvent, **changes: Any) -> OperationEvent | None:
    """``event`` with ``changes``, if the contract accepts it (the codec refuses the rest, so
    the fold never sees them)."""
    try:
        return type(event).model_validate({**event.model_dump(), **changes})
    except ValidationError:
        return None


#: Fields a mutated copy changes while it keeps its event id (a corrupt or forged resend).
_MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "state_x": st.sampled_from(list(X)),
    "state_d": st.sampled_from(list(D)),
    "attempt": st.integers(0, 4),
    "tenant_id": st.just("intruder"),
    "lease_token": st.sampled_from([None, 1, 2, 3, 7]),
    "error": st.sampled_from([None, "", "again"]),
    "decision": st.sampled_from(list(Decision)),
    "result_ref": st.sampled_from([None, RESULT, content_ref(b"other")]),
}


@st.composite
def histories(draw: st.DrawFn) -> list[OperationEvent]:
    """One operation's events: mostly legal next steps (so deep states are reached), mixed
    with resends, rival versions, mutated copies, ownership changes, decisions, deliveries to
    two destinations and stray events."""
    guide = DomainFold()  # only steers the drawing towards legal steps
    events: list[OperationEvent] = []
    token = 0
    for index in range(draw(st.integers(1, 40))):
        kind = draw(
            st.sampled_from(
                ["legal"] * 4 + ["resend", "rival", "mutant", "owner", "decide", "deliver", "stray"]
            )
        )
        op = guide.operation
        event: OperationEvent | None = None
        if kind == "resend" and events:
            event = draw(st.sampled_from(events))
        elif kind == "rival" and events:
            event = _valid(draw(st.sampled_from(events)), event_id=fresh_event_id())
        elif kind == "mutant" and events:
            earlier = draw(st.sampled_from(events))
            name = draw(st.sampled_from(sorted(_MUTATIONS)))
            value = draw(_MUTATIONS[name])
            field_name = "state" if name.startswith("state_") else name
            if field_name in type(earlier).model_fields:
                event = _valid(earlier, **{field_name: value})
        elif kind == "owner" and op is not None:
            token = draw(st.integers(max(0, token - 1), token + 2)) or 1
            event = owned(token, op.attempt)
        elif kind == "decide" and op is not None:
            # Mostly a new attempt, the decision with the most consequences to get right.
            choice = draw(st.sampled_from([*Decision, Decision.NEW_ATTEMPT, Decision.NEW_ATTEMPT]))
            attempt = draw(st.sampled_from([op.attempt, op.attempt + 1]))
            event = decided(attempt, choice, lease_token=draw(st.sampled_from([None, token or 1])))
        elif kind == "deliver":
            destination = draw(st.sampled_from(DESTINATIONS))
            current = guide.deliveries.get(destination)
            state = draw(st.sampled_from(list(D)))
            attempts = 0 if current is None else current.attempts
            attempt = attempts + 1 if state is D.SENT else attempts
            error = draw(st.sampled_from([None, "no answer"]))
            if state is D.DEAD_LETTERED:
                error = "gave up"
            event = delivery(state, attempt, destination=destination, error=error)
        elif kind == "legal" and op is not None and EXECUTION_NEXT[op.state.value]:
            steps = sorted(EXECUTION_NEXT[op.state.value])
            # Steps that keep the operation open, twice as likely: histories get long.
            to = X(draw(st.sampled_from(steps + 2 * [s for s in steps if EXECUTION_NEXT[s]])))
            attempt = op.attempt + 1 if to is X.DISPATCHED else op.attempt
            cite = op.permit[1] if op.permit is not None and draw(st.booleans()) else None
            event = _valid(
                execution(to, max(attempt, 1)),
                attempt=attempt,
                lease_token=draw(st.sampled_from([None, token or None])),
                decision_id=cite,
            )
        elif kind == "legal" and op is None:
            event = execution(X.INTENT_RECORDED, 0)
        else:
            event = _valid(
                execution(X.DISPATCHED, 1, provider_ref=f"prov-{index}"),
                state=draw(st.sampled_from(list(X))),
                attempt=draw(st.integers(0, 4)),
            )
        if event is not None:
            events.append(event)
            guide.fold(event)
    return events


@st.composite
def delivery_histories(draw: st.DrawFn) -> list[OperationEvent]:
    """A succeeded operation, then its deliveries to two destinations: mostly legal steps
    (redrives of dead letters included), with resends, rival versions, mutated copies and
    stray events."""
    events: list[OperationEvent] = [
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.SUCCEEDED, 1),
    ]
    guide = DomainFold()
    for event in events:
        guide.fold(event)
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["legal"] * 5 + ["resend", "rival", "mutant", "stray"]))
        destination = draw(st.sampled_from(DESTINATIONS))
        current = guide.deliveries.get(destination)
        event: OperationEvent | None = None
        if kind == "resend" and len(events) > 3:
            event = draw(st.sampled_from(events[3:]))
        elif kind == "rival" and len(events) > 3:
            event = _valid(draw(st.sampled_from(events[3:])), event_id=fresh_event_id())
        elif kind == "mutant" and len(events) > 3:
            name = draw(st.sampled_from(["state_d", "attempt", "error", "result_ref", "tenant_id"]))
            field_name = "state" if name == "state_d" else name
            event = _valid(
                draw(st.sampled_from(events[3:])), **{field_name: draw(_MUTATIONS[name])}
            )
        elif kind == "legal" and current is None:
            event = delivery(D.PENDING, 0, destination=destination)
        elif kind == "legal" and current is not None and DELIVERY_NEXT[current.state.value]:
            to = D(draw(st.sampled_from(sorted(DELIVERY_NEXT[current.state.value]))))
            attempt = current.attempts + 1 if to is D.SENT else current.attempts
            error = draw(st.sampled_from([None, "no answer", "sent again by alice"]))
            if to is D.DEAD_LETTERED:
                error = "gave up"
            event = delivery(to, attempt, destination=destination, error=error)
        else:
            state = draw(st.sampled_from(list(D)))
            event = _valid(
                delivery(D.DEAD_LETTERED, 1, destination=destination),
                state=state,
                attempt=draw(st.integers(0, 4)),
            )
        if event is not None:
            events.append(event)
            guide.fold(event)
    return events


def _disagreement(events: Sequence[OperationEvent]) -> str | None:
    ours, theirs = IndependentFold(), DomainFold()
    for i, event in enumerate(events):
        mine, domain = ours.fold(event), theirs.fold(event)
        if mine != domain:
            return f"event {i} ({event!r}): independent {mine}, projector's fold {domain}"
        op = ours.operations.get(event.operation_id)
        if (op is None) != (theirs.operation is None) or (
            op is not None and operation_row(op) != operation_row(theirs.operation)  # type: ignore[arg-type]  # same fields
        ):
            return f"after event {i} ({event!r}): the operation rows differ"
        for destination, record in theirs.deliveries.items():
            d = ours.deliveries.get((OP, destination))
            if d is None or delivery_row(d) != delivery_row(record):  # type: ignore[arg-type]  # same fields
                return f"after event {i} ({event!r}): the delivery rows to {destination} differ"
        if len(ours.deliveries) != len(theirs.deliveries):
            return f"after event {i}: the deliveries differ"
    return None


@settings(max_examples=500, deadline=None)
@given(histories())
def test_the_independent_fold_agrees_with_the_projectors_event_by_event(
    events: list[OperationEvent],
) -> None:
    assert _disagreement(events) is None, _disagreement(events)


@settings(max_examples=400, deadline=None)
@given(delivery_histories())
def test_the_independent_fold_agrees_with_the_projectors_on_deliveries(
    events: list[OperationEvent],
) -> None:
    assert _disagreement(events) is None, _disagreement(events)


def test_the_comparison_sees_a_fold_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A defective fold, one that took UNKNOWN as permission to retry (the seed's most
    dangerous mistake), differs from the independent one at the retry."""
    real = apply_execution

    def lenient(current: ExecutionRecord | None, event: ExecutionTransitioned) -> Any:
        if current is not None and current.state is X.UNKNOWN:
            current = replace(current, permit=(event.attempt, event.decision_id or ""))
            event = event.model_copy(update={"decision_id": event.decision_id or ""})
        return real(current, event)

    events = [*_unknown(), execution(X.DISPATCHED, 2)]
    assert _disagreement(events) is None
    monkeypatch.setattr(sys.modules[__name__], "apply_execution", lenient)
    found = _disagreement(events)
    assert found is not None and found.startswith("event 3 ") and "independent anomaly" in found
