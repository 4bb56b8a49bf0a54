"""The order of an intent's I/O with a lease store (issue 6): for an id the recorder made, the
lease's commit runs while the intent's acknowledgement is in flight; for a caller's id, and on a
transport that cannot hand records over without waiting, the lease comes first. Both recorders,
with in-memory stand-ins that log each piece of I/O as it starts. (The same order against Kafka
and PostgreSQL, and what the recovery worker makes of an intent left without its lease:
``tests/integration/test_lease_alongside.py``.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError
from test_transport import RECORD, StandInProducer

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.ids import content_ref
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import ExecutionState
from ledger.errors import DeliveryTimeoutError, LeaseLostError
from ledger.leases import Lease, LeaseStore
from ledger.log import KafkaTransport, OutgoingRecord, Positions, SplitTransport
from ledger.pg import DatabaseUnavailableError
from ledger.results import ResultStore
from ledger.settings import Settings
from opledger.fakes.memory import MemoryProvider
from producers import AsyncTransitionRecorder, TransitionRecorder

SETTINGS = Settings(home=Path("/nonexistent"), kafka_security="plaintext")
TOOL = "send_email"
X = ExecutionState
Log = list[str]


def _states(records: Sequence[OutgoingRecord]) -> str:
    return ",".join(
        str(cast(ExecutionTransitioned, default_codec().decode(r.value)).state) for r in records
    )


class SplitMemoryTransport:
    """Keeps every record it is handed; logs ``submit``/``wait`` with the records' states. The
    waits whose numbers (1-based) are in ``lose`` lose their acknowledgement."""

    def __init__(
        self,
        log: Log,
        lose: Sequence[int] = (),
        *,
        refuse_submit: bool = False,
        warm: bool = True,
    ) -> None:
        self.log = log
        self.warm = warm
        self.records: list[OutgoingRecord] = []
        self._lose = set(lose)
        self._waits = 0
        self._refuse_submit = refuse_submit

    def submit(self, records: Sequence[OutgoingRecord]) -> Sequence[OutgoingRecord]:
        self.log.append(f"submit {_states(records)}")
        if self._refuse_submit:
            self._refuse_submit = False
            raise DeliveryTimeoutError("the producer's queue stayed full")
        self.records.extend(records)
        return records

    def wait(self, submitted: Sequence[OutgoingRecord]) -> Positions:
        self.log.append(f"wait {_states(submitted)}")
        self._waits += 1
        if self._waits in self._lose:
            raise DeliveryTimeoutError("acknowledgement lost")
        self.warm = True
        return []

    async def wait_async(self, submitted: Sequence[OutgoingRecord]) -> Positions:
        return self.wait(submitted)

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        return self.wait(self.submit(records))

    def close(self) -> None:
        pass

    def executions(self) -> list[ExecutionTransitioned]:
        codec = default_codec()
        return [cast(ExecutionTransitioned, codec.decode(r.value)) for r in self.records]


class SendOnlyTransport:
    """Sends and waits in one go only (no ``submit``): not a SplitTransport."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        self.log.append(f"send {_states(records)}")
        return []

    def close(self) -> None:
        pass


class MemoryLeases(LeaseStore):
    """A lease store without a database: logs each call; ``create`` raises ``fail`` if set."""

    def __init__(self, log: Log, fail: Exception | None = None) -> None:
        super().__init__(cast(Any, None), "unit-owner")
        self.log = log
        self.fail = fail
        self.created: list[str] = []

    def create(
        self,
        operation_id: str,
        tenant_id: str,
        ttl: timedelta,
        *,
        tool_name: str,
        request_hash: str,
        request: bytes,
    ) -> Lease:
        self.log.append("lease")
        if self.fail is not None:
            raise self.fail
        self.created.append(operation_id)
        deadline = time.monotonic() + ttl.total_seconds() - 0.5
        return Lease(operation_id, tenant_id, 1, self.owner, deadline)

    def holds(self, lease: Lease) -> bool:
        self.log.append("holds")
        return True

    def release(self, leases: Sequence[Lease]) -> None:
        self.log.append("release")

    def tenant_of(self, operation_id: str) -> str | None:
        self.log.append("tenant_of")
        return None


class MemoryResults(ResultStore):
    def __init__(self) -> None:
        pass

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        return content_ref(payload)


def _logging_provider(log: Log) -> MemoryProvider:
    provider = MemoryProvider(TOOL)
    call = provider.call

    def logged(request: Any, key: str) -> Any:
        log.append("call")
        return call(request, key)

    provider.call = logged  # type: ignore[method-assign,assignment]  # logs, then calls it
    return provider


def _logging_policy(log: Log, allowed: bool = True) -> Callable[[PolicyRequest], PolicyDecision]:
    def policy(request: PolicyRequest) -> PolicyDecision:
        log.append("policy")
        return PolicyDecision(allowed, "the test's policy", None)

    return policy


