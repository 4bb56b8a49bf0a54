"""The recovery worker's rules against the real broker and database, one pass at a time (the
worker is driven in-process here; the chaos tier runs it as a process and SIGKILLs services)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned, OwnershipTaken, ReconciliationDecided
from ledger.domain.ids import event_id
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.history import HistoryReader
from ledger.leases import LeaseStore
from ledger.log import KafkaTransport
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyFreshness
from ledger.results import MAX_RESULT_BYTES, ResultStore
from ledger.settings import Settings
from ledger.tools import LookupResult, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Action, Mode
from processors.recovery.worker import RecoveryWorker
from producers import TrackedOperation, TransitionRecorder
from tests.support import assert_no_identifying_labels, grant, project_in_process, read_all

X = ExecutionState
TOOL = "send_email"
GRANT = event_id(1_700_000_000_000, b"the-grant!")
REVOCATION = event_id(1_700_000_000_001, b"revocation")


class Policy:
    """A switchable policy: allows (with repeats) until revoked; records what it was asked."""

    def __init__(self) -> None:
        self.revoked = False
        self.asked: list[PolicyRequest] = []

    def __call__(self, request: PolicyRequest) -> PolicyDecision:
        self.asked.append(request)
        if request.cancelled:
            return PolicyDecision(False, "the operation was cancelled", None)
        if self.revoked:
            return PolicyDecision(False, "the grant was revoked", REVOCATION)
        return PolicyDecision(True, "allowed by the test grant", GRANT)

    def many(self, requests: Sequence[PolicyRequest]) -> list[PolicyDecision]:
        """As the worker asks: a pass's requests at once."""
        return [self(request) for request in requests]


def _terms(**changes: Any) -> ProviderTerms:
    values: dict[str, Any] = {
        "call_timeout": timedelta(milliseconds=200),
        "key_retention": timedelta(hours=1),
        "repeat_safe": True,
    }
    values.update(changes)
    return ProviderTerms(**values)


#: The lease an abandoned service held. Its intent, dispatch and UNKNOWN must fit in it (the SDK
#: refuses to write under a lease it may have lost): 1 s did not, once, with three test
#: processes on 2 cores.
ABANDONED_LEASE_S = 3.0


class Rig:
    """A worker, the provider it calls, and a way to leave operations behind as a dead service
    would (its lease expires at once)."""

    def __init__(self, settings: Settings, provider: MemoryProvider) -> None:
        self.settings = settings
        self.provider = provider
        self.policy = Policy()
        self.registry = CollectorRegistry()
        self.pool = open_pool(settings.dsn, name="test-recovery")
        self.transport = KafkaTransport(settings)
        self.history = HistoryReader(settings, self.pool)
        self.worker = RecoveryWorker(
            settings,
            pool=self.pool,
            transport=self.transport,
            leases=LeaseStore(self.pool, "test-recovery"),
            history=self.history,
            results=ResultStore(self.pool),
            policy=self.policy.many,
            providers=[provider],
            metrics=Metrics.create(self.registry),
        )
        self.service = TransitionRecorder.connect(settings, owner="dead-service")

    def close(self) -> None:
        self.service.close()
        self.worker.close()
        self.history.close()
        self.transport.close()
        self.pool.close()
        assert assert_no_identifying_labels(self.registry) > 0

    def abandoned(self, *, dispatched: bool = False, unknown: bool = False) -> TrackedOperation:
        op = self.service.intent(
            "acme", "agent-7", TOOL, {"to": "a@example.com", "t": time.time_ns()},
            lease_ttl=timedelta(seconds=ABANDONED_LEASE_S),
        )  # fmt: skip
        if dispatched or unknown:
            self.service.dispatched(op, provider_ref=op.operation_id)
        if unknown:
            self.service.unknown(op, "connection reset")
        return op

    def recover(self, passes: int = 1) -> None:
        time.sleep(ABANDONED_LEASE_S + 0.1)  # the dead service's lease runs out
        project_in_process(self.settings)
        for _ in range(passes):
            self.worker.run_once(range(self.settings.partitions))
        project_in_process(self.settings)

    def row(self, op: TrackedOperation) -> tuple[Any, ...]:
        with psycopg.connect(self.settings.dsn) as conn:
            row = conn.execute(
                "SELECT execution_state, attempt, parked, decision, result_ref "
                "FROM agent_operations WHERE operation_id = %s",
                (op.operation_id,),
            ).fetchone()
        assert row is not None
        return tuple(row)

    def events(self, op: TrackedOperation) -> list[Any]:
        codec = default_codec()
        return [
            codec.decode(v or b"")
            for _p, _o, k, v in read_all(self.settings, self.settings.execution_topic)
            if k == op.operation_id.encode()
        ]

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture
def rig(isolated: Settings) -> Iterator[Rig]:
    built = Rig(isolated, MemoryProvider(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT))
    try:
        yield built
    finally:
        built.close()


