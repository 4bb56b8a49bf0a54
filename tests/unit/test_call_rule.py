"""``ledger.call_rule.perform_call``: the order of the call rule, written once, and the proof
that every path that calls a tool performs it (and nothing else judges an answer).

The port here is a recording fake: the rule's order is pure logic over its steps. That the SDK
and the recovery worker record the same answers alike against the real broker and database is
``tests/integration/test_call_rule_once.py``; that a lease lost before the call prevents it is
``tests/integration/test_lease_reclaim.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ledger.call_rule import Interrupted, Step, immediately, perform_call, run_now
from ledger.domain import ids
from ledger.domain.call import CallOutcome, Judged
from ledger.domain.states import ExecutionState
from ledger.errors import LeaseLostError, RecordError
from ledger.results import MAX_RESULT_BYTES
from ledger.tools import ContactLost

ROOT = Path(__file__).resolve().parents[2]
OP = "op_01JCALLRULE000000000000000"
KEY = ids.idempotency_key(OP)


@dataclass
class Port:
    """Records each step; ``answer`` is what the call returns (an exception is raised)."""

    answer: Any = None
    lease_lost_at_call: bool = False
    dispatch_fails: bool = False
    outcome_fails: bool = False
    steps: list[tuple[str, Any]] = field(default_factory=list)

    @immediately
    def keep_lease(self, *, now: bool) -> None:
        self.steps.append(("keep_lease", now))
        if now and self.lease_lost_at_call:
            raise LeaseLostError("taken over")

    @immediately
    def record_dispatch(self, provider_ref: str) -> None:
        self.steps.append(("dispatch", provider_ref))
        if self.dispatch_fails:
            raise RecordError("not acknowledged")

    @immediately
    def call(self, key: str) -> object:
        self.steps.append(("call", key))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    @immediately
    def record_outcome(self, judged: Judged) -> None:
        self.steps.append(("outcome", judged.state))
        if self.outcome_fails:
            raise RecordError("outcome not acknowledged")

    def names(self) -> list[str]:
        return [name for name, _ in self.steps]


def run(port: Port) -> Judged:
    return run_now(perform_call(port, OP, stage="test"))


def test_a_success_is_dispatched_durably_before_the_call_and_recorded_after_it() -> None:
    port = Port(CallOutcome(True, result=b"ok"))
    judged = run(port)
    assert judged.state is ExecutionState.SUCCEEDED and judged.result == b"ok"
    assert port.steps == [
        ("keep_lease", False),
        ("dispatch", KEY),
        ("keep_lease", True),  # the last look before the provider is called
        ("call", KEY),
        ("keep_lease", False),
        ("outcome", ExecutionState.SUCCEEDED),
    ]


def test_a_lease_taken_over_before_the_call_means_no_call_and_no_outcome() -> None:
    port = Port(CallOutcome(True, result=b"ok"), lease_lost_at_call=True)
    with pytest.raises(LeaseLostError):
        run(port)
    assert "call" not in port.names() and "outcome" not in port.names()


def test_a_dispatch_that_was_not_acknowledged_is_never_followed_by_a_call() -> None:
    port = Port(CallOutcome(True, result=b"ok"), dispatch_fails=True)
    with pytest.raises(RecordError):
        run(port)
    assert port.names() == ["keep_lease", "dispatch"]


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (ContactLost("no answer within 2s"), "contact lost after dispatch: no answer within 2s"),
        (ValueError("bad gateway"), "ValueError: bad gateway"),
    ],
)
def test_a_call_that_raised_is_unknown_and_never_called_again(raised: Exception, said: str) -> None:
    port = Port(raised)
    judged = run(port)
    assert (judged.state, judged.error) == (ExecutionState.UNKNOWN, said)
    assert port.names().count("call") == 1
    assert port.steps[-1] == ("outcome", ExecutionState.UNKNOWN)


@pytest.mark.parametrize(
    ("answer", "state"),
    [
        (CallOutcome(False, error="card declined"), ExecutionState.FAILED),
        ("ok", ExecutionState.UNKNOWN),  # not a CallOutcome: cannot say whether it happened
        (CallOutcome(True, result=b"x" * (MAX_RESULT_BYTES + 1)), ExecutionState.UNKNOWN),
    ],
)
def test_every_answer_is_judged_by_the_one_judgement(answer: Any, state: ExecutionState) -> None:
    port = Port(answer)
    assert run(port).state is state
    assert port.steps[-1] == ("outcome", state)


def test_an_interrupted_call_is_recorded_unknown_before_the_interrupt_goes_on() -> None:
    interrupt = KeyboardInterrupt()
    port = Port(Interrupted(interrupt))
    with pytest.raises(KeyboardInterrupt) as raised:
        run(port)
    assert raised.value is interrupt
    assert port.steps[-1] == ("outcome", ExecutionState.UNKNOWN)
    assert any("recorded UNKNOWN" in note for note in raised.value.__notes__)


def test_an_interrupt_whose_unknown_could_not_be_recorded_says_it_may_have_happened() -> None:
    port = Port(Interrupted(SystemExit(3)), outcome_fails=True)
    with pytest.raises(SystemExit) as raised:
        run(port)
    assert any("may have happened" in note for note in raised.value.__notes__)


def test_run_now_refuses_a_port_that_asks_its_driver_for_work() -> None:
    class Asking(Port):
        def keep_lease(self, *, now: bool) -> Step[None]:  # type: ignore[override]
            yield "an effect only a recorder could perform"

    with pytest.raises(TypeError, match="asked its driver"):
        run(Asking())


# -- every path performs it, and nothing else judges an answer --------------------------------

#: The paths that call a tool, each of which must go through perform_call.
CALLERS = ("producers/execution.py", "processors/recovery/calls.py")


def _calls(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if isinstance(name, str):
                yield name


@pytest.mark.parametrize("relative", CALLERS)
def test_each_path_that_calls_a_tool_performs_the_one_rule(relative: str) -> None:
    assert "perform_call" in set(_calls(ROOT / relative)), relative


def test_no_module_but_the_rule_judges_an_answer() -> None:
    judges = []
    for package in ("ledger", "producers", "processors", "consumers", "projections", "opledger"):
        for path in (ROOT / package).rglob("*.py"):
            relative = str(path.relative_to(ROOT))
            if relative in {"ledger/call_rule.py", "ledger/domain/call.py"}:
                continue
            if set(_calls(path)) & {"judge_answer", "judge_raised"}:
                judges.append(relative)
    assert judges == []