class Rig:
    """Either recorder over the stand-ins, driven synchronously."""

    def __init__(
        self,
        kind: str,
        transport: SplitMemoryTransport | SendOnlyTransport,
        leases: MemoryLeases,
        log: Log,
    ) -> None:
        self.kind = kind
        self.transport: Any = transport
        self.leases = leases
        self.provider = _logging_provider(log)
        self.options: dict[str, Any] = {
            "leases": leases,
            "results": MemoryResults(),
            "providers": [self.provider],
            "policy": _logging_policy(log),
        }

    def run(self, act: Callable[[Any], Any]) -> Any:
        """``act(recorder)``, awaited when the recorder is the asyncio one."""
        if self.kind == "threaded":
            return act(TransitionRecorder(SETTINGS, self.transport, **self.options))

        async def main() -> Any:
            recorder = AsyncTransitionRecorder(SETTINGS, self.transport, **self.options)
            try:
                return await act(recorder)
            finally:
                await recorder.close()

        return asyncio.run(main())


KINDS = ["threaded", "asyncio"]


def _rig(kind: str, *, lose: Sequence[int] = (), fail: Exception | None = None) -> tuple[Rig, Log]:
    log: Log = []
    return Rig(kind, SplitMemoryTransport(log, lose), MemoryLeases(log, fail), log), log


def _execute(operation_id: str | None = None) -> Callable[[Any], Any]:
    return lambda recorder: recorder.execute(
        "acme", "agent-7", TOOL, {"to": "a@example.com"}, operation_id=operation_id
    )


def test_the_memory_transport_is_a_split_one_and_the_send_only_one_is_not() -> None:
    assert isinstance(SplitMemoryTransport([]), SplitTransport)
    assert not isinstance(SendOnlyTransport([]), SplitTransport)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_intent_takes_its_lease_and_policy_while_its_ack_is_in_flight(kind: str) -> None:
    rig, log = _rig(kind)
    done = rig.run(_execute())
    assert done.state is X.SUCCEEDED
    assert log == [
        "submit INTENT_RECORDED",
        "lease",
        "policy",
        "wait INTENT_RECORDED",
        "submit DISPATCHED",
        "wait DISPATCHED",
        "holds",  # after the dispatch is acknowledged, before the call: a take-over stops it
        "call",
        "submit SUCCEEDED",
        "wait SUCCEEDED",
    ]
    assert [e.lease_token for e in rig.transport.executions()] == [1, 1, 1]
    assert rig.leases.created == [done.operation_id]