def _shape(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, ExecutionTransitioned):
            out.append(f"{e.state}#{e.attempt}")
        elif isinstance(e, OwnershipTaken):
            out.append(f"OWNER#{e.lease_token}")
        elif isinstance(e, ReconciliationDecided):
            out.append(f"{e.decision}:{e.lookup}")
    return out


def test_an_intent_whose_owner_went_away_is_dispatched_once(rig: Rig) -> None:
    op = rig.abandoned()
    rig.recover(passes=2)  # a second pass finds nothing left to do
    assert rig.row(op)[:2] == ("SUCCEEDED", 1)
    assert rig.provider.stats().calls == 1
    assert _shape(rig.events(op)) == [
        "INTENT_RECORDED#0",
        "OWNER#2",
        "RESUME:NOT_LOOKED_UP",
        "DISPATCHED#1",
        "SUCCEEDED#1",
    ]
    assert rig.sample("opledger_resumed_intents_total", {"outcome": "succeeded"}) == 1


def test_a_dispatch_without_an_owner_becomes_unknown_then_is_reconciled(rig: Rig) -> None:
    op = rig.abandoned(dispatched=True)
    # The dead service called the provider before it died: the effect happened.
    rig.provider.call({"to": "a@example.com"}, op.operation_id)
    rig.recover()
    state, attempt, _parked, decision, result_ref = rig.row(op)
    assert (state, attempt, decision) == ("SUCCEEDED", 1, "MARK_SUCCEEDED")
    assert result_ref is not None
    assert rig.provider.stats().calls == 1, "reconciled by lookup: no second call"
    shape = _shape(rig.events(op))
    assert shape[-3:] == ["UNKNOWN#1", "MARK_SUCCEEDED:FOUND_SUCCEEDED", "SUCCEEDED#1"]
    assert rig.sample("opledger_detector_transitions_total") == 1
    assert rig.sample("opledger_reconciliations_total", {"outcome": "succeeded"}) == 1
    lookups = {"tool": TOOL, "result": "FOUND_SUCCEEDED"}
    assert rig.sample("opledger_provider_lookups_total", lookups) == 1
    with ResultStore.connect(rig.settings.dsn) as store:
        assert store.get("acme", result_ref) is not None, "the recovered result is stored"


def test_a_confirmed_failure_found_by_lookup_is_recorded_failed(rig: Rig) -> None:
    op = rig.abandoned(unknown=True)
    rig.provider.script(op.operation_id, [Action.FAIL])
    rig.provider.call({"to": "a@example.com"}, op.operation_id)
    rig.recover()
    assert rig.row(op)[:2] == ("FAILED", 1)
    assert rig.provider.stats().calls == 1
    assert rig.sample("opledger_reconciliations_total", {"outcome": "failed"}) == 1
    lookups = {"tool": TOOL, "result": "FOUND_FAILED"}
    assert rig.sample("opledger_provider_lookups_total", lookups) == 1


