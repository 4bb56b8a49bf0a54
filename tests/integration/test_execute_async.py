"""``await recorder.execute`` (the asyncio recorder) against the real broker and database: the
same steps and guarantees as ``tests/integration/test_execute.py``, with synchronous providers
(called on the recorder's tool threads) and asyncio providers (awaited), and the event loop never
blocked by the ledger's own PostgreSQL work or by a slow tool.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.log import end_offsets
from ledger.settings import Settings
from ledger.tools import CallOutcome, LookupResult, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Action, Mode
from opledger.fakes.state import ProviderState
from producers import (
    AsyncTransitionRecorder,
    ConflictError,
    Execution,
    IllegalTransitionError,
    LeaseLostError,
    ResultStore,
    TransitionRecorder,
    UnknownToolError,
)
from tests.integration.test_execute import TERMS, X, _executions, allow_all
from tests.support import grant, project_in_process

#: for tools slower than their timeout
SHORT = ProviderTerms(
    call_timeout=timedelta(seconds=0.5), key_retention=timedelta(hours=1), repeat_safe=True
)
#: tool name -> whether its provider is an asyncio one
TOOLS = {"send_email": False, "post_slack_message": True}


class AsyncTool:
    """An :class:`ledger.tools.AsyncProvider` over the in-memory fake: it awaits its latency
    (never blocking the loop), then lets the fake decide and count. Cancelled during its
    latency (a timeout), it never reaches the fake: no call, no effect."""

    def __init__(self, fake: MemoryProvider, latency_s: float = 0.0) -> None:
        self.tool_name = fake.tool_name
        self.terms = fake.terms
        self.fake = fake
        self.latency_s = latency_s

    async def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        await asyncio.sleep(self.latency_s)
        return self.fake.call(request, idempotency_key)

    async def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        return self.fake.lookup(idempotency_key, provider_ref)


class BrokenTool:
    """A synchronous provider whose call fails with an error that is not ContactLost."""

    tool_name = "broken_tool"
    terms = TERMS

    def __init__(self) -> None:
        self.calls = 0

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        self.calls += 1
        raise RuntimeError("connection reset by peer")

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        raise NotImplementedError


def _fakes(
    *, latency_s: float = 0.0, terms: ProviderTerms = TERMS, prefix: str = ""
) -> tuple[ProviderState, list[Any]]:
    """Both kinds of provider over one fake: ``send_email`` synchronous (the fake itself, whose
    latency really sleeps), ``post_slack_message`` asyncio (latency awaited); ``prefix`` goes
    before their tool names."""
    state = ProviderState()
    providers: list[Any] = []
    for tool, is_async in TOOLS.items():
        fake = MemoryProvider(
            prefix + tool,
            terms,
            mode=Mode.NON_IDEMPOTENT,
            state=state,
            latency_s=0.0 if is_async else latency_s,
        )
        providers.append(AsyncTool(fake, latency_s) if is_async else fake)
    return state, providers


def _run(
    settings: Settings, scenario: Callable[[AsyncTransitionRecorder], Awaitable[Any]], **kw: Any
) -> Any:
    """``scenario`` on a recorder from ``connect`` with a policy that allows everything (the
    mechanics are tested here; test_policy*.py test policy itself)."""

    async def main() -> Any:
        async with AsyncTransitionRecorder.connect(settings, **kw) as recorder:
            recorder.collaborators.policy = allow_all
            return await scenario(recorder)

    return asyncio.run(main())


def _projected(settings: Settings) -> list[tuple[Any, ...]]:
    """Everything projected: (state, lease token, operations, anomalies) by state and token."""
    project_in_process(settings)
    with psycopg.connect(settings.dsn) as conn:
        return conn.execute(
            "SELECT execution_state, lease_token, count(*), (SELECT count(*) FROM anomalies) "
            "FROM agent_operations GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()


def _lease_expired(settings: Settings, op_id: str) -> bool:
    with psycopg.connect(settings.dsn) as conn:
        row = conn.execute(
            "SELECT expires_at <= now() FROM operation_leases WHERE operation_id = %s", (op_id,)
        ).fetchone()
    assert row is not None, f"no lease for {op_id}"
    return bool(row[0])


class ThreadLog:
    """Which threads the recorder's blocking calls ran on (the real calls still run)."""

    def __init__(self) -> None:
        self.threads: dict[str, set[int]] = {}

    def wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.setdefault(name, set()).add(threading.get_ident())
            return call(*args, **kwargs)

        return recorded


