"""``ledger.domain.fate``: an error after an intent may be on the log never says "nothing"."""

from __future__ import annotations

import pytest

from ledger.domain.fate import fate
from ledger.domain.states import ExecutionState as E
from ledger.errors import LeaseLostError

OP = "op-1"


def test_nothing_acknowledged_and_nothing_in_doubt_is_nothing() -> None:
    said = fate(OP, None, 0)
    assert not said.on_the_log
    assert "calling again is safe" in said.next_step


def test_an_intent_in_doubt_may_be_on_the_log() -> None:
    said = fate(OP, None, 0, [E.INTENT_RECORDED])
    assert said.on_the_log
    assert "perhaps the intent" in said.holds
    assert "never retry it under a new operation id" in said.next_step


@pytest.mark.parametrize("doubt", [(), (E.DISPATCHED,)])
def test_a_recorded_intent_is_carried_on_and_was_not_called(doubt: tuple[E, ...]) -> None:
    said = fate(OP, E.INTENT_RECORDED, 0, doubt)
    assert said.holds.startswith(f"{OP} at INTENT_RECORDED (attempt 0)")
    assert ("perhaps DISPATCHED" in said.holds) == bool(doubt)
    assert "did not call the tool" in said.next_step
    assert "recovery worker" in said.next_step
    assert f"same operation id ({OP}" in said.next_step


@pytest.mark.parametrize("state", [E.DISPATCHED, E.UNKNOWN])
def test_a_dispatched_operation_may_have_been_called_and_is_reconciled(state: E) -> None:
    said = fate(OP, state, 1, [E.SUCCEEDED])
    assert "may have been called" in said.next_step
    assert "looking its idempotency key up" in said.next_step


def test_a_finished_operation_is_finished() -> None:
    assert "finished" in fate(OP, E.SUCCEEDED, 1).next_step


def test_the_error_says_it_once_in_its_message_and_attributes() -> None:
    error = LeaseLostError("x: the lease ran out; this step was not sent")
    said = fate(OP, E.INTENT_RECORDED, 0)
    error.tell(OP, said.holds, said.next_step)
    error.tell(OP, "something else", "other")
    assert error.operation_id == OP and error.log_holds == said.holds
    assert str(error) == (
        f"x: the lease ran out; this step was not sent. The log holds {said.holds}: "
        f"{said.next_step}"
    )
