"""Validation rules of the two event types: what may enter the ledger at all."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from factories import OP, RESULT, T0, delivery, execution
from pydantic import ValidationError

from ledger.domain.events import MAX_ERROR_LENGTH, DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.states import DeliveryState, ExecutionState

X = ExecutionState
D = DeliveryState


# --- execution: attempts per state ------------------------------------------------------------


def test_intent_is_attempt_zero() -> None:
    assert execution(X.INTENT_RECORDED, 0).attempt == 0
    with pytest.raises(ValidationError, match="INTENT_RECORDED is attempt 0"):
        execution(X.INTENT_RECORDED, 1)


@pytest.mark.parametrize("state", [X.DISPATCHED, X.SUCCEEDED, X.UNKNOWN])
def test_states_after_a_dispatch_need_attempt_one_or_more(state: ExecutionState) -> None:
    assert execution(state, 1).attempt == 1
    assert execution(state, 42).attempt == 42
    with pytest.raises(ValidationError, match="needs attempt >= 1"):
        execution(state, 0)


def test_failed_at_attempt_zero_is_a_refusal_before_dispatch() -> None:
    # INTENT_RECORDED -> FAILED is in the transition table: a refusal needs no dispatch.
    assert execution(X.FAILED, 0, error="refused by policy").attempt == 0
    assert execution(X.FAILED, 3).attempt == 3


@pytest.mark.parametrize("attempt", [-1, 1_000_001])
def test_attempt_is_bounded(attempt: int) -> None:
    with pytest.raises(ValidationError, match="attempt"):
        execution(X.DISPATCHED, attempt)
    with pytest.raises(ValidationError, match="attempt"):
        delivery(D.PENDING, attempt)


# --- execution: what each state needs ---------------------------------------------------------


def test_succeeded_needs_result_ref() -> None:
    with pytest.raises(ValidationError, match="SUCCEEDED needs result_ref"):
        execution(X.SUCCEEDED, 1, result_ref=None)


@pytest.mark.parametrize("state", [X.FAILED, X.UNKNOWN])
@pytest.mark.parametrize("error", [None, ""])
def test_failed_and_unknown_need_an_error(state: ExecutionState, error: str | None) -> None:
    with pytest.raises(ValidationError, match="needs an error"):
        execution(state, 1, error=error)


def test_dispatched_needs_neither_result_nor_error() -> None:
    event = execution(X.DISPATCHED, 1)
    assert (event.result_ref, event.error, event.provider_ref) == (None, None, None)


# --- delivery ---------------------------------------------------------------------------------


def test_sent_needs_attempt_one_or_more() -> None:
    assert delivery(D.SENT, 1).attempt == 1
    with pytest.raises(ValidationError, match="SENT needs attempt >= 1"):
        delivery(D.SENT, 0)


@pytest.mark.parametrize("error", [None, ""])
def test_dead_lettered_needs_an_error(error: str | None) -> None:
    with pytest.raises(ValidationError, match="DEAD_LETTERED needs an error"):
        delivery(D.DEAD_LETTERED, 1, error=error)


@pytest.mark.parametrize("state", [D.PENDING, D.ACKED])
def test_pending_and_acked_allow_attempt_zero_and_no_error(state: DeliveryState) -> None:
    event = delivery(state, 0, result_ref=None)
    assert event.error is None and event.result_ref is None


# --- timestamps -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda when: execution(X.INTENT_RECORDED, 0, occurred_at=when),
        lambda when: delivery(D.PENDING, 0, occurred_at=when),
        lambda when: delivery(D.PENDING, 0, next_attempt_at=when),
    ],
    ids=["execution.occurred_at", "delivery.occurred_at", "delivery.next_attempt_at"],
)
def test_naive_datetimes_are_rejected(build: Any) -> None:
    with pytest.raises(ValidationError, match="timezone-aware"):
        build(datetime(2026, 1, 1, 12, 0))


def test_aware_datetimes_are_normalised_to_utc() -> None:
    local = datetime(2026, 1, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    event = execution(X.INTENT_RECORDED, 0, occurred_at=local)
    assert event.occurred_at.utcoffset() == timedelta(0)
    assert event.occurred_at == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


# --- identifiers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("operation_id", "nope"),
        ("operation_id", "op_" + "0" * 25),  # one character short
        ("operation_id", "op_" + "0" * 27),
        ("operation_id", "op_" + "I" * 26),  # I, L, O, U are not Crockford digits
        ("operation_id", "op_" + "0" * 25 + "u"),  # lower case
        ("operation_id", "ev_" + "0" * 26),  # an event id is not an operation id
        ("operation_id", OP + "\n"),
        ("event_id", OP),
        ("event_id", "ev_" + "0" * 25),
        ("request_hash", "sha256:" + "0" * 63),
        ("request_hash", "sha256:" + "A" * 64),  # lower-case hex only
        ("request_hash", "md5:" + "0" * 32),
        ("result_ref", "s3://bucket/key"),
        ("tenant_id", ""),
        ("tenant_id", "-leading-dash"),
        ("tenant_id", "has space"),
        ("tenant_id", "x" * 129),
        ("actor_id", "a\nb"),
        ("tool_name", "1starts-with-digit"),
        ("tool_name", "has space"),
        ("provider_ref", ""),
        ("provider_ref", "ref with space"),
    ],
)
def test_execution_ids_must_match_their_patterns(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as info:
        execution(X.SUCCEEDED, 1, **{field: value})
    assert [e["loc"][0] for e in info.value.errors()] == [field]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("destination", ""),
        ("destination", "has space"),
        ("destination", "/leading-slash"),
        ("destination", "x" * 257),
        ("operation_id", "op_short"),
    ],
)
def test_delivery_ids_must_match_their_patterns(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as info:
        delivery(D.PENDING, 0, **{field: value})
    assert [e["loc"][0] for e in info.value.errors()] == [field]


def test_typical_identifiers_are_accepted() -> None:
    event = execution(
        X.SUCCEEDED,
        1,
        tenant_id="acme.eu-1",
        actor_id="user:alice@example.com",
        tool_name="crm.contacts_update-v2",
        provider_ref="ch_3MqLiJ2eZvKYlo2C/refund=1+2",
    )
    assert event.provider_ref == "ch_3MqLiJ2eZvKYlo2C/refund=1+2"
    assert delivery(D.PENDING, 0, destination="kafka:downstream.topic").destination


# --- error text -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        "Authorization: Bearer abcdefgh12345678",
        "call failed: password=hunter2",
        "bad key sk-abcdefghijklmnop1234",
        "postgres://admin:s3cret@db.internal/app unreachable",
    ],
)
def test_error_text_holding_a_credential_is_rejected(error: str) -> None:
    with pytest.raises(ValidationError, match="credential"):
        execution(X.FAILED, 1, error=error)
    with pytest.raises(ValidationError, match="credential"):
        delivery(D.DEAD_LETTERED, 1, error=error)


def test_error_text_length_is_bounded() -> None:
    assert execution(X.FAILED, 1, error="x" * MAX_ERROR_LENGTH).error
    with pytest.raises(ValidationError, match="error"):
        execution(X.FAILED, 1, error="x" * (MAX_ERROR_LENGTH + 1))


# --- model shape ------------------------------------------------------------------------------


def test_extra_fields_are_forbidden() -> None:
    with pytest.raises(ValidationError, match="extra"):
        execution(X.INTENT_RECORDED, 0, note="hello")
    with pytest.raises(ValidationError, match="extra"):
        delivery(D.PENDING, 0, tool_name="x")


def test_kind_is_fixed_per_type() -> None:
    assert execution(X.INTENT_RECORDED, 0).kind == "execution"
    assert delivery(D.PENDING, 0).kind == "delivery"
    with pytest.raises(ValidationError, match="kind"):
        execution(X.INTENT_RECORDED, 0, kind="delivery")


@pytest.mark.parametrize(
    ("event", "field", "value"),
    [
        (execution(X.SUCCEEDED, 1), "state", X.FAILED),
        (execution(X.SUCCEEDED, 1), "result_ref", RESULT),
        (delivery(D.SENT, 1), "attempt", 2),
        (delivery(D.SENT, 1), "occurred_at", T0),
    ],
)
def test_models_are_frozen(
    event: ExecutionTransitioned | DeliveryTransitioned, field: str, value: object
) -> None:
    before = event.model_dump()
    with pytest.raises(ValidationError, match="frozen"):
        setattr(event, field, value)
    assert event.model_dump() == before


def test_events_are_hashable_values() -> None:
    a = execution(X.INTENT_RECORDED, 0)
    b = ExecutionTransitioned.model_validate(a.model_dump())
    assert a == b and hash(a) == hash(b)
    assert a != execution(X.INTENT_RECORDED, 0)  # a fresh event_id makes a different event


def test_state_strings_from_the_wire_become_enums() -> None:
    event = DeliveryTransitioned.model_validate(
        {**delivery(D.SENT, 1).model_dump(), "state": "ACKED"}
    )
    assert event.state is D.ACKED
    with pytest.raises(ValidationError, match="state"):
        DeliveryTransitioned.model_validate({**delivery(D.SENT, 1).model_dump(), "state": "DONE"})
