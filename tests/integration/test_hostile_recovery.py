"""The recovery and policy control plane as a hostile tenant, a careless operator or a misbehaving
provider would attack it, against the real broker and database.

Each test is one attack: a provider that answers garbage, never answers, or answers with a huge
hostile text; a tenant squatting another tenant's lease; a lease token at the ceiling; an operator
typing an identifier the log refuses or a duration past the calendar; records the policy fold or
the worker's history read must dead-letter or skip. The worker is driven in-process, one pass at
a time, on a thread with a deadline: a pass that never ends is a failure, not a hung test run.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import (
    EARLIEST,
    LATEST,
    ExecutionTransitioned,
    PolicyChanged,
    ReconciliationDecided,
)
from ledger.domain.ids import event_id, operation_id, request_hash
from ledger.domain.policy import (
    PolicyChange,
    PolicyDecision,
    PolicyRequest,
    Purpose,
    grant_key,
)
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.history import HistoryReader
from ledger.leases import LeaseStore
from ledger.log import KafkaTransport, end_offsets
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyStore
from ledger.results import ResultStore
from ledger.secrets import RedactingFilter
from ledger.settings import Settings
from ledger.tools import LookupResult, ProviderTerms
from opledger.fakes.memory import MemoryProvider
from opledger.fakes.model import Mode
from processors.recovery.worker import RecoveryWorker
from producers import TrackedOperation, TransitionRecorder
from tests.support import env_for, produce_raw, project_in_process, read_all, signed

X = ExecutionState
TOOL = "send_email"
OTHER_TOOL = "charge_card"
GRANT = event_id(1_700_000_000_000, b"the-grant!")
#: The lease an abandoned service held (as in test_recovery: its steps must fit in it).
ABANDONED_LEASE_S = 3.0
#: The longest one pass may take here: far more than any honest pass of a few operations.
PASS_DEADLINE_S = 20.0


def _terms(**changes: Any) -> ProviderTerms:
    values: dict[str, Any] = {
        "call_timeout": timedelta(milliseconds=200),
        "key_retention": timedelta(hours=1),
        "repeat_safe": True,
    }
    values.update(changes)
    return ProviderTerms(**values)


def _allow(requests: Sequence[PolicyRequest]) -> list[PolicyDecision]:
    return [
        PolicyDecision(False, "the operation was cancelled", None)
        if r.cancelled
        else PolicyDecision(True, "allowed by the test grant", GRANT)
        for r in requests
    ]


class Rig:
    """A recovery worker over the given providers, and a service that leaves operations behind
    (its lease runs out at once)."""

    def __init__(self, settings: Settings, providers: Sequence[Any]) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.pool = open_pool(settings.dsn, name="test-hostile-recovery")
        self.transport = KafkaTransport(settings)
        self.history = HistoryReader(settings, self.pool)
        self.worker = RecoveryWorker(
            settings,
            pool=self.pool,
            transport=self.transport,
            leases=LeaseStore(self.pool, "test-hostile-recovery"),
            history=self.history,
            results=ResultStore(self.pool),
            policy=_allow,
            providers=providers,
            metrics=Metrics.create(self.registry),
        )
        self.service = TransitionRecorder.connect(settings, owner="dead-service")
        self._hung = False

    def close(self) -> None:
        self.service.close()
        if self._hung:  # a pass still runs on its thread: leave its clients to the process
            return
        self.worker.close()
        self.history.close()
        self.transport.close()
        self.pool.close()

    def abandoned(
        self, tool: str = TOOL, *, unknown: bool = True, tenant: str = "acme"
    ) -> TrackedOperation:
        op = self.service.intent(
            tenant, "agent-7", tool, {"to": "a@example.com", "t": time.time_ns()},
            lease_ttl=timedelta(seconds=ABANDONED_LEASE_S),
        )  # fmt: skip
        if unknown:
            self.service.dispatched(op, provider_ref=op.operation_id)
            self.service.unknown(op, "connection reset")
        return op

    def one_pass(self, deadline_s: float = PASS_DEADLINE_S) -> tuple[int, float]:
        """One worker pass on every partition, on a thread: (handled, seconds it took). Fails,
        rather than hangs, when the pass does not end within ``deadline_s``."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["handled"] = self.worker.run_once(range(self.settings.partitions))
            except BaseException as exc:  # re-raised on the test's thread
                outcome["error"] = exc

        started = time.monotonic()
        thread = threading.Thread(target=run, name="hostile-pass", daemon=True)
        thread.start()
        thread.join(deadline_s)
        took = time.monotonic() - started
        if thread.is_alive():
            self._hung = True
            raise AssertionError(f"the recovery pass did not end within {deadline_s}s: wedged")
        if "error" in outcome:
            raise outcome["error"]
        return int(outcome["handled"]), took

    def recover(self, passes: int = 1, deadline_s: float = PASS_DEADLINE_S) -> list[float]:
        time.sleep(ABANDONED_LEASE_S + 0.1)  # the dead service's lease runs out
        project_in_process(self.settings)
        took = [self.one_pass(deadline_s)[1] for _ in range(passes)]
        project_in_process(self.settings)
        return took

    def row(self, op: TrackedOperation | str) -> tuple[Any, ...]:
        op_id = op if isinstance(op, str) else op.operation_id
        with psycopg.connect(self.settings.dsn) as conn:
            row = conn.execute(
                "SELECT execution_state, attempt, parked, decision, error "
                "FROM agent_operations WHERE operation_id = %s",
                (op_id,),
            ).fetchone()
        assert row is not None
        return tuple(row)

    def decisions(self, op: TrackedOperation | str) -> list[ReconciliationDecided]:
        op_id = op if isinstance(op, str) else op.operation_id
        codec = default_codec()
        events = [
            codec.decode(v or b"")
            for _p, _o, k, v in read_all(self.settings, self.settings.execution_topic)
            if k == op_id.encode()
        ]
        return [e for e in events if isinstance(e, ReconciliationDecided)]