@pytest.fixture
def thread_log() -> Iterator[ThreadLog]:
    yield ThreadLog()


def test_execute_records_every_step_off_the_event_loop(
    isolated: Settings, thread_log: ThreadLog
) -> None:
    version = grant(isolated, "acme")
    project_in_process(isolated)  # the grant, folded into the policy table execute reads
    state, providers = _fakes()

    async def scenario(recorder: AsyncTransitionRecorder) -> tuple[int, list[Execution]]:
        leases, results = recorder.collaborators.leases, recorder.collaborators.results
        assert (
            leases is not None and results is not None and recorder.collaborators.policy is not None
        )
        for name in ("create", "holds", "tenant_of"):
            setattr(leases, name, thread_log.wrap(name, getattr(leases, name)))
        results.put = thread_log.wrap("put", results.put)  # type: ignore[method-assign]
        recorder.collaborators.policy = thread_log.wrap("policy", recorder.collaborators.policy)
        done = [
            await recorder.execute("acme", "agent-7", tool, {"to": "a@example.com"})
            for tool in TOOLS
        ]
        given = recorder.new_operation_id()  # the caller's own id: checked for a repeat first
        done.append(await recorder.execute("acme", "agent-7", "send_email", {}, operation_id=given))
        return threading.get_ident(), done

    loop_thread, done = asyncio.run(_connected(isolated, scenario, providers=providers))
    for one in done:
        assert one.state is X.SUCCEEDED and not one.repeat, one
        assert one.policy is not None and one.policy.allowed and one.policy.version == version
    events = _executions(isolated)
    for one in done:
        mine = [e for e in events if e.operation_id == one.operation_id]
        # (state, attempt, lease token, result): every step under the lease, token 1
        assert [(e.state, e.attempt, e.lease_token, e.result_ref) for e in mine] == [
            (X.INTENT_RECORDED, 0, 1, None),
            (X.DISPATCHED, 1, 1, None),
            (X.SUCCEEDED, 1, 1, one.result_ref),
        ]
        assert mine[1].provider_ref == one.operation_id, "the idempotency key is the op id"
    assert {tool: state.tool_stats(tool).calls for tool in TOOLS} == {
        "send_email": 2,
        "post_slack_message": 1,
    }
    with ResultStore.connect(isolated.dsn) as store:
        assert [store.get("acme", one.result_ref or "") for one in done] == [
            one.result for one in done
        ]
    assert set(thread_log.threads) == {"create", "holds", "tenant_of", "put", "policy"}
    on_loop = {name for name, ids in thread_log.threads.items() if loop_thread in ids}
    assert not on_loop, f"blocking calls ran on the event loop's thread: {on_loop}"
    assert _projected(isolated) == [("SUCCEEDED", 1, 3, 0)]


async def _connected(
    settings: Settings,
    scenario: Callable[[AsyncTransitionRecorder], Awaitable[Any]],
    **kwargs: Any,
) -> Any:
    """``scenario`` on a recorder from ``connect`` with the real policy store."""
    async with AsyncTransitionRecorder.connect(settings, **kwargs) as recorder:
        return await scenario(recorder)


def test_intent_takes_the_lease_and_stores_the_request(isolated: Settings) -> None:
    async def scenario(recorder: AsyncTransitionRecorder) -> Any:
        return await recorder.intent("acme", "agent-7", "send_email", {"to": "b@example.com"})

    op = _run(isolated, scenario)
    assert op.lease is not None and op.lease.token == 1 and op.lease.valid()
    with psycopg.connect(isolated.dsn) as conn:
        lease = conn.execute(
            "SELECT tenant_id, token, expires_at > now() FROM operation_leases"
        ).fetchall()
        request = conn.execute("SELECT operation_id, body FROM operation_requests").fetchall()
    assert lease == [("acme", 1, True)]
    assert request == [(op.operation_id, b'{"to":"b@example.com"}')]
    assert [e.lease_token for e in _executions(isolated)] == [1]


