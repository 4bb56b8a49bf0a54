"""The lease of a fresh operation is committed while its intent's acknowledgement is in flight
(issue 6), against the real broker and database: the order of ``execute``'s I/O on both
recorders, a lease PostgreSQL refuses after the intent was handed to the producer, and what the
recovery worker makes of an intent left in the log without its lease (PostgreSQL down)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import psycopg
import pytest

from ledger.codec import default_codec
from ledger.domain import ids
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.errors import LeaseLostError
from ledger.leases import LeaseStore, process_identity
from ledger.log import KafkaTransport, OutgoingRecord, Positions, SplitTransport, Transport
from ledger.pg import DatabaseUnavailableError, open_pool
from ledger.settings import Settings
from ledger.tools import ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from producers import AsyncTransitionRecorder, TrackedOperation, TransitionRecorder
from tests.integration.test_execute import X, _executions
from tests.integration.test_recovery import Rig, _shape
from tests.support import free_port

TOOL = "send_email"
TERMS = ProviderTerms(
    call_timeout=timedelta(milliseconds=200), key_retention=timedelta(hours=1), repeat_safe=True
)
KINDS = ["threaded", "asyncio"]
WARM_UP = {"warm": "up"}
Log = list[str]


def _states(records: Sequence[OutgoingRecord]) -> str:
    codec = default_codec()
    return ",".join(str(cast(ExecutionTransitioned, codec.decode(r.value)).state) for r in records)


class Watched:
    """The real Kafka transport, logging when records are handed to the producer and when a
    wait for their acknowledgements begins."""

    def __init__(self, inner: Transport, log: Log) -> None:
        assert isinstance(inner, SplitTransport)
        self.inner = cast(KafkaTransport, inner)
        self.log = log

    @property
    def warm(self) -> bool:
        return self.inner.warm

    def submit(self, records: Sequence[OutgoingRecord]) -> Any:
        self.log.append(f"submit {_states(records)}")
        return self.inner.submit(records)

    def wait(self, submitted: Any) -> Positions:
        self.log.append("wait")
        return self.inner.wait(submitted)

    async def wait_async(self, submitted: Any) -> Positions:
        self.log.append("wait")
        return await self.inner.wait_async(submitted)

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        self.log.append(f"send {_states(records)}")
        return self.inner.send(records)

    async def send_async(self, records: Sequence[OutgoingRecord]) -> Positions:
        self.log.append(f"send {_states(records)}")
        return await self.inner.send_async(records)

    def close(self) -> None:
        self.inner.close()


def _logged(log: Log, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def logged(*args: Any, **kwargs: Any) -> Any:
        log.append(name)
        return call(*args, **kwargs)

    return logged


def _allow(request: PolicyRequest) -> PolicyDecision:
    return PolicyDecision(True, "allowed by the test", None)


def _drive(
    kind: str, settings: Settings, log: Log, act: Callable[[Any], Any], **connect: Any
) -> Any:
    """``act(recorder)`` on a recorder from ``connect`` whose transport, lease store, policy
    and provider log their I/O, after one intent that warms its producer up (until a first
    acknowledgement the lease comes first: ``KafkaTransport.warm``)."""

    def watch(recorder: Any) -> Any:
        leases = recorder.collaborators.leases
        for name in ("create", "holds", "tenant_of"):
            setattr(leases, name, _logged(log, name, getattr(leases, name)))
        recorder.collaborators.policy = _logged(log, "policy", _allow)
        return recorder

    def transport(inner: Transport) -> Transport:
        return Watched(inner, log)

    if kind == "threaded":
        with TransitionRecorder.connect(settings, wrap_transport=transport, **connect) as r:
            watch(r).intent("acme", "agent-7", TOOL, WARM_UP)
            log.clear()
            return act(r)

    async def main() -> Any:
        async with AsyncTransitionRecorder.connect(
            settings, wrap_transport=transport, **connect
        ) as recorder:
            await watch(recorder).intent("acme", "agent-7", TOOL, WARM_UP)
            log.clear()
            return await act(recorder)

    return asyncio.run(main())


def _provider(log: Log) -> MemoryProvider:
    provider = MemoryProvider(TOOL, TERMS, mode=Mode.NON_IDEMPOTENT)
    provider.call = _logged(log, "call", provider.call)  # type: ignore[method-assign]
    return provider


@pytest.mark.parametrize("kind", KINDS)
def test_execute_commits_the_lease_while_the_intent_is_in_flight(
    isolated: Settings, kind: str
) -> None:
    log: Log = []
    provider = _provider(log)
    done = _drive(
        kind,
        isolated,
        log,
        lambda r: r.execute("acme", "agent-7", TOOL, {"to": "a@example.com"}),
        providers=[provider],
    )
    assert done.state is X.SUCCEEDED
    assert log == [
        "submit INTENT_RECORDED",  # handed to the producer...
        "create",  # ...the lease committed while its acknowledgement is in flight...
        "policy",  # ...and policy read...
        "wait",  # ...then the acknowledgement awaited
        "send DISPATCHED",
        "holds",  # after DISPATCHED is acknowledged, before the call (a take-over stops it)
        "call",
        "send SUCCEEDED",
    ]
    events = [e for e in _executions(isolated) if e.operation_id == done.operation_id]
    assert [(e.state, e.attempt, e.lease_token) for e in events] == [
        (X.INTENT_RECORDED, 0, 1),
        (X.DISPATCHED, 1, 1),
        (X.SUCCEEDED, 1, 1),
    ]
    with psycopg.connect(isolated.dsn) as conn:
        lease = conn.execute(
            "SELECT token FROM operation_leases WHERE operation_id = %s", (done.operation_id,)
        ).fetchall()
        request = conn.execute(
            "SELECT body FROM operation_requests WHERE operation_id = %s", (done.operation_id,)
        ).fetchall()
    assert lease == [(1,)]
    assert request == [(b'{"to":"a@example.com"}',)]
    assert provider.stats().calls == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_lease_refused_after_the_intent_was_submitted_is_raised_and_nothing_follows(
    isolated: Settings, kind: str
) -> None:
    log: Log = []
    provider = _provider(log)
    held = ids.operation_id(1_700_000_000_000, b"held-by-b!")
    # Someone else holds the id this recorder is about to make (an impossible collision of
    # fresh ids, arranged here so PostgreSQL itself refuses the lease).
    pool = open_pool(isolated.dsn, name="test-other-owner")
    try:
        LeaseStore(pool, "someone-else").create(
            held,
            "acme",
            timedelta(minutes=5),
            tool_name=TOOL,
            request_hash=ids.request_hash(TOOL, {}),
            request=b"{}",
        )
    finally:
        pool.close()

    def act(recorder: Any) -> Any:
        recorder.new_operation_id = lambda: held
        return recorder.execute("acme", "agent-7", TOOL, {"to": "a@example.com"})

    with pytest.raises(LeaseLostError, match="already owned"):
        _drive(kind, isolated, log, act, providers=[provider])
    assert log == ["submit INTENT_RECORDED", "create", "wait"]
    events = [e for e in _executions(isolated) if e.operation_id == held]
    assert [(e.state, e.lease_token) for e in events] == [(X.INTENT_RECORDED, 1)]
    assert provider.stats().calls == 0
    with psycopg.connect(isolated.dsn) as conn:
        owners = conn.execute(
            "SELECT owner, token FROM operation_leases WHERE operation_id = %s", (held,)
        ).fetchall()
    assert owners == [("someone-else", 1)]


def test_an_intent_whose_lease_was_never_stored_is_parked_never_called(
    isolated: Settings,
) -> None:
    """PostgreSQL is down for the lease: the caller gets the error, which says the intent is on
    the log without its request and that a person will decide it; the log holds the intent
    (token 1) with no lease and no stored request; the recovery worker takes it over (token 2:
    a claim with token 1 would be fenced) once the grace it leaves a writer still committing
    its lease has passed (OPLEDGER_RECOVERY_UNLEASED_GRACE_S, 1 s here), parks it, and the
    tool is never called."""
    provider = MemoryProvider(TOOL, TERMS, mode=Mode.NON_IDEMPOTENT)
    rig = Rig(isolated.with_(recovery_unleased_grace_s=1), provider)
    dead = open_pool(
        f"host=127.0.0.1 port={free_port()} dbname=opledger user=opledger", name="test-dead"
    )
    transport = KafkaTransport(isolated)
    service = TransitionRecorder(
        isolated,
        transport,
        leases=LeaseStore(dead, process_identity("cut-off")),
        providers=[provider],
        owns=[transport, dead],
    )
    # Its producer had an acknowledgement (KafkaTransport.warm), as any but a brand-new one:
    # an intent of another operation, by a recorder without leases on the same transport.
    TransitionRecorder(isolated, transport).intent("acme", "agent-7", TOOL, WARM_UP)
    op_id = service.new_operation_id()
    service.new_operation_id = lambda: op_id  # type: ignore[method-assign]
    try:
        with pytest.raises(DatabaseUnavailableError, match="take the lease") as raised:
            service.execute("acme", "agent-7", TOOL, {"to": "a@example.com"})
        assert raised.value.operation_id == op_id
        assert "INTENT_RECORDED" in str(raised.value)
        assert "without a lease or a stored request" in str(raised.value)
        assert "parks it for a person" in str(raised.value)
        service.close()
        op = TrackedOperation.unknown(op_id)
        assert _shape(rig.events(op)) == ["INTENT_RECORDED#0"]
        assert [e.lease_token for e in _executions(isolated) if e.operation_id == op_id] == [1]
        rig.recover(passes=2)
        state, attempt, parked, decision, _ref = rig.row(op)
        assert (state, attempt, decision) == ("INTENT_RECORDED", 0, "PARK")
        assert parked and "never stored" in parked
        assert _shape(rig.events(op)) == ["INTENT_RECORDED#0", "OWNER#2", "PARK:NOT_LOOKED_UP"]
        assert provider.stats().calls == 0
        with psycopg.connect(isolated.dsn) as conn:
            anomalies = conn.execute("SELECT count(*) FROM anomalies").fetchone()
            kinds = conn.execute("SELECT kind, reason, event FROM anomalies").fetchall()
        assert anomalies == (0,), kinds
    finally:
        service.close()
        rig.close()