@pytest.mark.parametrize("kind", KINDS)
def test_intent_alone_returns_once_the_lease_and_the_ack_are_both_in(kind: str) -> None:
    rig, log = _rig(kind)
    op = rig.run(lambda recorder: recorder.intent("acme", "agent-7", TOOL, {"n": 1}))
    assert log == ["submit INTENT_RECORDED", "lease", "wait INTENT_RECORDED"]
    assert op.lease is not None and op.lease.token == 1 and op.in_doubt is None
    assert [e.lease_token for e in rig.transport.executions()] == [1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_callers_own_id_is_leased_before_anything_is_sent(kind: str) -> None:
    rig, log = _rig(kind)
    rig.run(_execute("op_01JABCDEFGHJKMNPQRSTVWXYZ0"))
    assert log[:5] == [
        "tenant_of",  # an earlier call with this id?
        "lease",
        "submit INTENT_RECORDED",
        "policy",  # a read: it still overlaps the acknowledgement
        "wait INTENT_RECORDED",
    ]
    log.clear()
    rig.run(lambda r: r.intent("acme", "agent-7", TOOL, {"n": 2}, "op_01JABCDEFGHJKMNPQRSTVWXYZ1"))
    assert log == ["lease", "submit INTENT_RECORDED", "wait INTENT_RECORDED"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "failure",
    [
        LeaseLostError("op is already owned by another process"),
        DatabaseUnavailableError("could not take the lease: PostgreSQL did not answer"),
    ],
)
def test_a_lease_that_fails_after_the_intent_was_submitted_is_raised_and_nothing_follows(
    kind: str, failure: Exception
) -> None:
    rig, log = _rig(kind, fail=failure)
    with pytest.raises(type(failure)) as raised:
        rig.run(_execute())
    assert raised.value is failure
    # The intent's outcome was awaited; no policy read, no dispatch, no call.
    assert log == ["submit INTENT_RECORDED", "lease", "wait INTENT_RECORDED"]
    assert [str(e.state) for e in rig.transport.executions()] == ["INTENT_RECORDED"]
    assert rig.provider.stats().calls == 0


@pytest.mark.parametrize("kind", KINDS)
def test_when_the_lease_and_the_ack_both_fail_the_lease_error_wins_and_nothing_is_resent(
    kind: str,
) -> None:
    # Were the lost acknowledgement raised instead, execute would resend the intent and go on
    # to dispatch with no lease.
    rig, log = _rig(kind, lose=[1], fail=LeaseLostError("owned by another process"))
    with pytest.raises(LeaseLostError):
        rig.run(_execute())
    assert log == ["submit INTENT_RECORDED", "lease", "wait INTENT_RECORDED"]
    assert rig.provider.stats().calls == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_intent_ack_keeps_the_lease_taken_beside_it_and_is_resent(kind: str) -> None:
    rig, log = _rig(kind, lose=[1])
    done = rig.run(_execute())
    assert done.state is X.SUCCEEDED
    assert log[:6] == [
        "submit INTENT_RECORDED",
        "lease",
        "policy",
        "wait INTENT_RECORDED",  # lost
        "submit INTENT_RECORDED",  # the identical event, resent
        "wait INTENT_RECORDED",
    ]
    assert log[6] == "policy", "read again after the resends"
    assert log.count("lease") == 1
    events = rig.transport.executions()
    assert events[0].event_id == events[1].event_id
    assert {e.lease_token for e in events} == {1}
    assert rig.provider.stats().calls == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_submit_that_fails_still_takes_the_lease_and_the_intent_is_resent_under_it(
    kind: str,
) -> None:
    log: Log = []
    transport = SplitMemoryTransport(log, refuse_submit=True)
    rig = Rig(kind, transport, MemoryLeases(log), log)
    done = rig.run(_execute())
    assert done.state is X.SUCCEEDED
    assert log[:5] == [
        "submit INTENT_RECORDED",  # refused: the queue stayed full
        "lease",
        "policy",
        "submit INTENT_RECORDED",
        "wait INTENT_RECORDED",
    ]
    assert {e.lease_token for e in transport.executions()} == {1}


@pytest.mark.parametrize("kind", KINDS)
def test_a_transport_that_cannot_split_takes_the_lease_first(kind: str) -> None:
    log: Log = []
    rig = Rig(kind, SendOnlyTransport(log), MemoryLeases(log), log)
    rig.run(_execute())
    assert log[:4] == ["lease", "policy", "send INTENT_RECORDED", "send DISPATCHED"]
    log.clear()
    failing = Rig(kind, SendOnlyTransport(log), MemoryLeases(log, LeaseLostError("taken")), log)
    with pytest.raises(LeaseLostError):
        failing.run(_execute())
    assert log == ["lease"], "nothing sent without the lease"


@pytest.mark.parametrize("kind", KINDS)
def test_a_producer_that_never_had_an_ack_gets_the_lease_first_then_overlaps(kind: str) -> None:
    log: Log = []
    transport = SplitMemoryTransport(log, warm=False)
    rig = Rig(kind, transport, MemoryLeases(log), log)
    rig.run(lambda recorder: recorder.intent("acme", "agent-7", TOOL, {"n": 1}))
    assert log == ["lease", "submit INTENT_RECORDED", "wait INTENT_RECORDED"]
    log.clear()
    rig.run(lambda recorder: recorder.intent("acme", "agent-7", TOOL, {"n": 2}))
    assert log == ["submit INTENT_RECORDED", "lease", "wait INTENT_RECORDED"]


def test_the_kafka_transport_is_warm_once_a_record_was_acknowledged() -> None:
    transport = KafkaTransport(SETTINGS, producer_factory=StandInProducer)
    try:
        assert isinstance(transport, SplitTransport)
        assert not transport.warm
        transport.send([RECORD])
        assert transport.warm
        transport._on_client_error(KafkaError(KafkaError._FATAL, "sequence broken", fatal=True))
        transport.send([RECORD])  # through a fresh client, warm once it had its ack
        assert transport.warm
        transport._on_client_error(KafkaError(KafkaError._FATAL, "sequence broken", fatal=True))
        transport._replace_producer()
        assert not transport.warm, "a fresh client is cold again"
    finally:
        transport.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_refusal_read_beside_the_intent_is_recorded_as_before(kind: str) -> None:
    rig, log = _rig(kind)
    rig.options["policy"] = _logging_policy(log, allowed=False)
    done = rig.run(_execute())
    assert done.refused and done.state is X.FAILED and done.attempt == 0
    assert done.policy is not None and not done.policy.allowed
    assert log == [
        "submit INTENT_RECORDED",
        "lease",
        "policy",
        "wait INTENT_RECORDED",
        "submit FAILED",
        "wait FAILED",
    ]
    assert rig.provider.stats().calls == 0


def test_a_handle_without_its_lease_is_never_dispatched() -> None:
    # A recorder with a lease store never dispatches a handle that holds no lease, whatever
    # path led there.
    from producers.execution import _dispatch_and_call  # noqa: PLC0415

    log: Log = []
    recorder = TransitionRecorder(
        SETTINGS,
        SplitMemoryTransport(log),
        leases=MemoryLeases(log),
        providers=[_logging_provider(log)],
    )
    plain = TransitionRecorder(SETTINGS, SplitMemoryTransport(log))
    handle = plain.intent("acme", "agent-7", TOOL, {"n": 3})
    log.clear()
    with pytest.raises(LeaseLostError, match="not held under a lease"):
        collaborators = recorder.collaborators
        provider = collaborators.providers[TOOL]
        recorder._drive(_dispatch_and_call(collaborators, handle, provider, {}))
    assert log == []