def test_a_confirmed_failure_is_failed(isolated: Settings) -> None:
    state, providers = _fakes()

    async def scenario(recorder: AsyncTransitionRecorder) -> list[Execution]:
        done = []
        for tool in TOOLS:
            op_id = recorder.new_operation_id()
            state.script(tool, op_id, [Action.FAIL])
            done.append(await recorder.execute("acme", "agent-7", tool, {}, operation_id=op_id))
        return done

    for one in _run(isolated, scenario, providers=providers):
        assert (one.state, one.attempt) == (X.FAILED, 1) and one.error, one
        assert not one.refused and one.result is None
    assert [state.tool_stats(tool).side_effects for tool in TOOLS] == [0, 0]


def test_lost_contact_is_unknown_returned_never_raised(isolated: Settings) -> None:
    state, providers = _fakes()
    # The same tools under other names, slower (3 s) than their call timeout (0.5 s).
    _slow_state, slow = _fakes(latency_s=3.0, terms=SHORT, prefix="slow_")
    broken = BrokenTool()

    async def scenario(recorder: AsyncTransitionRecorder) -> dict[str, tuple[Execution, float]]:
        done = {}
        for tool in TOOLS:
            op_id = recorder.new_operation_id()
            state.script(tool, op_id, [Action.LOSE_RESPONSE])
            done[tool] = await _timed(
                recorder.execute("acme", "agent-7", tool, {}, operation_id=op_id)
            )
        for provider in [*slow, broken]:
            done[provider.tool_name] = await _timed(
                recorder.execute("acme", "agent-7", provider.tool_name, {})
            )
        return done

    done = _run(isolated, scenario, providers=[*providers, *slow, broken])
    for tool, (one, _seconds) in done.items():
        assert one.state is X.UNKNOWN and one.attempt == 1, (tool, one)
        assert _lease_expired(isolated, one.operation_id), f"{tool}: released for the worker"
    for tool in TOOLS:
        assert "contact lost after dispatch" in (done[tool][0].error or "")
        assert state.tool_stats(tool).side_effects == 1, "the effect happened; nothing retried it"
        slow_one, seconds = done[f"slow_{tool}"]
        assert "no answer within 0.5s" in (slow_one.error or ""), slow_one
        assert seconds < 2.5, f"{tool}: waited {seconds:.2f}s for a tool that takes 3s"
    # The caller is told what the log holds: the exception's type and words.
    assert done["broken_tool"][0].error == "RuntimeError: connection reset by peer"
    assert broken.calls == 1
    assert state.tool_stats("send_email").calls == 1


async def _timed(call: Awaitable[Execution]) -> tuple[Execution, float]:
    started = time.monotonic()
    done = await call
    return done, time.monotonic() - started


def test_policy_refusal_fails_the_intent_without_a_call(isolated: Settings) -> None:
    state, providers = _fakes()
    asked: list[PolicyRequest] = []
    revoked = PolicyDecision(False, "the grant was revoked", "ev_01JABCDEFGHJKMNPQRSTVWXYZ0")

    def refuse(request: PolicyRequest) -> PolicyDecision:
        asked.append(request)
        return revoked

    async def scenario(recorder: AsyncTransitionRecorder) -> Execution:
        recorder.collaborators.policy = refuse
        return await recorder.execute("acme", "agent-9", "post_slack_message", {"n": 2})

    done = _run(isolated, scenario, providers=providers)
    assert (done.refused, done.state, done.attempt) == (True, X.FAILED, 0)
    assert done.error == f"refused by policy {revoked.version}: {revoked.reason}"
    assert [(a.tenant_id, a.actor_id, a.tool_name, a.purpose) for a in asked] == [
        ("acme", "agent-9", "post_slack_message", Purpose.DISPATCH)
    ]
    assert [state.tool_stats(tool).calls for tool in TOOLS] == [0, 0]
    assert [(e.state, e.attempt) for e in _executions(isolated)] == [
        (X.INTENT_RECORDED, 0),
        (X.FAILED, 0),
    ]