class _UnstorableReasons(MemoryProvider):
    """Reports every call failed, in words no store can hold (NUL, a lone surrogate), under an
    id the contract refuses (spaces)."""

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        super().lookup(idempotency_key, provider_ref)  # counted as the provider's lookup
        return LookupResult(
            LookupStatus.FOUND_FAILED,
            reason="card\x00declined \ud800!",
            provider_ref="an id an event cannot carry",
        )


def test_a_provider_answer_no_event_can_carry_as_is_is_recorded_storably(
    isolated: Settings,
) -> None:
    rig = Rig(isolated, _UnstorableReasons(TOOL, _terms()))
    try:
        op = rig.abandoned(unknown=True)
        rig.recover()
        assert rig.row(op)[:2] == ("FAILED", 1)
        failed = [e for e in rig.events(op) if isinstance(e, ExecutionTransitioned)][-1]
        assert failed.error == "card\ufffddeclined \ufffd!"
    finally:
        rig.close()


class _HugeResults(MemoryProvider):
    """Confirms every call succeeded, with a result larger than the result store takes."""

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        super().lookup(idempotency_key, provider_ref)
        return LookupResult(LookupStatus.FOUND_SUCCEEDED, result=b"x" * (MAX_RESULT_BYTES + 1))


def test_a_confirmed_success_whose_result_cannot_be_stored_is_parked(isolated: Settings) -> None:
    rig = Rig(isolated, _HugeResults(TOOL, _terms()))
    try:
        op = rig.abandoned(unknown=True)
        rig.recover(passes=2)  # the second finds it parked and leaves it
        state, _attempt, parked, decision, _ref = rig.row(op)
        assert (state, decision) == ("UNKNOWN", "PARK")
        assert parked is not None and "over the result store's limit" in parked
        decided = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)]
        assert len(decided) == 1 and "over the result store's limit" in decided[0].reason
        assert rig.provider.stats().calls == 0, "never called again"
        assert rig.sample("opledger_reconciliations_total", {"outcome": "parked"}) == 1
    finally:
        rig.close()


def test_not_found_with_policy_allowing_a_repeat_makes_one_new_attempt(rig: Rig) -> None:
    op = rig.abandoned(unknown=True)  # dispatched, but the call never reached the provider
    rig.recover(passes=2)
    assert rig.row(op)[:2] == ("SUCCEEDED", 2)
    stats = rig.provider.stats()
    assert stats.calls == 1 and stats.received_keys == (op.operation_id,), "same key"
    decisions = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)]
    dispatches = [
        e for e in rig.events(op) if isinstance(e, ExecutionTransitioned) and e.attempt == 2
    ]
    assert [d.decision for d in decisions] == [Decision.NEW_ATTEMPT]
    assert decisions[0].policy_allowed and decisions[0].policy_version
    assert decisions[0].provider_repeat_safe is True, "the provider's terms are evidence too"
    assert dispatches[0].decision_id == decisions[0].event_id, "the dispatch cites its evidence"
    assert rig.policy.asked[-1].purpose is Purpose.NEW_ATTEMPT
    assert rig.sample("opledger_reconciliations_total", {"outcome": "new_attempt"}) == 1
    lookups = {"tool": TOOL, "result": "NOT_FOUND"}
    assert rig.sample("opledger_provider_lookups_total", lookups) == 1


def test_a_tool_its_provider_declares_not_repeat_safe_is_parked_although_policy_allows(
    isolated: Settings,
) -> None:
    """The grant allows a repeat, the lookup finds nothing, but the provider's terms do not say
    a repeat under the same key is deduplicated: the call in flight could still land, so no new
    attempt; the decision records both facts, and a person decides (an outside soak saw 36 new
    attempts of such a tool, allowed by the grant alone)."""
    rig = Rig(isolated, MemoryProvider(TOOL, _terms(repeat_safe=False), mode=Mode.NON_IDEMPOTENT))
    try:
        op = rig.abandoned(unknown=True)
        rig.recover(passes=2)
        state, attempt, parked, decision, _ref = rig.row(op)
        assert (state, attempt, decision) == ("UNKNOWN", 1, "PARK")
        assert parked and "does not declare a repeat under the same key safe" in parked
        assert rig.provider.stats().calls == 0, "no new attempt"
        decisions = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)]
        assert [(d.decision, d.lookup) for d in decisions] == [
            (Decision.PARK, LookupStatus.NOT_FOUND)
        ]
        assert decisions[0].policy_allowed and decisions[0].policy_version == GRANT
        assert decisions[0].provider_repeat_safe is False
        assert rig.sample("opledger_reconciliations_total", {"outcome": "parked"}) == 1
    finally:
        rig.close()