@pytest.fixture
def healthy(isolated: Settings) -> MemoryProvider:
    return MemoryProvider(OTHER_TOOL, _terms(), mode=Mode.NON_IDEMPOTENT)


# -- question 3: a provider misbehaving for one operation ------------------------------------------


class _BatchAnsweringGarbage(MemoryProvider):
    """A provider with a batch lookup (``BatchLookup``) that answers one key with something that
    is not a ``LookupResult`` at all, and the others as the memory provider would."""

    def __init__(self, *args: Any, garbage_for: set[str], answer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.garbage_for = garbage_for
        self.answer = answer

    def lookup_many(
        self, requests: Sequence[tuple[str, str | None]]
    ) -> Iterator[tuple[int, LookupResult]]:
        for index, (key, ref) in enumerate(requests):
            if key in self.garbage_for:
                yield index, self.answer
            else:
                yield index, self.lookup(key, ref)


@pytest.mark.parametrize(
    "answer",
    [None, LookupResult("FOUND_SUCCEEDED", result=b"{}")],  # type: ignore[arg-type]
    ids=["none", "status-not-an-enum"],
)
def test_a_batch_lookup_answering_garbage_never_wedges_the_pass(
    isolated: Settings, answer: Any
) -> None:
    provider = _BatchAnsweringGarbage(TOOL, _terms(), garbage_for=set(), answer=answer)
    rig = Rig(isolated, [provider])
    try:
        poisoned, fine = rig.abandoned(), rig.abandoned()
        provider.garbage_for = {poisoned.operation_id}
        provider.call({"to": "a@example.com"}, fine.operation_id)  # its effect happened
        rig.recover(deadline_s=PASS_DEADLINE_S)
        # The other operation of the same batch is reconciled in that very pass.
        assert rig.row(fine)[:2] == ("SUCCEEDED", 1)
        # An answer nobody can read is "I cannot tell": retried later, never a call.
        assert rig.row(poisoned)[0] == "UNKNOWN"
        assert [d.decision for d in rig.decisions(poisoned)] == [Decision.RETRY_LOOKUP]
        assert provider.stats().calls == 1, "only the call the test made"
    finally:
        rig.close()


class _HangingLookups(MemoryProvider):
    """A provider whose lookup of some keys never returns (until the test lets it go)."""

    def __init__(self, *args: Any, batch: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hang_for: set[str] = set()
        self.released = threading.Event()
        self.asked: dict[str, int] = {}
        if batch:
            self.lookup_many = self._lookup_many

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        self.asked[idempotency_key] = self.asked.get(idempotency_key, 0) + 1
        if idempotency_key in self.hang_for:
            self.released.wait(300)
        return super().lookup(idempotency_key, provider_ref)

    def _lookup_many(
        self, requests: Sequence[tuple[str, str | None]]
    ) -> Iterator[tuple[int, LookupResult]]:
        # Answers in order, so a hanging key holds back every key after it in the batch.
        for index, (key, ref) in enumerate(requests):
            yield index, self.lookup(key, ref)


@pytest.mark.parametrize("batch", [False, True], ids=["lookup", "lookup_many"])
def test_a_lookup_that_never_returns_stalls_only_its_own_operation(
    isolated: Settings, healthy: MemoryProvider, batch: bool
) -> None:
    hanging = _HangingLookups(TOOL, _terms(), batch=batch)
    rig = Rig(isolated, [hanging, healthy])
    try:
        stuck = rig.abandoned(TOOL)
        other = rig.abandoned(OTHER_TOOL)
        healthy.call({"to": "a@example.com"}, other.operation_id)
        hanging.hang_for = {stuck.operation_id}
        took = rig.recover(passes=2, deadline_s=PASS_DEADLINE_S)
        assert max(took) < 10.0, f"each pass gives up on a silent lookup: {took}"
        assert rig.row(other)[:2] == ("SUCCEEDED", 1), "another tool's operation went on"
        assert rig.row(stuck)[0] == "UNKNOWN" and rig.decisions(stuck) == []
        assert hanging.asked[stuck.operation_id] == 1, "never asked again while still asking"
        # Once the provider answers at last, the operation is reconciled like any other.
        hanging.call({"to": "a@example.com"}, stuck.operation_id)
        hanging.hang_for = set()
        hanging.released.set()
        deadline = time.monotonic() + 30
        while rig.row(stuck)[0] == "UNKNOWN" and time.monotonic() < deadline:
            time.sleep(0.5)
            rig.one_pass()
            project_in_process(isolated)
        assert rig.row(stuck)[:2] == ("SUCCEEDED", 1)
        assert hanging.stats().calls == 1
    finally:
        hanging.released.set()
        rig.close()


class _HangingCalls(MemoryProvider):
    """A provider whose ``call`` for the keys in ``hang_for`` does not return until
    ``released`` is set (then makes the call, as a provider that answers late does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hang_for: set[str] = set()
        self.released = threading.Event()

    def call(self, request: Any, idempotency_key: str) -> Any:
        if idempotency_key in self.hang_for:
            self.released.wait(120)
        return super().call(request, idempotency_key)


def test_a_call_that_never_returns_stalls_only_its_own_operation(
    isolated: Settings, healthy: MemoryProvider
) -> None:
    """Two operations left at their intent by a dead service, resumed by the worker: one
    tool's call never returns. The pass waits for it no longer than the tool's call timeout
    (0.2 s): that operation is UNKNOWN ("no answer") and the other tool's goes on. When the
    late call lands at last, the lookup finds it: SUCCEEDED at attempt 1, one call."""
    hanging = _HangingCalls(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT)
    rig = Rig(isolated, [hanging, healthy])
    try:
        stuck = rig.abandoned(TOOL, unknown=False)
        other = rig.abandoned(OTHER_TOOL, unknown=False)
        hanging.hang_for = {stuck.operation_id}
        took = rig.recover(passes=1, deadline_s=PASS_DEADLINE_S)
        assert max(took) < 10.0, f"the pass gave up on the silent call: {took}"
        assert rig.row(other)[:2] == ("SUCCEEDED", 1), "another tool's operation went on"
        state, attempt, _parked, _decision, error = rig.row(stuck)
        assert (state, attempt) == ("UNKNOWN", 1)
        assert "no answer within 0.2s" in (error or "")
        hanging.released.set()
        deadline = time.monotonic() + 30
        while hanging.stats().calls == 0:  # the late call lands on the worker's call thread
            assert time.monotonic() < deadline, "the released call never landed"
            time.sleep(0.05)
        while rig.row(stuck)[0] == "UNKNOWN" and time.monotonic() < deadline:
            time.sleep(0.5)
            rig.one_pass()
            project_in_process(isolated)
        assert rig.row(stuck)[:2] == ("SUCCEEDED", 1), "the late call found by its lookup"
        assert hanging.stats().calls == 1
    finally:
        hanging.released.set()
        rig.close()


#: Tens of kilobytes shaped for the secret scanner's keyword detector, whose cost grows faster
#: than its input (10,000 characters took over 20 s whole).
HOSTILE = "aPwd" * 2500


class _HostileReasons(MemoryProvider):
    """Reports every call failed, with a huge hostile reason."""

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        super().lookup(idempotency_key, provider_ref)
        return LookupResult(
            LookupStatus.FOUND_FAILED, reason=f"declined {idempotency_key} {HOSTILE}"
        )


class _HostileExceptions(MemoryProvider):
    """A lookup that raises, with a huge hostile message (logged, and every log line of a worker
    is scrubbed by ``RedactingFilter``)."""

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        super().lookup(idempotency_key, provider_ref)
        raise RuntimeError(f"upstream said {idempotency_key} {HOSTILE}")


@pytest.mark.parametrize("how", ["reason", "raised"])
def test_a_huge_hostile_text_from_a_provider_is_cut_before_it_is_scrubbed(
    isolated: Settings, how: str
) -> None:
    provider = (_HostileReasons if how == "reason" else _HostileExceptions)(TOOL, _terms())
    rig = Rig(isolated, [provider])
    # As `opledger recover run` logs: every line scrubbed.
    handler = logging.StreamHandler(io.StringIO())
    handler.addFilter(RedactingFilter())
    logging.getLogger("opledger.recovery").addHandler(handler)
    try:
        ops = [rig.abandoned() for _ in range(2)]
        took = rig.recover(deadline_s=300)
        assert took[0] < 8.0, f"a pass took {took[0]:.1f}s over two provider answers"
        for op in ops:
            state, _attempt, _parked, decision, error = rig.row(op)
            if how == "reason":
                assert (state, decision) == ("FAILED", "MARK_FAILED")
                assert error.startswith(f"declined {op.operation_id}") and len(error) <= 1000
            else:  # "I cannot tell": retried later
                assert (state, decision) == ("UNKNOWN", "RETRY_LOOKUP")
    finally:
        logging.getLogger("opledger.recovery").removeHandler(handler)
        rig.close()


# -- questions 2 and 4: a tenant and a lease -------------------------------------------------


def _lease_less_unknown(settings: Settings, tenant: str = "acme") -> str:
    """An operation recorded by a writer without a lease store (``with_results=False``, a
    documented mode): intent, dispatch and UNKNOWN are in the log, no lease row exists."""
    with TransitionRecorder.connect(settings, with_results=False) as bare:
        op = bare.intent(tenant, "agent-7", TOOL, {"to": "a@example.com"})
        bare.dispatched(op, provider_ref=op.operation_id)
        bare.unknown(op, "connection reset")
    return op.operation_id


def test_another_tenant_cannot_squat_the_lease_of_an_operation_and_wedge_it(
    isolated: Settings,
) -> None:
    provider = MemoryProvider(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT)
    rig = Rig(isolated, [provider])
    try:
        victim = _lease_less_unknown(isolated)
        provider.call({"to": "a@example.com"}, victim)  # the effect happened
        project_in_process(isolated)
        # globex learns the id (it travels to destinations) and records an intent under it,
        # with a lease for a century.
        with TransitionRecorder.connect(isolated, owner="mallory") as mallory:
            mallory.intent(
                "globex", "agent-1", TOOL, {"x": 1}, operation_id=victim,
                lease_ttl=timedelta(days=36500),
            )  # fmt: skip
        project_in_process(isolated)
        with psycopg.connect(isolated.dsn) as conn:
            kinds = conn.execute("SELECT kind FROM anomalies").fetchall()
        assert kinds == [("foreign_tenant",)], "the projector refused globex's intent"
        rig.recover(passes=2)
        state, attempt, _parked, decision, _error = rig.row(victim)
        assert (state, attempt, decision) == ("SUCCEEDED", 1, "MARK_SUCCEEDED"), (
            "acme's operation is reconciled although globex holds a lease row on its id"
        )
        assert provider.stats().calls == 1
        # And globex's request was never used for acme's operation.
        with psycopg.connect(isolated.dsn) as conn:
            lease = conn.execute(
                "SELECT tenant_id FROM operation_leases WHERE operation_id = %s", (victim,)
            ).fetchone()
        assert lease == ("acme",)
    finally:
        rig.close()


def test_a_tenant_naming_itself_for_another_tenants_operation_takes_no_lease(
    isolated: Settings,
) -> None:
    """The other side of the squat's fix: a lease row of another tenant is taken back only
    where the projection says the operation is the caller's. globex asking, in its own name,
    for acme's operation whose live owner holds its lease (even with ``force``, as a cancel
    asks) takes nothing, and acme's row stays acme's, with its owner and token."""
    with TransitionRecorder.connect(isolated, owner="acme-service") as owner:
        op = owner.intent("acme", "agent-7", TOOL, {"to": "a@example.com"})
        owner.dispatched(op, provider_ref=op.operation_id)
    project_in_process(isolated)
    pool = open_pool(isolated.dsn, name="test-lease-naming", max_size=2)
    try:
        before = _lease_row(isolated, op.operation_id)
        assert before[0] == "acme" and str(before[1]).startswith("acme-service")
        mallory = LeaseStore(pool, "mallory")
        for force in (False, True):
            taken = mallory.take_over([(op.operation_id, "globex")], timedelta(days=1), force=force)
            assert taken == {}, "globex took acme's live lease by naming itself"
        assert _lease_row(isolated, op.operation_id) == before
        # acme's own forced take-over (a cancel) still works.
        assert op.operation_id in LeaseStore(pool, "acme-cancel").take_over(
            [(op.operation_id, "acme")], timedelta(seconds=30), force=True
        )
    finally:
        pool.close()


def _lease_row(settings: Settings, op_id: str) -> tuple[Any, ...]:
    with psycopg.connect(settings.dsn) as conn:
        row = conn.execute(
            "SELECT tenant_id, owner, token FROM operation_leases WHERE operation_id = %s",
            (op_id,),
        ).fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("token", [2**62, 2**63 - 1], ids=["event-ceiling", "bigint-max"])
def test_a_lease_token_at_the_ceiling_stops_only_its_own_operation(
    isolated: Settings, token: int
) -> None:
    provider = MemoryProvider(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT)
    rig = Rig(isolated, [provider])
    try:
        worn, fine = rig.abandoned(), rig.abandoned()
        provider.call({"to": "a@example.com"}, fine.operation_id)
        # A careless restore (or an operator's UPDATE) leaves a token no event can carry.
        with psycopg.connect(isolated.dsn) as conn:
            conn.execute(
                "UPDATE operation_leases SET token = %s WHERE operation_id = %s",
                (token, worn.operation_id),
            )
        rig.recover(passes=2)
        assert rig.row(fine)[:2] == ("SUCCEEDED", 1), "the other operation went on"
        assert rig.row(worn)[0] == "UNKNOWN" and rig.decisions(worn) == []
        with psycopg.connect(isolated.dsn) as conn:
            kept = conn.execute(
                "SELECT token FROM operation_leases WHERE operation_id = %s",
                (worn.operation_id,),
            ).fetchone()
        assert kept == (token,), "the token is never raised past what an event can carry"
    finally:
        rig.close()


def test_an_attempt_stamped_in_the_future_is_parked_never_attempted_again(
    isolated: Settings,
) -> None:
    """A writer whose clock runs two hours ahead: its UNKNOWN looks dispatched in the future,
    and its age (which alone says whether a not-found proves anything) cannot be told."""
    provider = MemoryProvider(TOOL, _terms(key_retention=timedelta(hours=1)))
    rig = Rig(isolated, [provider])
    ahead_ns = int(timedelta(hours=2).total_seconds() * 1e9)
    try:
        with TransitionRecorder.connect(
            isolated, owner="skewed", clock_ns=lambda: time.time_ns() + ahead_ns
        ) as skewed:
            op = skewed.intent(
                "acme", "agent-7", TOOL, {"to": "a@example.com"},
                lease_ttl=timedelta(seconds=ABANDONED_LEASE_S),
            )  # fmt: skip
            skewed.dispatched(op, provider_ref=op.operation_id)
            skewed.unknown(op, "connection reset")
        rig.recover(passes=2)
        state, attempt, parked, decision, _error = rig.row(op)
        assert (state, attempt, decision) == ("UNKNOWN", 1, "PARK")
        assert parked is not None and "ahead of this worker's clock" in parked
        assert provider.stats().calls == 0, "never attempted again on an age nobody can tell"
    finally:
        rig.close()


def _cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opledger.cli", *argv],
        env=env_for(settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "actor, reason",
    [
        ("Alice Smith", "customer asked"),  # a space: the log's identifiers refuse it
        ("alice", "x" * 1500),  # longer than any recorded reason
        ("alice", "password=Tr0ub4dor-and-3-more"),  # a secret pasted into the reason
    ],
    ids=["actor-with-a-space", "reason-too-long", "reason-with-a-secret"],
)
def test_a_cancel_the_log_would_refuse_takes_nothing_from_the_live_owner(
    isolated: Settings, actor: str, reason: str
) -> None:
    with TransitionRecorder.connect(isolated, owner="live-service") as live:
        op = live.intent("acme", "agent-7", TOOL, {"n": 1}, lease_ttl=timedelta(minutes=5))
        live.dispatched(op, provider_ref=op.operation_id)
        before = end_offsets(isolated, [isolated.execution_topic])
        with psycopg.connect(isolated.dsn) as conn:
            lease_before = conn.execute(
                "SELECT token, owner FROM operation_leases WHERE operation_id = %s",
                (op.operation_id,),
            ).fetchone()
        done = _cli(
            isolated, "ops", "cancel", op.operation_id, "--tenant", "acme",
            "--actor", actor, "--reason", reason,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert "nothing was recorded" in done.stderr
        assert "Tr0ub4dor" not in done.stderr + done.stdout, "the secret is not echoed back"
        assert end_offsets(isolated, [isolated.execution_topic]) == before, "nothing appended"
        with psycopg.connect(isolated.dsn) as conn:
            lease_after = conn.execute(
                "SELECT token, owner FROM operation_leases WHERE operation_id = %s",
                (op.operation_id,),
            ).fetchone()
        assert lease_after == lease_before, "the live owner keeps its lease"
        assert live.collaborators.leases is not None and op.lease is not None
        assert live.collaborators.leases.holds(op.lease)


@pytest.mark.parametrize(
    "argv",
    [
        ["ops", "list", "--tenant", "acme", "--older-than", "99999999999w"],
        ["ops", "list", "--tenant", "acme", "--older-than", "999999999d"],
        [
            "policy",
            "grant",
            "--tenant",
            "acme",
            "--actor",
            "a",
            "--tool",
            "t",
            "--expires",
            "999999999w",
            "--no-wait",
        ],
        [
            "policy",
            "grant",
            "--tenant",
            "acme",
            "--actor",
            "a",
            "--tool",
            "t",
            "--credential",
            "c",
            "--credential-expires",
            "99999999999d",
            "--no-wait",
        ],
    ],
    ids=["older-than-overflows-python", "older-than-overflows-postgres", "expires", "cred"],
)
def test_a_duration_past_the_calendar_is_refused_as_bad_input(
    isolated: Settings, argv: list[str]
) -> None:
    before = end_offsets(isolated, [isolated.policy_topic])
    done = _cli(isolated, *argv)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert end_offsets(isolated, [isolated.policy_topic]) == before, "nothing written"


def test_another_tenants_cli_reads_and_cancels_see_nothing_and_name_nobody(
    isolated: Settings,
) -> None:
    """Sound (no finding): kept as a regression test for question 2."""
    with TransitionRecorder.connect(isolated, owner="acme-service") as service:
        op = service.intent("acme", "agent-7", TOOL, {"n": 2}, lease_ttl=timedelta(minutes=5))
    project_in_process(isolated)
    before = end_offsets(isolated, [isolated.execution_topic])
    outputs = [
        _cli(isolated, "ops", "show", op.operation_id, "--tenant", "globex"),
        _cli(isolated, "ops", "list", "--tenant", "globex"),
        _cli(isolated, "policy", "show", "--tenant", "globex"),
        _cli(
            isolated,
            "ops",
            "cancel",
            op.operation_id,
            "--tenant",
            "globex",
            "--actor",
            "mallory",
            "--reason",
            "not mine",
        ),
    ]
    for done in outputs:
        assert "acme" not in done.stdout + done.stderr
        assert "agent-7" not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    assert outputs[0].returncode == 2 and outputs[3].returncode == 2
    assert end_offsets(isolated, [isolated.execution_topic]) == before


# -- question 1: one record on a topic the worker or the policy fold reads -------------------------


def test_hostile_policy_records_are_dead_lettered_or_folded_and_the_fold_goes_on(
    isolated: Settings,
) -> None:
    """Sound (no finding): every hostile policy record is either refused at the edge (dead
    letter with a reason) or a valid change folded as written; the projector keeps going."""
    codec = default_codec()
    now = datetime.now(UTC)
    seq = iter(range(1, 1000))

    def change(**fields: Any) -> PolicyChanged:
        values: dict[str, Any] = {
            "event_id": event_id(int(now.timestamp() * 1000), next(seq).to_bytes(10, "big")),
            "tenant_id": "acme",
            "actor_id": "test:ops",
            "occurred_at": now,
            "change": PolicyChange.GRANT,
            "principal": "agent-7",
            "tool_name": TOOL,
        }
        values.update(fields)
        return PolicyChanged(**values)

    def unchecked(**fields: Any) -> bytes:
        # What a hostile writer puts on the wire: the schema's shape, none of the model's rules.
        name, datum = codec.decode_datum(codec.encode(change()))
        datum.update(fields)
        return codec.encode_datum(name, datum)

    hostile: list[tuple[bytes | None, bytes | None]] = [
        (grant_key("acme", "agent-7", TOOL), unchecked(reason="declined\x00")),
        (grant_key("acme", "agent-7", TOOL), unchecked(tenant_id="a" * 100_000)),
        (grant_key("acme", "agent-7", TOOL), unchecked(principal="agent 7")),
        # keyed as acme's grant, naming globex: refused, it would erase another subject
        (grant_key("acme", "agent-7", TOOL), unchecked(tenant_id="globex")),
    ]
    far = change(tool_name="far", expires_at=LATEST, repeat_safe=True)
    past = change(tool_name="past", expires_at=EARLIEST)
    for key, value in hostile:
        produce_raw(isolated, isolated.policy_topic, key, value)
    for good in (far, past):
        good_signed = signed(isolated, good)
        produce_raw(isolated, isolated.policy_topic, good.subject_key(), codec.encode(good_signed))
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        dead = conn.execute(
            'SELECT "offset", reason FROM dead_letters WHERE topic = %s ORDER BY 1',
            (isolated.policy_topic,),
        ).fetchall()
        grants = conn.execute(
            "SELECT tenant_id, tool_name, expires_at FROM policy_grants ORDER BY tool_name"
        ).fetchall()
    assert [o for o, _ in dead] == [0, 1, 2, 3] and all(r for _, r in dead)
    assert grants == [("acme", "far", LATEST), ("acme", "past", EARLIEST)]
    pool = open_pool(isolated.dsn, name="hostile-policy", max_size=2)
    try:
        store = PolicyStore(pool, isolated)

        def ask(tool: str, tenant: str = "acme") -> PolicyDecision:
            return store.evaluate(
                PolicyRequest(tenant, "agent-7", tool, Purpose.NEW_ATTEMPT, datetime.now(UTC))
            )

        assert ask("far").allowed
        assert not ask("past").allowed and "expired" in ask("past").reason
        assert not ask("far", tenant="globex").allowed
    finally:
        pool.close()


def test_a_mis_keyed_record_in_the_unprojected_tail_neither_crashes_nor_is_folded(
    isolated: Settings,
) -> None:
    """A record keyed by one operation but carrying another's event, not yet projected: the
    history read folded tail records by the id inside the event, so the pass crashed on a
    KeyError (or folded it into the other operation, had it been a candidate too). The
    projector dead-letters such a record ("record key is not the event's operation_id"); the
    history read now skips it the same way."""
    provider = MemoryProvider(TOOL, _terms(), mode=Mode.NON_IDEMPOTENT)
    rig = Rig(isolated, [provider])
    try:
        op = rig.abandoned()
        provider.call({"to": "a@example.com"}, op.operation_id)
        time.sleep(ABANDONED_LEASE_S + 0.1)
        project_in_process(isolated)
        # After the projector's offsets: a record keyed by op, carrying another operation's
        # event (an id no candidate has). The projector would dead-letter it; it is not
        # projected before the pass.
        stray = ExecutionTransitioned(
            event_id=event_id(int(time.time() * 1000), b"stray-rec!"),
            operation_id=operation_id(int(time.time() * 1000), b"not-the-op"),
            tenant_id="acme",
            actor_id="agent-7",
            occurred_at=datetime.now(UTC),
            attempt=0,
            state=X.INTENT_RECORDED,
            tool_name=TOOL,
            request_hash=request_hash(TOOL, {"n": 1}),
        )
        produce_raw(
            isolated,
            isolated.execution_topic,
            op.operation_id.encode(),
            default_codec().encode(stray),
        )
        # (the stray lands on op's partition: same key, same murmur2 partition)
        handled, _took = rig.one_pass()
        assert handled == 1
        project_in_process(isolated)
        assert rig.row(op)[:2] == ("SUCCEEDED", 1)
    finally:
        rig.close()