def test_a_repeated_operation_id_never_calls_the_tool_twice(isolated: Settings) -> None:
    state, providers = _fakes(latency_s=0.3)

    async def scenario(recorder: AsyncTransitionRecorder) -> dict[str, Any]:
        out: dict[str, Any] = {}
        op, lost = recorder.new_operation_id(), recorder.new_operation_id()
        out["first"] = await recorder.execute(
            "acme", "agent-7", "send_email", {"n": 1}, operation_id=op
        )
        out["again"] = await recorder.execute(
            "acme", "agent-7", "send_email", {"n": 1}, operation_id=op
        )
        state.script("post_slack_message", lost, [Action.LOSE_RESPONSE])
        await recorder.execute("acme", "agent-7", "post_slack_message", {}, operation_id=lost)
        out["unknown"] = await recorder.execute(
            "acme", "agent-7", "post_slack_message", {}, operation_id=lost
        )
        # Two tasks with one id at once: one runs it, the other is refused at once.
        both = recorder.new_operation_id()
        out["both"] = await asyncio.gather(
            *(
                recorder.execute("acme", "agent-7", "send_email", {"n": 2}, operation_id=both)
                for _ in range(2)
            ),
            return_exceptions=True,
        )
        before = end_offsets(isolated, [isolated.execution_topic])
        with pytest.raises(IllegalTransitionError, match="already in use"):
            await recorder.execute("globex", "agent-1", "send_email", {"n": 1}, operation_id=op)
        with pytest.raises(ConflictError, match="other arguments"):
            await recorder.execute("acme", "agent-7", "send_email", {"n": 9}, operation_id=op)
        out["nothing written"] = end_offsets(isolated, [isolated.execution_topic]) == before
        out["op"] = op
        return out

    out = _run(isolated, scenario, providers=providers)
    first, again = out["first"], out["again"]
    assert first.state is X.SUCCEEDED and not first.repeat
    assert again.repeat and again.state is X.SUCCEEDED and again.attempt == 1
    assert (again.result, again.result_ref) == (first.result, first.result_ref)
    assert out["unknown"].repeat and out["unknown"].state is X.UNKNOWN
    assert "recovery worker" in (out["unknown"].error or "")
    ran, refused = sorted(out["both"], key=lambda r: isinstance(r, BaseException))
    assert isinstance(ran, Execution) and ran.state is X.SUCCEEDED
    assert isinstance(refused, LeaseLostError), refused
    assert out["nothing written"]
    # Another recorder (another process: a service restarted) reads the outcome too.
    again_elsewhere = _run(
        isolated,
        lambda r: r.execute("acme", "agent-7", "send_email", {"n": 1}, operation_id=out["op"]),
        providers=providers,
        owner="restarted",
    )
    assert again_elsewhere.repeat and again_elsewhere.result == first.result
    keys = state.tool_stats("send_email").keys
    assert [keys[k].calls for k in (out["op"], ran.operation_id)] == [1, 1]
    assert state.tool_stats("post_slack_message").calls == 1
    assert _projected(isolated) == [("SUCCEEDED", 1, 2, 0), ("UNKNOWN", 1, 1, 0)]


def test_the_threaded_recorder_recognises_a_repeated_operation_id_too(
    isolated: Settings,
) -> None:
    # The steps are shared: before they were, a second execute with the same id in the same
    # recorder called the tool again and appended a conflicting history.
    state, providers = _fakes()
    with TransitionRecorder.connect(isolated, providers=providers[:1]) as recorder:
        recorder.collaborators.policy = allow_all
        op = recorder.new_operation_id()
        first = recorder.execute("acme", "agent-7", "send_email", {"n": 1}, operation_id=op)
        again = recorder.execute("acme", "agent-7", "send_email", {"n": 1}, operation_id=op)
    assert first.state is X.SUCCEEDED and again.repeat and again.result == first.result
    assert state.tool_stats("send_email").calls == 1
    assert len(_executions(isolated)) == 3