def test_not_found_past_the_key_retention_is_parked_never_re_executed(isolated: Settings) -> None:
    rig = Rig(isolated, MemoryProvider(TOOL, _terms(key_retention=timedelta(0))))
    try:
        op = rig.abandoned(unknown=True)
        rig.recover(passes=2)
        state, _attempt, parked, decision, _ref = rig.row(op)
        assert (state, decision) == ("UNKNOWN", "PARK")
        assert parked and "retention" in parked
        assert rig.provider.stats().calls == 0
        assert rig.sample("opledger_reconciliations_total", {"outcome": "parked"}) == 1
    finally:
        rig.close()


def test_a_revoked_grant_refuses_a_new_attempt_and_keeps_the_history(rig: Rig) -> None:
    started = time.time()
    op = rig.abandoned(unknown=True)
    rig.policy.revoked = True
    rig.recover(passes=2)
    state, _attempt, parked, decision, _ref = rig.row(op)
    assert (state, decision) == ("UNKNOWN", "REFUSE") and parked and "revoked" in parked
    assert rig.provider.stats().calls == 0, "no new call"
    refused = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)][-1]
    assert refused.lookup is LookupStatus.NOT_FOUND and not refused.policy_allowed
    assert refused.policy_version == REVOCATION
    assert _shape(rig.events(op))[:3] == ["INTENT_RECORDED#0", "DISPATCHED#1", "UNKNOWN#1"]
    assert rig.sample("opledger_reconciliations_total", {"outcome": "refused"}) == 1
    lookups = {"tool": TOOL, "result": "NOT_FOUND"}
    assert rig.sample("opledger_provider_lookups_total", lookups) == 1
    # The parked-age gauge is refreshed every 5 s: wind that back and make one more pass (it
    # leaves the parked operation alone: nothing more is counted).
    rig.worker.parked._refreshed_at = 0.0
    rig.worker.run_once(range(rig.settings.partitions))
    assert rig.sample("opledger_reconciliations_total", {"outcome": "refused"}) == 1
    age = rig.sample("opledger_parked_oldest_age_seconds")
    assert 0 < age <= time.time() - started + 1, age


def test_a_found_success_is_recorded_even_when_policy_now_refuses(rig: Rig) -> None:
    op = rig.abandoned(unknown=True)
    rig.provider.call({"to": "a@example.com"}, op.operation_id)
    rig.policy.revoked = True
    rig.recover()
    assert rig.row(op)[:2] == ("SUCCEEDED", 1)
    decided = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)][-1]
    assert decided.decision is Decision.MARK_SUCCEEDED and not decided.policy_allowed
    assert "policy now refuses" in decided.reason
    assert rig.provider.stats().calls == 1


def test_an_unavailable_lookup_is_retried_later_never_answered_with_a_call(rig: Rig) -> None:
    op = rig.abandoned(unknown=True)
    rig.provider.configure(lookup_unavailable_rate=1.0)
    rig.recover(passes=3)
    assert rig.row(op)[:2] == ("UNKNOWN", 1)
    assert rig.provider.stats().calls == 0
    retries = [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)]
    assert [d.decision for d in retries] == [Decision.RETRY_LOOKUP], "recorded once"
    rig.provider.configure(lookup_unavailable_rate=0.0)
    rig.provider.call({"to": "a@example.com"}, op.operation_id)  # it did happen, after all
    time.sleep(1.2)  # the backoff
    rig.recover()
    assert rig.row(op)[:2] == ("SUCCEEDED", 1)
    assert rig.provider.stats().calls == 1


