"""The fold against the transition tables: exhaustive pairs, and property tests whose invariants
are named predicates over the accepted history."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise, product

import pytest
from factories import (
    OTHER_OP,
    RESULT,
    SUCCEEDED,
    decided,
    delivery,
    execution,
    fresh_event_id,
    owned,
    succeeded_execution,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger.domain.events import (
    DeliveryTransitioned,
    ExecutionTransitioned,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    Duplicate,
    ExecutionRecord,
    Rejected,
    RejectionKind,
    apply_control,
    apply_delivery,
    apply_execution,
)
from ledger.domain.ids import request_hash
from ledger.domain.reconcile import Decision
from ledger.domain.states import (
    DELIVERY_TERMINAL,
    DELIVERY_TRANSITIONS,
    EXECUTION_TERMINAL,
    EXECUTION_TRANSITIONS,
    DeliveryState,
    ExecutionState,
    delivery_predecessors,
    execution_predecessors,
)

X = ExecutionState
D = DeliveryState


# --- folding helpers --------------------------------------------------------------------------


ExecutionEvent = ExecutionTransitioned | OwnershipTaken | ReconciliationDecided


def apply_any(record: ExecutionRecord | None, event: ExecutionEvent) -> object:
    """The fold of whatever the execution topic carries."""
    if isinstance(event, ExecutionTransitioned):
        return apply_execution(record, event)
    return apply_control(record, event)


def fold_execution(events: Sequence[ExecutionEvent]) -> ExecutionRecord:
    record = None
    for event in events:
        outcome = apply_any(record, event)
        assert isinstance(outcome, Applied), f"{event}: {outcome}"
        record = outcome.record
    assert record is not None
    return record


def history(path: Sequence[tuple[ExecutionState, int]]) -> list[ExecutionEvent]:
    """The events of a path of (state, attempt) steps: a dispatch out of UNKNOWN is preceded by
    the reconciliation decision that permits it, as it must be."""
    events: list[ExecutionEvent] = []
    state = None
    for to, attempt in path:
        if state is X.UNKNOWN and to is X.DISPATCHED:
            decision = decided(attempt - 1)
            events.append(decision)
            events.append(execution(to, attempt, decision_id=decision.event_id))
        else:
            events.append(execution(to, attempt))
        state = to
    return events


def fold_delivery(events: Sequence[DeliveryTransitioned]) -> DeliveryRecord:
    record = None
    for event in events:
        outcome = apply_delivery(record, event, SUCCEEDED)
        assert isinstance(outcome, Applied), f"{event.state}/{event.attempt}: {outcome}"
        record = outcome.record
    assert record is not None
    return record


# Legal paths into every state, some through a retry, as (state, attempt) steps.
EXECUTION_PATHS: list[list[tuple[ExecutionState, int]]] = [
    [(X.INTENT_RECORDED, 0)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.UNKNOWN, 1)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.UNKNOWN, 1), (X.DISPATCHED, 2)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.UNKNOWN, 1), (X.DISPATCHED, 2), (X.UNKNOWN, 2)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.SUCCEEDED, 1)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.UNKNOWN, 1), (X.SUCCEEDED, 1)],
    [(X.INTENT_RECORDED, 0), (X.DISPATCHED, 1), (X.FAILED, 1)],
    [(X.INTENT_RECORDED, 0), (X.FAILED, 0)],
]
DELIVERY_PATHS: list[list[tuple[DeliveryState, int]]] = [
    [(D.PENDING, 0)],
    [(D.PENDING, 0), (D.SENT, 1)],
    [(D.PENDING, 0), (D.SENT, 1), (D.PENDING, 1)],
    [(D.PENDING, 0), (D.SENT, 1), (D.PENDING, 1), (D.SENT, 2)],
    [(D.PENDING, 0), (D.SENT, 1), (D.ACKED, 1)],
    [(D.PENDING, 0), (D.SENT, 1), (D.PENDING, 1), (D.SENT, 2), (D.ACKED, 2)],
    [(D.PENDING, 0), (D.DEAD_LETTERED, 0)],
    [(D.PENDING, 0), (D.SENT, 1), (D.DEAD_LETTERED, 1)],
]


def _path_id(path: Sequence[tuple[object, int]]) -> str:
    return ">".join(f"{s}{a}" for s, a in path)


def test_paths_reach_every_state() -> None:
    assert {p[-1][0] for p in EXECUTION_PATHS} == set(X)
    assert {p[-1][0] for p in DELIVERY_PATHS} == set(D)


# --- exhaustive tables ------------------------------------------------------------------------


def _expected_execution_attempt(current: ExecutionRecord, to: ExecutionState) -> int:
    return current.attempt + 1 if to is X.DISPATCHED else current.attempt


@pytest.mark.parametrize("path", EXECUTION_PATHS, ids=_path_id)
@pytest.mark.parametrize("to", list(X))
def test_execution_pairs_follow_the_table(
    path: list[tuple[ExecutionState, int]], to: ExecutionState
) -> None:
    record = fold_execution(history(path))
    attempt = _expected_execution_attempt(record, to)
    try:
        event = execution(to, attempt)
    except ValidationError:
        # e.g. INTENT_RECORDED -> SUCCEEDED at attempt 0 cannot even be written; the table must
        # not allow such a pair, and any writable attempt is refused by the fold.
        assert to not in EXECUTION_TRANSITIONS[record.state]
        event = execution(to, 0 if to is X.INTENT_RECORDED else attempt + 1)
    outcome = apply_execution(record, event)
    if record.state is X.UNKNOWN and to is X.DISPATCHED:
        # In the table, but only through a recorded decision: blind, it is refused...
        assert isinstance(outcome, Rejected), outcome
        assert "reconciliation decision" in outcome.reason
        # ...and with a NEW_ATTEMPT decision for this attempt, cited, it is applied.
        decision = decided(record.attempt)
        permitted = apply_control(record, decision)
        assert isinstance(permitted, Applied), permitted
        outcome = apply_execution(
            permitted.record, execution(to, attempt, decision_id=decision.event_id)
        )
        assert isinstance(outcome, Applied), outcome
        assert outcome.record.permit is None, "a permit is used up by its dispatch"
    elif to in EXECUTION_TRANSITIONS[record.state]:
        assert isinstance(outcome, Applied), outcome
        assert outcome.record.state is to
        assert outcome.record.attempt == attempt
        assert outcome.record.version == record.version + 1
    elif (event.state, event.attempt) in record.seen:
        # Another event for what is already recorded: a conflict, never a silent duplicate.
        assert isinstance(outcome, Rejected) and outcome.kind is RejectionKind.CONFLICT, outcome
    else:
        assert isinstance(outcome, Rejected), outcome
        assert outcome.kind is RejectionKind.ILLEGAL


@pytest.mark.parametrize("path", EXECUTION_PATHS, ids=_path_id)
def test_the_same_event_again_is_a_duplicate_and_changes_nothing(
    path: list[tuple[ExecutionState, int]],
) -> None:
    events = history(path)
    record = fold_execution(events)
    for event in events:
        assert isinstance(apply_any(record, event), Duplicate), event


@pytest.mark.parametrize("path", EXECUTION_PATHS, ids=_path_id)
@pytest.mark.parametrize("to", list(X))
@pytest.mark.parametrize("delta", [-1, 1, 2])
def test_execution_wrong_attempt_is_rejected(
    path: list[tuple[ExecutionState, int]], to: ExecutionState, delta: int
) -> None:
    record = fold_execution(history(path))
    attempt = _expected_execution_attempt(record, to) + delta
    try:
        event = execution(to, attempt)
    except ValidationError:
        return  # not writable at all
    outcome = apply_execution(record, event)
    assert isinstance(outcome, Rejected), outcome
    assert (outcome.kind is RejectionKind.CONFLICT) == ((to, attempt) in record.seen)


@pytest.mark.parametrize("path", DELIVERY_PATHS, ids=_path_id)
@pytest.mark.parametrize("to", list(D))
def test_delivery_pairs_follow_the_table(
    path: list[tuple[DeliveryState, int]], to: DeliveryState
) -> None:
    record = fold_delivery([delivery(s, a) for s, a in path])
    attempt = record.attempts + 1 if to is D.SENT else record.attempts
    outcome = apply_delivery(record, delivery(to, attempt), SUCCEEDED)
    if record.state is D.DEAD_LETTERED and to is D.PENDING:
        # A redrive: only with a reason, and it opens a new round (attempts keep counting).
        assert isinstance(outcome, Rejected) and "reason" in outcome.reason, outcome
        redrive = delivery(to, attempt, error="redriven by alice: the endpoint is fixed")
        outcome = apply_delivery(record, redrive, SUCCEEDED)
        assert isinstance(outcome, Applied), outcome
        assert outcome.record.redrives == record.redrives + 1
        assert dict(outcome.record.seen) == {(D.PENDING, attempt): redrive.event_id}
        assert isinstance(apply_delivery(outcome.record, redrive, SUCCEEDED), Duplicate)
    elif to in DELIVERY_TRANSITIONS[record.state]:
        assert isinstance(outcome, Applied), outcome
        assert outcome.record.state is to
        assert outcome.record.attempts == attempt
    elif (to, attempt) in record.seen:
        assert isinstance(outcome, Rejected) and outcome.kind is RejectionKind.CONFLICT, outcome
    else:
        assert isinstance(outcome, Rejected), outcome


@pytest.mark.parametrize("path", DELIVERY_PATHS, ids=_path_id)
@pytest.mark.parametrize("to", list(D))
@pytest.mark.parametrize("delta", [-1, 1, 2])
def test_delivery_wrong_attempt_is_rejected(
    path: list[tuple[DeliveryState, int]], to: DeliveryState, delta: int
) -> None:
    record = fold_delivery([delivery(s, a) for s, a in path])
    attempt = (record.attempts + 1 if to is D.SENT else record.attempts) + delta
    try:
        event = delivery(to, attempt)
    except ValidationError:
        return
    outcome = apply_delivery(record, event, SUCCEEDED)
    assert isinstance(outcome, Rejected), outcome
    redrive = record.state is D.DEAD_LETTERED and to is D.PENDING
    assert (outcome.kind is RejectionKind.CONFLICT) == (
        (to, attempt) in record.seen and not redrive
    )


def test_tables_are_total_and_terminals_are_as_documented() -> None:
    assert set(EXECUTION_TRANSITIONS) == set(X)
    assert set(DELIVERY_TRANSITIONS) == set(D)
    assert {X.SUCCEEDED, X.FAILED} == EXECUTION_TERMINAL
    assert {D.ACKED} == DELIVERY_TERMINAL, "a dead letter can be redriven by a person"
    assert execution_predecessors(X.UNKNOWN) == {X.DISPATCHED}
    assert execution_predecessors(X.DISPATCHED) == {X.INTENT_RECORDED, X.UNKNOWN}
    assert execution_predecessors(X.INTENT_RECORDED) == frozenset()
    assert delivery_predecessors(D.ACKED) == {D.SENT}
    assert delivery_predecessors(D.PENDING) == {D.SENT, D.DEAD_LETTERED}  # retry, redrive


# --- first events and identity ----------------------------------------------------------------


@pytest.mark.parametrize("state", [s for s in X if s is not X.INTENT_RECORDED])
def test_first_execution_event_must_be_the_intent(state: ExecutionState) -> None:
    outcome = apply_execution(None, execution(state, 1))
    assert isinstance(outcome, Rejected)
    assert "INTENT_RECORDED" in outcome.reason


@pytest.mark.parametrize(("state", "attempt"), [(D.SENT, 1), (D.ACKED, 0), (D.PENDING, 1)])
def test_first_delivery_event_must_be_pending_attempt_zero(
    state: DeliveryState, attempt: int
) -> None:
    assert isinstance(apply_delivery(None, delivery(state, attempt), SUCCEEDED), Rejected)


def test_intent_record_copies_the_event() -> None:
    event = execution(X.INTENT_RECORDED, 0, provider_ref="p-1")
    record = fold_execution([event])
    assert (record.operation_id, record.tenant_id, record.tool_name) == (
        event.operation_id,
        event.tenant_id,
        event.tool_name,
    )
    assert (record.state, record.attempt, record.version) == (X.INTENT_RECORDED, 0, 1)
    assert record.created_at == record.updated_at == record.state_entered_at == event.occurred_at
    assert record.provider_ref == "p-1"


# Each of these names the identity field it changes; `state, attempt` is a legal next step AND,
# in the "dup" variants, an already-recorded one: identity is checked before duplicates.
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tenant_id", "tenant-b"),
        ("tool_name", "payments.charge"),
        ("request_hash", request_hash("payments.refund", {"order": "o-2"})),
    ],
)
@pytest.mark.parametrize(
    ("state", "attempt"), [(X.SUCCEEDED, 1), (X.UNKNOWN, 1)], ids=["next", "dup"]
)
def test_execution_identity_change_is_rejected(
    field: str, value: str, state: ExecutionState, attempt: int
) -> None:
    record = fold_execution(history(EXECUTION_PATHS[2]))  # UNKNOWN at 1
    outcome = apply_execution(record, execution(state, attempt, **{field: value}))
    assert isinstance(outcome, Rejected), outcome
    assert outcome.kind is not RejectionKind.CONFLICT, "identity is checked before repeats"


@pytest.mark.parametrize(("state", "attempt"), [(D.ACKED, 1), (D.SENT, 1)], ids=["next", "dup"])
def test_delivery_tenant_change_is_rejected(state: DeliveryState, attempt: int) -> None:
    record = fold_delivery([delivery(s, a) for s, a in DELIVERY_PATHS[1]])  # SENT at 1
    outcome = apply_delivery(record, delivery(state, attempt, tenant_id="tenant-b"), SUCCEEDED)
    assert isinstance(outcome, Rejected), outcome
    assert outcome.kind is RejectionKind.FOREIGN_TENANT
    assert "tenant-a" not in outcome.reason and "tenant-b" not in outcome.reason


def test_another_operations_record_is_a_programming_error() -> None:
    record = fold_execution([execution(X.INTENT_RECORDED, 0)])
    with pytest.raises(ValueError, match="another operation"):
        apply_execution(record, execution(X.DISPATCHED, 1, operation_id=OTHER_OP))
    drecord = fold_delivery([delivery(D.PENDING, 0)])
    with pytest.raises(ValueError, match="another"):
        apply_delivery(drecord, delivery(D.SENT, 1, destination="other-destination"), SUCCEEDED)
    with pytest.raises(ValueError, match="another"):
        apply_delivery(
            drecord,
            delivery(D.SENT, 1, operation_id=OTHER_OP),
            succeeded_execution(operation_id=OTHER_OP),
        )


def test_refs_are_kept_once_learned_and_error_is_per_state() -> None:
    record = fold_execution(
        [
            execution(X.INTENT_RECORDED, 0),
            execution(X.DISPATCHED, 1, provider_ref="prov-1"),
            execution(X.UNKNOWN, 1),
            execution(X.SUCCEEDED, 1, result_ref=RESULT),
        ]
    )
    assert (record.provider_ref, record.result_ref, record.error) == ("prov-1", RESULT, None)
    assert record.version == 4


# --- property tests: named invariants over the accepted history -------------------------------

EState = tuple[ExecutionState, int]


def first_is_intent_recorded(history: Sequence[ExecutionTransitioned]) -> bool:
    return not history or (history[0].state is X.INTENT_RECORDED and history[0].attempt == 0)


def no_transition_leaves_a_terminal_state(
    history: Sequence[ExecutionTransitioned | DeliveryTransitioned],
) -> bool:
    terminal = EXECUTION_TERMINAL | DELIVERY_TERMINAL
    return all(event.state not in terminal for event in history[:-1])


def attempts_never_go_back(history: Sequence[ExecutionTransitioned | DeliveryTransitioned]) -> bool:
    return all(a.attempt <= b.attempt for a, b in pairwise(history))


def every_step_is_in_the_execution_table(history: Sequence[ExecutionTransitioned]) -> bool:
    return all(b.state in EXECUTION_TRANSITIONS[a.state] for a, b in pairwise(history))


def only_a_dispatch_starts_a_new_attempt(history: Sequence[ExecutionTransitioned]) -> bool:
    return all(
        b.attempt == a.attempt + (1 if b.state is X.DISPATCHED else 0) for a, b in pairwise(history)
    )


def unknown_is_left_only_by_reconciliation_outcomes(history: Sequence[ExecutionEvent]) -> bool:
    """Out of UNKNOWN: what the provider says happened (SUCCEEDED/FAILED of the same attempt),
    or a dispatch of the next attempt that cites a NEW_ATTEMPT decision recorded for that
    UNKNOWN attempt after it went UNKNOWN. Never a blind re-dispatch."""
    last: ExecutionTransitioned | None = None
    permits: set[tuple[str, int]] = set()  # (decision event id, attempt it was about)
    for event in history:
        if isinstance(event, ReconciliationDecided):
            if event.decision is Decision.NEW_ATTEMPT:
                permits.add((event.event_id, event.attempt))
            continue
        if isinstance(event, OwnershipTaken):
            continue
        if last is not None and last.state is X.UNKNOWN:
            if event.state in (X.SUCCEEDED, X.FAILED) and event.attempt == last.attempt:
                pass
            elif not (
                event.state is X.DISPATCHED
                and event.attempt == last.attempt + 1
                and (event.decision_id, last.attempt) in permits
            ):
                return False
        if event.state is X.UNKNOWN:
            permits.clear()  # a permit is for the UNKNOWN it followed, not an earlier one
        last = event
    return True


def lease_tokens_never_go_back(history: Sequence[ExecutionEvent]) -> bool:
    """Once a token is recorded, nothing written under a lower one is applied (fencing)."""
    highest = 0
    for event in history:
        token = event.lease_token or 0
        if token < highest:
            return False
        if isinstance(event, OwnershipTaken) and token == highest and highest:
            return False  # taking over must raise the token
        highest = max(highest, token)
    return True


def one_version_per_state_and_attempt(history: Sequence[ExecutionEvent]) -> bool:
    """A (state, attempt) is recorded by exactly one event: a second version is a conflict."""
    versions: dict[tuple[ExecutionState, int], str] = {}
    for event in history:
        if isinstance(event, ExecutionTransitioned):
            key = (event.state, event.attempt)
            if versions.setdefault(key, event.event_id) != event.event_id:
                return False
    return True


def succeeded_has_a_result(record: ExecutionRecord) -> bool:
    return record.state is not X.SUCCEEDED or record.result_ref is not None


def record_summarises_history(
    record: ExecutionRecord | DeliveryRecord | None,
    history: Sequence[ExecutionEvent | DeliveryTransitioned],
) -> bool:
    if not history:
        return record is None
    assert record is not None
    transitions = [
        e for e in history if isinstance(e, ExecutionTransitioned | DeliveryTransitioned)
    ]
    attempt = record.attempt if isinstance(record, ExecutionRecord) else record.attempts
    # A delivery's seen steps are those of its current round: from its last redrive on.
    rounds = [
        i
        for i, (a, b) in enumerate(pairwise(transitions), start=1)
        if a.state is D.DEAD_LETTERED and b.state is D.PENDING
    ]
    this_round = transitions[rounds[-1] :] if rounds else transitions
    return (
        record.state is transitions[-1].state
        and attempt == transitions[-1].attempt
        and record.version == len(history)
        and dict(record.seen) == {(e.state, e.attempt): e.event_id for e in this_round}
        and record.created_at == transitions[0].occurred_at
        and record.state_entered_at == transitions[-1].occurred_at
    )


def acked_implies_sent_earlier(history: Sequence[DeliveryTransitioned]) -> bool:
    for i, event in enumerate(history):
        if event.state is D.ACKED:
            sent = [e for e in history[:i] if e.state is D.SENT and e.attempt == event.attempt]
            if not sent or history[i - 1] is not sent[-1]:
                return False
    return True


def sent_increments_attempts_by_one(history: Sequence[DeliveryTransitioned]) -> bool:
    return all(
        b.attempt == a.attempt + (1 if b.state is D.SENT else 0) for a, b in pairwise(history)
    )


def first_is_pending_at_zero(history: Sequence[DeliveryTransitioned]) -> bool:
    return not history or (history[0].state is D.PENDING and history[0].attempt == 0)


def every_step_is_in_the_delivery_table(history: Sequence[DeliveryTransitioned]) -> bool:
    return all(b.state in DELIVERY_TRANSITIONS[a.state] for a, b in pairwise(history))


def duplicates_change_nothing(apply: object, record: object, history: Sequence[object]) -> bool:
    """Re-applying any accepted event is a Duplicate, and the record stays as it was."""
    before = record
    for event in history:
        if not isinstance(apply(record, event), Duplicate):  # type: ignore[operator]  # either fold
            return False
    return record == before


def _writable_execution(state: ExecutionState, attempt: int, index: int) -> ExecutionTransitioned:
    if state is X.INTENT_RECORDED:
        attempt = 0
    elif attempt == 0 and state is not X.FAILED:
        attempt = 1
    return execution(state, attempt, provider_ref=f"prov-{index}")


@st.composite
def execution_streams(draw: st.DrawFn) -> list[ExecutionEvent]:
    """A stream that mixes legal next steps, replays, rival versions, ownership changes (some
    with stale tokens), decisions and arbitrary (mostly illegal) events."""
    events: list[ExecutionEvent] = []
    record: ExecutionRecord | None = None
    token = 0
    for index in range(draw(st.integers(1, 30))):
        kind = draw(
            st.sampled_from(
                ["legal", "legal", "legal", "random", "replay", "rival", "owner", "decide"]
            )
        )
        event: ExecutionEvent
        if kind == "replay" and events:
            event = draw(st.sampled_from(events))
        elif kind == "rival" and events:
            # The same (state, attempt) as an earlier event, written by someone else.
            earlier = draw(st.sampled_from(events))
            event = earlier.model_copy(update={"event_id": fresh_event_id()})
        elif kind == "owner" and record is not None:
            token = draw(st.integers(max(0, token - 1), token + 2)) or 1
            event = owned(token, record.attempt)
        elif kind == "decide" and record is not None:
            choice = draw(st.sampled_from(sorted(Decision)))
            attempt = draw(st.sampled_from([record.attempt, record.attempt + 1]))
            event = decided(attempt, choice, lease_token=draw(st.sampled_from([None, token or 1])))
        elif kind == "legal" and record is not None and EXECUTION_TRANSITIONS[record.state]:
            to = draw(st.sampled_from(sorted(EXECUTION_TRANSITIONS[record.state])))
            attempt = record.attempt + 1 if to is X.DISPATCHED else record.attempt
            event = _writable_execution(to, attempt, index)
            updates: dict[str, object] = {
                "lease_token": draw(st.sampled_from([None, token or None]))
            }
            if record.permit is not None and draw(st.booleans()):
                updates["decision_id"] = record.permit[1]
            event = event.model_copy(update=updates)
        else:
            event = _writable_execution(draw(st.sampled_from(X)), draw(st.integers(0, 4)), index)
        outcome = apply_any(record, event)
        if isinstance(outcome, Applied):
            record = outcome.record
        events.append(event)
    return events


@st.composite
def delivery_streams(draw: st.DrawFn) -> list[DeliveryTransitioned]:
    events: list[DeliveryTransitioned] = []
    record: DeliveryRecord | None = None
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["legal", "legal", "random", "replay"]))
        if kind == "replay" and events:
            event = draw(st.sampled_from(events))
        elif kind == "legal" and record is not None and DELIVERY_TRANSITIONS[record.state]:
            to = draw(st.sampled_from(sorted(DELIVERY_TRANSITIONS[record.state])))
            attempt = record.attempts + 1 if to is D.SENT else record.attempts
            if record.state is D.DEAD_LETTERED:
                event = delivery(to, attempt, error="redriven by the test")
            else:
                event = delivery(to, attempt)
        else:
            state = draw(st.sampled_from(D))
            attempt = draw(st.integers(1 if state is D.SENT else 0, 4))
            event = delivery(state, attempt)
        outcome = apply_delivery(record, event, SUCCEEDED)
        if isinstance(outcome, Applied):
            record = outcome.record
        events.append(event)
    return events


@settings(max_examples=500, deadline=None)
@given(execution_streams())
def test_execution_fold_invariants(stream: list[ExecutionEvent]) -> None:
    record: ExecutionRecord | None = None
    accepted: list[ExecutionEvent] = []
    for event in stream:
        outcome = apply_any(record, event)
        if isinstance(outcome, Applied):
            record = outcome.record
            accepted.append(event)
            assert succeeded_has_a_result(record)
        elif isinstance(outcome, Duplicate):
            assert any(e.event_id == event.event_id for e in accepted), "only a resend repeats"

    transitions = [e for e in accepted if isinstance(e, ExecutionTransitioned)]
    assert first_is_intent_recorded(transitions)
    assert no_transition_leaves_a_terminal_state(transitions)
    assert attempts_never_go_back(transitions)
    assert every_step_is_in_the_execution_table(transitions)
    assert only_a_dispatch_starts_a_new_attempt(transitions)
    assert unknown_is_left_only_by_reconciliation_outcomes(accepted)
    assert lease_tokens_never_go_back(accepted)
    assert one_version_per_state_and_attempt(accepted)
    assert record_summarises_history(record, accepted)
    if record is not None:
        assert duplicates_change_nothing(apply_any, record, accepted)
        # Folding only the accepted events gives the same record: rejected ones left no trace.
        assert fold_execution(accepted) == record


@settings(max_examples=300, deadline=None)
@given(delivery_streams())
def test_delivery_fold_invariants(stream: list[DeliveryTransitioned]) -> None:
    record: DeliveryRecord | None = None
    accepted: list[DeliveryTransitioned] = []
    for event in stream:
        outcome = apply_delivery(record, event, SUCCEEDED)
        if isinstance(outcome, Applied):
            record = outcome.record
            accepted.append(event)
            if record.state is not D.PENDING:
                assert record.next_attempt_at is None
        elif isinstance(outcome, Duplicate):
            assert any((e.state, e.attempt) == (event.state, event.attempt) for e in accepted)

    assert first_is_pending_at_zero(accepted)
    assert no_transition_leaves_a_terminal_state(accepted)
    assert attempts_never_go_back(accepted)
    assert every_step_is_in_the_delivery_table(accepted)
    assert acked_implies_sent_earlier(accepted)
    assert sent_increments_attempts_by_one(accepted)
    assert record_summarises_history(record, accepted)
    if record is not None:
        assert duplicates_change_nothing(
            lambda r, e: apply_delivery(r, e, SUCCEEDED), record, accepted
        )
        assert fold_delivery(accepted) == record


# The predicates must be able to fail, or the property tests above prove nothing.
def test_predicates_catch_bad_histories() -> None:
    i0, d1, u1 = (
        execution(X.INTENT_RECORDED, 0),
        execution(X.DISPATCHED, 1),
        execution(X.UNKNOWN, 1),
    )
    s1, d2 = execution(X.SUCCEEDED, 1), execution(X.DISPATCHED, 2)
    assert not first_is_intent_recorded([d1])
    assert not no_transition_leaves_a_terminal_state([i0, d1, s1, d2])
    assert not attempts_never_go_back([i0, d2, u1])
    assert not every_step_is_in_the_execution_table([i0, s1])
    assert not only_a_dispatch_starts_a_new_attempt([i0, d1, execution(X.UNKNOWN, 2)])
    assert not unknown_is_left_only_by_reconciliation_outcomes(
        [i0, d1, u1, execution(X.DISPATCHED, 1)]
    )
    # The blind retry the issue found accepted: a new dispatch out of UNKNOWN with no decision.
    assert not unknown_is_left_only_by_reconciliation_outcomes([i0, d1, u1, d2])
    permit = decided(1)
    assert unknown_is_left_only_by_reconciliation_outcomes(
        [i0, d1, u1, permit, execution(X.DISPATCHED, 2, decision_id=permit.event_id)]
    )
    # A permit given before the UNKNOWN it should answer does not count.
    assert not unknown_is_left_only_by_reconciliation_outcomes(
        [i0, permit, d1, u1, execution(X.DISPATCHED, 2, decision_id=permit.event_id)]
    )
    assert not lease_tokens_never_go_back([i0, owned(3), execution(X.DISPATCHED, 1, lease_token=2)])
    assert not lease_tokens_never_go_back([i0, owned(2), owned(2)])
    assert not one_version_per_state_and_attempt([i0, d1, execution(X.DISPATCHED, 1)])
    p0, sent1, a1 = delivery(D.PENDING, 0), delivery(D.SENT, 1), delivery(D.ACKED, 1)
    assert acked_implies_sent_earlier([p0, sent1, a1])
    assert not acked_implies_sent_earlier([p0, a1])
    assert not acked_implies_sent_earlier([p0, sent1, delivery(D.PENDING, 1), a1])
    assert not sent_increments_attempts_by_one([p0, delivery(D.SENT, 2)])
    assert not first_is_pending_at_zero([sent1])
    record = fold_execution([i0, d1])
    assert not duplicates_change_nothing(apply_any, record, [u1])
    assert not record_summarises_history(record, [i0])


@pytest.mark.parametrize("combo", list(product([X.SUCCEEDED, X.FAILED], list(X))))
def test_nothing_leaves_a_terminal_execution(combo: tuple[ExecutionState, ExecutionState]) -> None:
    terminal, to = combo
    path = next(p for p in EXECUTION_PATHS if p[-1][0] is terminal)
    record = fold_execution(history(path))
    for attempt in range(4):
        try:
            event = execution(to, attempt)
        except ValidationError:
            continue
        assert not isinstance(apply_execution(record, event), Applied)
