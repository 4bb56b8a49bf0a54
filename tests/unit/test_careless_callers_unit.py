"""The pure parts of decision 020: what an answer or an argument must be before anything is
written, and a recorder's refusal once closed or forked (no broker or database involved)."""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import pytest

from ledger.domain.call import judge_answer
from ledger.domain.states import ExecutionState
from ledger.tools import CallOutcome
from producers import ForkedRecorderError, InvalidTransitionError, RecorderClosedError
from producers.execution import _check_identity
from producers.planner import canonical_request
from producers.recorder import RecorderCore
from producers.steps import Call, Interrupted, _outcome


def test_a_recursion_bomb_is_an_invalid_transition() -> None:
    bomb: list[Any] = []
    here = bomb
    for _ in range(100_000):
        here.append([])
        here = here[0]
    with pytest.raises(InvalidTransitionError, match="nested too deeply"):
        canonical_request("tool", bomb)


def test_arguments_over_the_stored_request_limit_are_refused() -> None:
    with pytest.raises(InvalidTransitionError, match="over the"):
        canonical_request("tool", {"a": "x" * (1024 * 1024)})


@pytest.mark.parametrize("operation_id", ["", " ", "op_x", 5])
def test_a_given_operation_id_must_be_one(operation_id: Any) -> None:
    with pytest.raises(InvalidTransitionError, match="operation_id"):
        _check_identity("acme", "agent-7", operation_id)


def test_a_confusable_tenant_is_shown_escaped() -> None:
    with pytest.raises(InvalidTransitionError, match=r"\\u0430cme"):
        _check_identity("\u0430cme", "agent-7", None)


_ODD: list[Any] = [
    None,
    CallOutcome(True, result=cast(Any, "x")),
    CallOutcome(cast(Any, 1), result=b"x"),
    CallOutcome(False, error=cast(Any, b"")),
]


@pytest.mark.parametrize("answer", _ODD)
def test_an_answer_of_another_shape_cannot_tell(answer: Any) -> None:
    assert judge_answer(answer, max_result_bytes=100).state is ExecutionState.UNKNOWN


def test_a_memoryview_result_becomes_bytes() -> None:
    answer = CallOutcome(True, result=memoryview(b"ok"))  # type: ignore[arg-type]
    judged = judge_answer(answer, max_result_bytes=100)
    assert judged.state is ExecutionState.SUCCEEDED and judged.result == b"ok"
    assert isinstance(judged.result, bytes)


def test_an_interrupted_call_is_handed_to_the_steps() -> None:
    def perform(_effect: Any) -> Any:
        raise KeyboardInterrupt

    answer, error = _outcome(perform, Call(object(), {}, "k"))  # type: ignore[arg-type]
    assert answer is None and isinstance(error, Interrupted)
    assert isinstance(error.original, KeyboardInterrupt)


class _Core(RecorderCore):
    def __init__(self) -> None:  # only what _enter and close need
        self._pid = os.getpid()
        self._closed = False
        self._calls = 0
        self._calls_changed = threading.Condition()
        self._owned = []


def test_a_closed_or_forked_recorder_refuses_calls() -> None:
    core = _Core()
    core._leave(core._enter())
    core._stop_calls(0)
    with pytest.raises(RecorderClosedError):
        core._enter()
    core._pid = -1  # as seen from a forked child
    with pytest.raises(ForkedRecorderError, match="in each process"):
        core._enter()
    assert core._forked_close()