def test_sixteen_tasks_share_one_recorder(isolated: Settings) -> None:
    state, providers = _fakes(latency_s=0.01)
    per_task = 5

    async def scenario(recorder: AsyncTransitionRecorder) -> list[Execution]:
        async def task(n: int) -> list[Execution]:
            tool = list(TOOLS)[n % 2]
            return [
                await recorder.execute("acme", f"agent-{n}", tool, {"task": n, "call": i})
                for i in range(per_task)
            ]

        batches = await asyncio.gather(*(task(n) for n in range(16)))
        return [one for batch in batches for one in batch]

    done = _run(isolated, scenario, providers=providers)
    assert len({one.operation_id for one in done}) == 16 * per_task
    assert {one.state for one in done} == {X.SUCCEEDED}
    assert sum(state.tool_stats(tool).calls for tool in TOOLS) == 16 * per_task
    assert max(state.tool_stats(tool).max_side_effects_per_key for tool in TOOLS) == 1
    assert len(_executions(isolated)) == 3 * 16 * per_task
    assert _projected(isolated) == [("SUCCEEDED", 1, 16 * per_task, 0)]


def test_the_event_loop_keeps_running_during_slow_calls(isolated: Settings) -> None:
    # Each tool takes 1.5 s (the synchronous one sleeping in its thread, the asyncio one
    # awaiting); a loop blocked by either would stop the heartbeat for that long.
    _state, providers = _fakes(latency_s=1.5)

    async def scenario(recorder: AsyncTransitionRecorder) -> tuple[list[Execution], list[float]]:
        beats: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            while not stop.is_set():
                beats.append(time.monotonic())
                await asyncio.sleep(0.02)

        ticking = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.1)
        done = await asyncio.gather(
            *(recorder.execute("acme", "agent-7", tool, {"slow": True}) for tool in TOOLS)
        )
        stop.set()
        await ticking
        return list(done), beats

    done, beats = _run(isolated, scenario, providers=providers)
    assert {one.state for one in done} == {X.SUCCEEDED}
    assert beats[-1] - beats[0] >= 1.5
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert max(gaps) < 0.5, f"the loop stalled for {max(gaps):.2f}s"
    assert len(beats) >= 30


def test_a_call_that_never_got_a_tool_thread_is_failed_and_not_made(isolated: Settings) -> None:
    state, providers = _fakes(latency_s=1.5, terms=SHORT)

    async def scenario(recorder: AsyncTransitionRecorder) -> list[Execution]:
        # One tool thread: the first call holds it past both calls' timeouts. The second starts
        # once the tool has the first (a fixed pause lost that race on a loaded box: a fresh
        # producer's first acknowledgement alone can take half a second).
        first = asyncio.create_task(recorder.execute("acme", "agent-7", "send_email", {"n": 1}))
        deadline = time.monotonic() + 10
        while state.tool_stats("send_email").calls == 0:
            assert time.monotonic() < deadline, "the first call never reached the tool"
            await asyncio.sleep(0.01)
        second = await recorder.execute("acme", "agent-7", "send_email", {"n": 2})
        return [await first, second]

    first, second = _run(isolated, scenario, providers=providers[:1], tool_threads=1)
    assert first.state is X.UNKNOWN and "no answer within" in (first.error or "")
    assert (second.state, second.attempt) == (X.FAILED, 1), second
    assert "not called" in (second.error or "")
    time.sleep(1.5)  # the first call's thread finishes its call
    keys = state.tool_stats("send_email").keys
    assert first.operation_id in keys and second.operation_id not in keys


def test_bad_input_is_a_clear_error_and_writes_nothing(isolated: Settings) -> None:
    _state, providers = _fakes()
    before = end_offsets(isolated, [isolated.execution_topic])
    with pytest.raises(TypeError, match="AsyncTransitionRecorder"):
        TransitionRecorder.connect(isolated, providers=providers)

    async def scenario(recorder: AsyncTransitionRecorder) -> None:
        with pytest.raises(UnknownToolError, match="charge_card"):
            await recorder.execute("acme", "agent-7", "charge_card", {"n": 1})

    _run(isolated, scenario, providers=providers)
    assert end_offsets(isolated, [isolated.execution_topic]) == before
    with psycopg.connect(isolated.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM operation_leases").fetchone() == (0,)
