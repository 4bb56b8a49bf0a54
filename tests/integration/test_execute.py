"""``recorder.execute`` and the ownership calls (``load``, ``take_over``, ``resume``) against the
real broker and database, with an in-process provider that counts what it saw."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.ids import event_id
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import ExecutionState
from ledger.log import end_offsets
from ledger.results import MAX_RESULT_BYTES, ResultStore
from ledger.settings import Settings
from ledger.tools import CallOutcome, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Action, Mode
from producers import (
    IllegalTransitionError,
    LeaseLostError,
    TransitionRecorder,
    UnknownToolError,
)
from tests.support import project_in_process, read_all

X = ExecutionState
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=2), key_retention=timedelta(hours=1), repeat_safe=True
)


def allow_all(request: PolicyRequest) -> PolicyDecision:
    """Policy for the tests of the mechanics (test_policy*.py test policy itself)."""
    return PolicyDecision(True, "allowed by the test", None)


def _recorder(settings: Settings, **kwargs: object) -> TransitionRecorder:
    recorder = TransitionRecorder.connect(settings, **kwargs)  # type: ignore[arg-type]
    recorder.collaborators.policy = allow_all
    return recorder


def _provider(**kwargs: object) -> MemoryProvider:
    return MemoryProvider("send_email", TERMS, mode=Mode.NON_IDEMPOTENT, **kwargs)  # type: ignore[arg-type]


def _executions(settings: Settings) -> list[ExecutionTransitioned]:
    codec = default_codec()
    out = []
    for _p, _o, _k, value in read_all(settings, settings.execution_topic):
        event = codec.decode(value or b"")
        if isinstance(event, ExecutionTransitioned):
            out.append(event)
    return out


def test_execute_records_every_step_under_its_lease(isolated: Settings) -> None:
    provider = _provider()
    with _recorder(isolated, providers=[provider]) as recorder:
        done = recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
    assert done.state is X.SUCCEEDED and done.result is not None
    events = _executions(isolated)
    assert [(e.state, e.attempt) for e in events] == [
        (X.INTENT_RECORDED, 0),
        (X.DISPATCHED, 1),
        (X.SUCCEEDED, 1),
    ]
    assert {e.lease_token for e in events} == {1}
    assert events[1].provider_ref == done.operation_id, "the idempotency key is the op id"
    stats = provider.stats()
    assert stats.calls == 1 and stats.side_effects == 1
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        row = conn.execute(
            "SELECT execution_state, lease_token, result_ref FROM agent_operations"
        ).fetchone()
    assert row == ("SUCCEEDED", 1, done.result_ref)


class _OddProvider(MemoryProvider):
    """Calls through, then answers with an id, a content type and failure words that cannot be
    recorded as they are."""

    def __init__(self, succeed: bool) -> None:
        super().__init__("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
        self._succeed = succeed

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        done = super().call(request, idempotency_key)
        if self._succeed:
            return dataclasses.replace(
                done, provider_ref="call id with spaces " + "x" * 300, content_type="not a type"
            )
        return CallOutcome(False, error="card\x00declined", provider_ref="odd ref")


@pytest.mark.parametrize("succeed", [True, False])
def test_a_provider_answer_in_odd_words_is_still_recorded(
    isolated: Settings, succeed: bool
) -> None:
    provider = _OddProvider(succeed)
    with _recorder(isolated, providers=[provider]) as recorder:
        done = recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
    assert provider.stats().calls == 1
    last = _executions(isolated)[-1]
    if succeed:
        assert done.state is X.SUCCEEDED and last.state is X.SUCCEEDED
        assert last.provider_ref is None  # the key it was dispatched with stays its reference
        with ResultStore.connect(isolated.dsn) as store:
            stored = store.get_many([("acme", last.result_ref or "")])
        assert [r.content_type for r in stored.values()] == ["application/octet-stream"]
    else:
        assert done.state is X.FAILED and last.state is X.FAILED
        assert last.error == "card\ufffddeclined"


def test_a_result_too_large_to_store_is_unknown_returned_never_raised(
    isolated: Settings,
) -> None:
    class Huge(MemoryProvider):
        def call(self, request: Any, idempotency_key: str) -> CallOutcome:
            super().call(request, idempotency_key)
            return CallOutcome(True, result=b"x" * (MAX_RESULT_BYTES + 1))

    provider = Huge("send_email", TERMS, mode=Mode.NON_IDEMPOTENT)
    with _recorder(isolated, providers=[provider]) as recorder:
        done = recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
    assert done.state is X.UNKNOWN and "over the result store's limit" in (done.error or "")
    assert provider.stats().calls == 1
    assert [e.state for e in _executions(isolated)][-1] is X.UNKNOWN


def test_lost_contact_is_unknown_returned_never_raised_and_the_lease_released(
    isolated: Settings,
) -> None:
    provider = _provider()
    with _recorder(isolated, providers=[provider]) as recorder:
        op_id = recorder.new_operation_id()
        provider.script(op_id, [Action.LOSE_RESPONSE])
        done = recorder.execute("acme", "agent-7", "send_email", {"n": 1}, operation_id=op_id)
    assert done.state is X.UNKNOWN and "contact lost" in (done.error or "")
    assert provider.stats().side_effects == 1, "the effect happened; nothing retried it"
    with psycopg.connect(isolated.dsn) as conn:
        expired = conn.execute(
            "SELECT expires_at <= now() FROM operation_leases WHERE operation_id = %s", (op_id,)
        ).fetchone()
    assert expired == (True,), "released for the recovery worker"


def test_policy_refusal_fails_the_intent_without_a_call(isolated: Settings) -> None:
    provider = _provider()
    seen: list[PolicyRequest] = []

    def refuse(request: PolicyRequest) -> PolicyDecision:
        seen.append(request)
        return PolicyDecision(False, "the grant was revoked", "ev_01JABCDEFGHJKMNPQRSTVWXYZ0")

    with _recorder(isolated, providers=[provider]) as recorder:
        recorder.collaborators.policy = refuse
        done = recorder.execute("acme", "agent-7", "send_email", {"n": 2})
    assert done.refused and done.state is X.FAILED and done.attempt == 0
    assert "revoked" in (done.error or "") and "ev_01JABCDEFGHJKMNPQRSTVWXYZ0" in (done.error or "")
    assert provider.stats().calls == 0
    assert [(r.tenant_id, r.actor_id, r.tool_name) for r in seen] == [
        ("acme", "agent-7", "send_email")
    ]


def test_an_unknown_tool_is_a_clear_error_and_writes_nothing(isolated: Settings) -> None:
    with _recorder(isolated, providers=[_provider()]) as recorder:
        before = end_offsets(isolated, [isolated.execution_topic])
        with pytest.raises(UnknownToolError, match="charge_card"):
            recorder.execute("acme", "agent-7", "charge_card", {"n": 1})
    assert end_offsets(isolated, [isolated.execution_topic]) == before
    with psycopg.connect(isolated.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM operation_leases").fetchone() == (0,)


def test_load_reads_the_tail_the_projector_has_not_folded(isolated: Settings) -> None:
    with _recorder(isolated) as recorder:
        op = recorder.intent("acme", "agent-7", "send_email", {"n": 3})
        project_in_process(isolated)  # the intent is projected...
        recorder.dispatched(op, provider_ref=op.operation_id)  # ...the dispatch is not
        loaded = recorder.load(op.operation_id, "acme")
        assert loaded.execution is not None and loaded.execution.state is X.DISPATCHED
        assert loaded.lease is None, "load is read-only"
        with pytest.raises(Exception, match="no operation"):
            recorder.load(op.operation_id, "globex")  # another tenant's reads as unknown


def test_two_owners_race_and_the_provider_sees_one_call_per_operation(
    isolated: Settings,
) -> None:
    provider = _provider()
    ops = []
    with _recorder(isolated, owner="gone") as gone:
        for n in range(20):
            ops.append(
                gone.intent("acme", "agent-7", "send_email", {"n": n}, lease_ttl=timedelta(0))
            )
        # The first owner went quiet: its leases expired at once. It can no longer append.
        with pytest.raises(LeaseLostError):
            gone.dispatched(ops[0], provider_ref=ops[0].operation_id)
    winners: dict[str, list[str]] = {"a": [], "b": []}

    def race(name: str) -> None:
        with _recorder(isolated, providers=[provider], owner=name) as me:
            for op in ops:
                try:
                    handle = me.take_over(op.operation_id, "acme", reason="owner gone")
                except LeaseLostError:
                    continue  # the other holds it
                except IllegalTransitionError as exc:
                    assert "already finished" in str(exc)  # the other finished it first
                    continue
                me.resume(handle)
                winners[name].append(op.operation_id)

    threads = [threading.Thread(target=race, args=(n,)) for n in winners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    taken = winners["a"] + winners["b"]
    assert sorted(taken) == sorted(op.operation_id for op in ops), "each taken over once"
    stats = provider.stats()
    assert stats.calls == len(ops) and stats.max_side_effects_per_key == 1
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        states = conn.execute(
            "SELECT execution_state, count(*), min(lease_token) FROM agent_operations GROUP BY 1"
        ).fetchall()
        anomalies = conn.execute("SELECT count(*) FROM anomalies").fetchone()
    assert states == [("SUCCEEDED", len(ops), 2)]
    assert anomalies == (0,)


def test_a_zombie_writing_after_a_take_over_is_fenced(isolated: Settings) -> None:
    with _recorder(isolated, owner="zombie") as zombie:
        op = zombie.intent("acme", "agent-7", "send_email", {"n": 9}, lease_ttl=timedelta(0))
    with _recorder(isolated, owner="new") as new:
        handle = new.take_over(op.operation_id, "acme", reason="owner gone")
        assert handle.lease is not None and handle.lease.token == 2
        # The zombie, paused past its lease, wakes and writes without checking: fenced.
        assert op.execution is not None
        stale = ExecutionTransitioned(
            event_id=event_id(int(time.time() * 1000), b"zombie-ev1"),
            operation_id=op.operation_id,
            tenant_id="acme",
            actor_id="agent-7",
            occurred_at=datetime.now(UTC),
            attempt=1,
            state=X.DISPATCHED,
            tool_name=op.execution.tool_name,
            request_hash=op.execution.request_hash,
            lease_token=1,
        )
        new.collaborators.transport.send([new.collaborators.planner.outgoing(stale)])
        new.dispatched(handle, provider_ref=op.operation_id)
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        kinds = conn.execute("SELECT kind, reason FROM anomalies").fetchall()
        row = conn.execute(
            "SELECT execution_state, attempt, lease_token FROM agent_operations"
        ).fetchone()
    assert [k for k, _ in kinds] == ["fenced"]
    assert row == ("DISPATCHED", 1, 2), "the new owner's dispatch, not the zombie's"


def test_a_rival_version_of_a_recorded_step_is_a_conflict_with_both_kept(
    isolated: Settings,
) -> None:
    provider = _provider()
    with _recorder(isolated, providers=[provider]) as recorder:
        done = recorder.execute("acme", "agent-7", "send_email", {"n": 5})
        first = _executions(isolated)[-1]
        rival = first.model_copy(
            update={
                "event_id": event_id(int(time.time() * 1000), b"rival-ev-1"),
                "result_ref": "sha256:" + "ab" * 32,
            }
        )
        recorder.collaborators.transport.send([recorder.collaborators.planner.outgoing(rival)])
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        anomaly = conn.execute("SELECT kind, event->>'event_id', reason FROM anomalies").fetchone()
        applied = conn.execute(
            "SELECT event_id FROM operation_history "
            "WHERE state = 'SUCCEEDED' AND outcome = 'applied'"
        ).fetchall()
        row = conn.execute("SELECT result_ref FROM agent_operations").fetchone()
    assert anomaly is not None and anomaly[0] == "conflict" and anomaly[1] == rival.event_id
    assert first.event_id in anomaly[2]
    assert applied == [(first.event_id,)]
    assert row == (done.result_ref,)


def test_cancel_before_dispatch_is_final_and_another_tenant_cannot_cancel(
    isolated: Settings,
) -> None:
    provider = _provider()
    with _recorder(isolated, providers=[provider]) as service:
        op = service.intent("acme", "agent-7", "send_email", {"n": 11})
    with _recorder(isolated, owner="operator") as operator:
        before = end_offsets(isolated, [isolated.execution_topic])
        with pytest.raises(IllegalTransitionError, match="no operation"):
            operator.cancel(op.operation_id, "globex", "mallory", "not yours")
        assert end_offsets(isolated, [isolated.execution_topic]) == before, "nothing written"
        cancelled = operator.cancel(op.operation_id, "acme", "alice", "customer changed mind")
    assert cancelled.execution is not None
    assert (cancelled.execution.state, cancelled.execution.attempt) == (X.FAILED, 0)
    # Finished: nobody can take it over and dispatch it any more.
    with (
        pytest.raises(IllegalTransitionError, match="already finished"),
        _recorder(isolated, providers=[provider], owner="late") as late,
    ):
        late.take_over(op.operation_id, "acme", reason="try anyway")
    assert provider.stats().calls == 0
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        row = conn.execute(
            "SELECT execution_state, decision, error FROM agent_operations"
        ).fetchone()
        anomalies = conn.execute("SELECT count(*) FROM anomalies").fetchone()
    assert row is not None and row[:2] == ("FAILED", "CANCEL") and "alice" in row[2]
    assert anomalies == (0,)


def test_cancel_after_dispatch_keeps_the_operation_for_reconciliation(
    isolated: Settings,
) -> None:
    with _recorder(isolated) as service:
        op = service.intent("acme", "agent-7", "send_email", {"n": 12})
        service.dispatched(op, provider_ref=op.operation_id)
        cancelled = service.cancel(op.operation_id, "acme", "alice", "stop it")
    assert cancelled.execution is not None
    assert cancelled.execution.state is X.DISPATCHED and cancelled.execution.cancelled