def test_a_live_owner_is_left_alone(rig: Rig) -> None:
    op = rig.service.intent("acme", "agent-7", TOOL, {"n": 1}, lease_ttl=timedelta(minutes=5))
    rig.service.dispatched(op, provider_ref=op.operation_id)
    time.sleep(0.3)  # longer than the call timeout, but the owner's lease is alive
    project_in_process(rig.settings)
    rig.worker.run_once(range(rig.settings.partitions))
    project_in_process(rig.settings)
    assert rig.row(op)[:2] == ("DISPATCHED", 1)
    assert len(rig.events(op)) == 2


def test_the_worker_refuses_to_act_on_an_operation_claimed_by_someone_else(rig: Rig) -> None:
    op = rig.abandoned()
    time.sleep(ABANDONED_LEASE_S + 0.1)
    project_in_process(rig.settings)
    # Another process takes it over first (and holds it): the worker finds nothing due.
    with TransitionRecorder.connect(rig.settings, owner="other") as other:
        other.take_over(op.operation_id, "acme", reason="mine", ttl=timedelta(minutes=1))
        project_in_process(rig.settings)
        rig.worker.run_once(range(rig.settings.partitions))
    assert rig.provider.stats().calls == 0
    assert datetime.now(UTC)  # (the op is the other's until its lease expires)


def test_a_cancelled_operation_is_reconciled_but_never_attempted_again(rig: Rig) -> None:
    op = rig.abandoned(unknown=True)
    time.sleep(ABANDONED_LEASE_S + 0.1)
    with TransitionRecorder.connect(rig.settings, owner="operator") as operator:
        operator.cancel(op.operation_id, "acme", "alice", "customer asked")
    rig.recover(passes=2)
    state, _attempt, parked, decision, _ref = rig.row(op)
    assert (state, decision) == ("UNKNOWN", "REFUSE") and parked and "cancelled" in parked
    assert rig.provider.stats().calls == 0


def test_a_policy_view_that_may_lack_a_change_holds_reconciliation(isolated: Settings) -> None:
    """Decision 022 for the recovery worker: while the projected policy lags its topic (a
    revocation may wait unfolded) an UNKNOWN operation is neither resumed nor attempted again,
    nor parked; once the view is current, the pass decides it under the policy of that moment."""
    quick = isolated.with_(policy_max_staleness_ms=300, policy_freshness_refresh_ms=50)
    rig = Rig(quick, MemoryProvider(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT))
    freshness = PolicyFreshness(quick)  # the worker's limits, to wait for what it will see
    try:
        op = rig.abandoned(unknown=True)
        time.sleep(ABANDONED_LEASE_S + 0.1)
        project_in_process(quick)
        grant(quick, "acme", actor="agent-7", tool=TOOL)  # on the topic, not folded
        deadline = time.monotonic() + 10
        while freshness.stale_reason() is None:
            assert time.monotonic() < deadline, "the view never went stale"
            time.sleep(0.02)
        for _ in range(3):
            rig.worker.run_once(range(quick.partitions))
        assert rig.provider.stats().calls == 0, "attempted again under a stale view"
        assert rig.policy.asked == [], "decided under a stale view"
        assert not [e for e in rig.events(op) if isinstance(e, ReconciliationDecided)]
        health = rig.worker.health.snapshot()
        assert health["status"] == "stalled", health  # /healthz 503, and why
        assert "1 operations held" in health["reason"] and "vouched" in health["reason"], health
        project_in_process(quick)
        deadline = time.monotonic() + 10
        while freshness.stale_reason() is not None:
            assert time.monotonic() < deadline, "the view never became current"
            time.sleep(0.02)
        rig.recover(passes=2)
        assert rig.row(op)[:2] == ("SUCCEEDED", 2)
        assert rig.worker.health.snapshot()["status"] == "ok"
        assert rig.provider.stats().calls == 1
        assert [e.decision for e in rig.events(op) if isinstance(e, ReconciliationDecided)] == [
            Decision.NEW_ATTEMPT
        ]
    finally:
        freshness.close()
        rig.close()
