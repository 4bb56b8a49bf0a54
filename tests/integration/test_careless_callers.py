"""Careless and hostile callers of the SDK against the real broker and database (decision 020):
a forked child, calls after or during close(), a tool that interrupts or answers nonsense,
re-entrant and duplicate calls, arguments and ids no event can carry, and asyncio cancellation
at every await point of ``execute``. What is checked is what the outside world saw (the
provider's calls per key) and what the topics and tables hold."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from datetime import timedelta
from typing import Any, cast

import psycopg
import pytest

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.states import ExecutionState
from ledger.log import end_offsets
from ledger.settings import Settings
from ledger.tools import CallOutcome, ContactLost, LookupResult, LookupStatus, ProviderTerms
from producers import (
    AsyncTransitionRecorder,
    ForkedRecorderError,
    LeaseLostError,
    RecorderClosedError,
    RecordError,
    TransitionRecorder,
)
from tests.integration.test_execute import allow_all
from tests.support import read_all

X = ExecutionState
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=5), key_retention=timedelta(hours=1), repeat_safe=True
)


class Tool:
    """A synchronous provider that counts its calls per key and answers what it is told."""

    terms = TERMS

    def __init__(self, tool_name: str = "tool", answer: Any = None) -> None:
        self.tool_name = tool_name
        self.calls: collections.Counter[str] = collections.Counter()
        self.answer = answer if answer is not None else CallOutcome(True, result=b'{"ok":1}')
        #: set while a call is inside the tool; the call waits for ``release`` if it is armed
        self.entered = threading.Event()
        self.release: threading.Event | None = None
        self.lock = threading.Lock()

    def call(self, request: Any, idempotency_key: str) -> Any:
        with self.lock:
            self.calls[idempotency_key] += 1
        self.entered.set()
        if self.release is not None and not self.release.wait(10):
            raise ContactLost("the test never released the call")
        answer = self.answer
        if isinstance(answer, BaseException) or (
            isinstance(answer, type) and issubclass(answer, BaseException)
        ):
            raise answer
        return cast(Any, answer)(request) if callable(answer) else answer

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        return LookupResult(LookupStatus.UNAVAILABLE)


class AsyncTool(Tool):
    async def call(self, request: Any, idempotency_key: str) -> Any:
        with self.lock:
            self.calls[idempotency_key] += 1
        await asyncio.sleep(0.005)
        return CallOutcome(True, result=b'{"ok":1}')


def _recorder(settings: Settings, *tools: Tool) -> TransitionRecorder:
    recorder = TransitionRecorder.connect(settings, providers=list(tools))
    recorder.collaborators.policy = allow_all
    return recorder


def _async_recorder(settings: Settings, *tools: Tool) -> AsyncTransitionRecorder:
    recorder = AsyncTransitionRecorder.connect(settings, providers=list(tools))
    recorder.collaborators.policy = allow_all
    return recorder


def _last_states(settings: Settings) -> dict[str, ExecutionState]:
    codec = default_codec()
    last: dict[str, ExecutionState] = {}
    for _p, _o, _k, value in read_all(settings, settings.execution_topic):
        event = codec.decode(value or b"")
        if isinstance(event, ExecutionTransitioned):
            last[event.operation_id] = event.state
    return last


def _nothing_written(settings: Settings) -> None:
    ends = end_offsets(settings, [settings.execution_topic, settings.delivery_topic])
    assert sum(ends.values()) == 0, "a record was written"
    with psycopg.connect(settings.dsn) as conn:
        leases = conn.execute("SELECT count(*) FROM operation_leases").fetchone()
        requests = conn.execute("SELECT count(*) FROM operation_requests").fetchone()
    assert leases == (0,) and requests == (0,), "a lease or request was stored"


def _lease_released(settings: Settings, operation_id: str) -> bool:
    with psycopg.connect(settings.dsn) as conn:
        row = conn.execute(
            "SELECT expires_at <= now() FROM operation_leases WHERE operation_id = %s",
            (operation_id,),
        ).fetchone()
    return row == (True,)


# -- 1. fork ---------------------------------------------------------------------------------


def test_a_forked_child_is_refused_and_the_parent_carries_on(isolated: Settings) -> None:
    tool = Tool()
    recorder = _recorder(isolated, tool)
    assert recorder.execute("acme", "agent-7", "tool", {"n": 1}).state is X.SUCCEEDED
    pool = recorder.collaborators.results._pool  # type: ignore[union-attr]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what happened through the pipe, never return to pytest
        verdict = b"called"
        try:
            try:
                recorder.execute("acme", "agent-7", "tool", {"n": 2})
            except ForkedRecorderError as exc:
                verdict = b"refused" if "in each process" in str(exc) else b"unclear"
            except BaseException as exc:
                verdict = type(exc).__name__.encode()
            recorder.close()  # must neither flush the parent's producer nor end its sessions
            os.write(write, verdict)
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    verdict = os.read(read, 100)
    os.close(read)
    assert verdict == b"refused", f"the child got {verdict!r} (or hung)"
    lost = pool.get_stats().get("connections_lost", 0)
    pool.check()  # finds connections the child broke
    assert pool.get_stats().get("connections_lost", 0) == lost, "the child broke a connection"
    assert recorder.execute("acme", "agent-7", "tool", {"n": 3}).state is X.SUCCEEDED
    recorder.close()
    assert sum(tool.calls.values()) == 2
    assert list(_last_states(isolated).values()) == [X.SUCCEEDED, X.SUCCEEDED]


# -- 2. close --------------------------------------------------------------------------------


def test_calls_after_close_are_refused_before_anything_is_written(isolated: Settings) -> None:
    tool = Tool()
    recorder = _recorder(isolated, tool)
    recorder.close()
    recorder.close()  # twice: nothing to do
    started = time.monotonic()
    with pytest.raises(RecorderClosedError, match="Connect a new recorder"):
        recorder.execute("acme", "agent-7", "tool", {"n": 1})
    with pytest.raises(RecorderClosedError):
        recorder.intent("acme", "agent-7", "tool", {"n": 1})
    assert time.monotonic() - started < 1
    assert not tool.calls
    _nothing_written(isolated)


def test_an_async_recorder_refuses_calls_after_close(isolated: Settings) -> None:
    async def main() -> None:
        recorder = _async_recorder(isolated, AsyncTool())
        await recorder.close()
        await recorder.close()
        with pytest.raises(RecorderClosedError):
            await recorder.execute("acme", "agent-7", "tool", {"n": 1})

    asyncio.run(main())
    _nothing_written(isolated)


def test_close_from_another_thread_lets_running_calls_finish(isolated: Settings) -> None:
    tool = Tool()
    tool.release = threading.Event()
    recorder = _recorder(isolated, tool)
    outcome: list[Any] = []

    def running() -> None:
        try:
            outcome.append(recorder.execute("acme", "agent-7", "tool", {"n": 1}))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=running)
    caller.start()
    assert tool.entered.wait(10)
    closer = threading.Thread(target=recorder.close)
    closer.start()
    # A call made once close() began is refused, nothing written, while the running one waits.
    deadline = time.monotonic() + 5
    while not recorder._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RecorderClosedError):
        recorder.execute("acme", "agent-7", "tool", {"n": 2})
    assert closer.is_alive(), "close() did not wait for the running call"
    tool.release.set()
    caller.join(20)
    closer.join(20)
    assert not closer.is_alive()
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].state is X.SUCCEEDED
    assert sum(tool.calls.values()) == 1
    assert list(_last_states(isolated).values()) == [X.SUCCEEDED]


# -- 3. what a tool does to its caller ---------------------------------------------------------


class _Custom(BaseException):
    pass


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit, GeneratorExit, _Custom])
def test_a_tool_that_interrupts_leaves_unknown_and_the_caller_told(
    isolated: Settings, interrupt: type[BaseException]
) -> None:
    tool = Tool(answer=interrupt)
    with _recorder(isolated, tool) as recorder, pytest.raises(interrupt) as raised:
        recorder.execute("acme", "agent-7", "tool", {"n": 1})
    (key,) = tool.calls
    assert tool.calls[key] == 1
    notes = getattr(raised.value, "__notes__", [])
    assert any(key in note and "UNKNOWN" in note for note in notes), notes
    assert _last_states(isolated) == {key: X.UNKNOWN}
    assert _lease_released(isolated, key), "the recovery worker would wait for the lease"


@pytest.mark.parametrize(
    "answer",
    [
        None,
        {"ok": 1},
        CallOutcome(True, result="text, not bytes"),  # type: ignore[arg-type]
        CallOutcome("yes", result=b"{}"),  # type: ignore[arg-type]
        CallOutcome(False, error=5),  # type: ignore[arg-type]
    ],
    ids=["none", "dict", "str-result", "str-succeeded", "int-error"],
)
def test_an_answer_that_is_not_a_call_outcome_is_unknown(isolated: Settings, answer: Any) -> None:
    tool = Tool(answer=lambda _request: answer)
    with _recorder(isolated, tool) as recorder:
        done = recorder.execute("acme", "agent-7", "tool", {"n": 1})
    assert done.state is X.UNKNOWN and "cannot be told" in (done.error or "")
    assert sum(tool.calls.values()) == 1
    assert _last_states(isolated) == {done.operation_id: X.UNKNOWN}
    assert _lease_released(isolated, done.operation_id)


def test_a_bytearray_result_is_stored_as_bytes(isolated: Settings) -> None:
    tool = Tool(answer=CallOutcome(True, result=bytearray(b'{"ok":1}')))  # type: ignore[arg-type]
    with _recorder(isolated, tool) as recorder:
        done = recorder.execute("acme", "agent-7", "tool", {"n": 1})
    assert done.state is X.SUCCEEDED and done.result == b'{"ok":1}'


# -- 4. re-entrancy and one id twice ---------------------------------------------------------


def test_a_tool_that_records_a_nested_tool_call(isolated: Settings) -> None:
    inner = Tool("inner")
    outer = Tool("outer")
    recorder = _recorder(isolated, inner, outer)
    nested: list[Any] = []

    def outer_call(request: Any) -> CallOutcome:
        nested.append(recorder.execute("acme", "agent-7", "inner", {"from": "outer"}))
        return CallOutcome(True, result=b"{}")

    outer.answer = outer_call
    with recorder:
        done = recorder.execute("acme", "agent-7", "outer", {"n": 1})
    assert done.state is X.SUCCEEDED and nested[0].state is X.SUCCEEDED
    assert sum(inner.calls.values()) == 1 and sum(outer.calls.values()) == 1
    assert set(_last_states(isolated).values()) == {X.SUCCEEDED}


def test_one_operation_id_from_two_threads_calls_once(isolated: Settings) -> None:
    tool = Tool()
    tool.release = threading.Event()
    with _recorder(isolated, tool) as recorder:
        operation_id = recorder.new_operation_id()
        outcomes: list[Any] = []

        def run() -> None:
            try:
                outcomes.append(
                    recorder.execute("acme", "a", "tool", {"n": 1}, operation_id=operation_id)
                )
            except RecordError as exc:
                outcomes.append(exc)

        first = threading.Thread(target=run)
        first.start()
        assert tool.entered.wait(10)
        run()  # the second, while the first is inside the tool
        tool.release.set()
        first.join(20)
        again = recorder.execute("acme", "a", "tool", {"n": 1}, operation_id=operation_id)
    assert isinstance(outcomes[0], LeaseLostError), outcomes
    assert outcomes[1].state is X.SUCCEEDED
    assert again.repeat and again.state is X.SUCCEEDED
    assert tool.calls == {operation_id: 1}


def test_one_operation_id_from_two_tasks_calls_once(isolated: Settings) -> None:
    tool = AsyncTool()

    async def main() -> list[Any]:
        async with _async_recorder(isolated, tool) as recorder:
            operation_id = recorder.new_operation_id()
            calls = [
                recorder.execute("acme", "a", "tool", {"n": 1}, operation_id=operation_id)
                for _ in range(2)
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    outcomes = asyncio.run(main())
    assert sum(isinstance(o, LeaseLostError) for o in outcomes) == 1, outcomes
    assert sum(tool.calls.values()) == 1


# -- 5. hostile arguments and ids ------------------------------------------------------------


def _deep(levels: int) -> list[Any]:
    top: list[Any] = []
    here = top
    for _ in range(levels):
        here.append([])
        here = here[0]
    return top


HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("unserialisable", {"arguments": {"a": object()}}),
    ("recursion bomb", {"arguments": _deep(100_000)}),
    ("nan", {"arguments": {"a": float("nan")}}),
    ("infinity", {"arguments": [float("inf")]}),
    ("enormous", {"arguments": {"a": "x" * (2 * 1024 * 1024)}}),
    ("empty tenant", {"tenant_id": ""}),
    ("whitespace tenant", {"tenant_id": "  "}),
    ("newline tenant", {"tenant_id": "acme\n"}),
    ("control tenant", {"tenant_id": "ac\x00me"}),
    ("bidi tenant", {"tenant_id": "ac\u202eme"}),
    ("confusable tenant", {"tenant_id": "\u0430cme"}),  # Cyrillic a
    ("long tenant", {"tenant_id": "a" * 129}),
    ("none tenant", {"tenant_id": None}),
    ("empty actor", {"actor_id": ""}),
    ("zero-width actor", {"actor_id": "agent\u200b7"}),
    ("empty operation id", {"operation_id": ""}),
    ("nul operation id", {"operation_id": "op_\x00"}),
    ("int operation id", {"operation_id": 5}),
    ("list tool", {"tool_name": ["tool"]}),
]


def test_hostile_arguments_are_refused_before_anything_is_written(isolated: Settings) -> None:
    tool = Tool()
    wrong: list[str] = []
    with _recorder(isolated, tool) as recorder:
        for name, given in HOSTILE:
            call = {"tenant_id": "acme", "actor_id": "agent-7", "tool_name": "tool"}
            call |= {"arguments": {"n": 1}} | given
            try:
                recorder.execute(**call)
            except RecordError as exc:
                if "nothing was" not in str(exc).lower():
                    wrong.append(f"{name}: {exc}")
            except BaseException as exc:
                wrong.append(f"{name}: {type(exc).__name__}: {exc}"[:200])
            else:
                wrong.append(f"{name}: accepted")
    assert not wrong, wrong
    assert not tool.calls
    _nothing_written(isolated)


# -- 6. asyncio --------------------------------------------------------------------------------


def test_cancelling_execute_at_every_await_point(isolated: Settings) -> None:
    """Cancels the call at its k-th effect (every await of ``execute``, nested ones included)
    for k = 0, 1, 2, ... until a call finishes first."""
    tool = AsyncTool()

    async def main() -> list[tuple[int, str, list[str]]]:
        seen: list[tuple[int, str, list[str]]] = []
        async with _async_recorder(isolated, tool) as recorder:
            await recorder.execute("acme", "a", "tool", {"warm": True})
            perform = recorder._perform
            for k in range(40):
                count = 0
                current: list[asyncio.Task[Any]] = []

                async def cancelling(
                    effect: Any, k: int = k, current: list[asyncio.Task[Any]] = current
                ) -> Any:
                    nonlocal count
                    if count == k:
                        asyncio.get_running_loop().call_soon(current[-1].cancel)
                    count += 1
                    return await perform(effect)

                recorder._perform = cancelling  # type: ignore[method-assign]
                task = asyncio.create_task(recorder.execute("acme", "a", "tool", {"k": k}))
                current.append(task)
                try:
                    await task
                except asyncio.CancelledError as exc:
                    seen.append((k, "cancelled", getattr(exc, "__notes__", [])))
                    continue
                seen.append((k, "done", []))
                if count <= k:
                    break
            recorder._perform = perform  # type: ignore[method-assign]
        return seen

    seen = asyncio.run(main())
    assert seen[-1][1] == "done" and len(seen) > 5, seen
    last = _last_states(isolated)
    assert all(n == 1 for n in tool.calls.values()), tool.calls
    # Whatever was called is recorded as called; whatever was not, is not.
    for key in tool.calls:
        assert last[key] in (X.SUCCEEDED, X.UNKNOWN), (key, last[key], seen)
    for key, state in last.items():
        if key not in tool.calls:
            assert state in (X.INTENT_RECORDED, X.DISPATCHED), (key, state)
    cancelled_after_call = [notes for _k, how, notes in seen if how == "cancelled" and notes]
    assert len(cancelled_after_call) == len(tool.calls) - 2, seen  # not the warm-up or the last
