"""The recovery worker: what happens to an operation whose owner went away (decision 006).

Every pass it looks, on the partitions its consumer group gave it, for operations that are not
finished and whose lease has expired, takes them over (new lease token, recorded first, history
read up to that record) and applies the seed's recovery rules:

- INTENT_RECORDED (the owner went away before dispatching, so no provider call happened):
  dispatch once, after a policy check, with the stored request (seed row 1);
- DISPATCHED longer ago than the tool's call timeout: record UNKNOWN, with the reason (the
  detector), and reconcile it;
- UNKNOWN: ask the provider by idempotency key, re-check policy, and decide
  (``ledger.domain.reconcile.decide``): record what the provider says happened (a recovered
  result is stored first, seed row 3), a new attempt only when policy explicitly allows it and the
  key is within the provider's retention, a parked or refused operation otherwise, and never a
  call while the provider cannot be asked.

Every decision is an event with its evidence (``ReconciliationDecided``), and the transition it
causes cites it. The worker reads its state from the projection and the unprojected tail
(``ledger.history``); it keeps nothing of its own but a short in-memory backoff per operation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg_pool import ConnectionPool

from ledger.call_rule import immediately, perform_call, run_now
from ledger.codec import Codec
from ledger.domain import ids
from ledger.domain.call import Judged, recordable_content_type
from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
    recordable_provider_ref,
    storable_text,
)
from ledger.domain.fold import Applied, ExecutionRecord, apply_control, apply_execution
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.reconcile import Decision, LookupStatus, Verdict, decide
from ledger.domain.states import ExecutionState
from ledger.entropy import entropy
from ledger.errors import RecordError
from ledger.history import HistoryError, HistoryReader, Snapshot, View
from ledger.leases import MAX_TOKEN, Lease, LeaseStore
from ledger.log import LogTopics, LogWriter, OutgoingRecord, Positions, Transport, new_consumer
from ledger.metrics import Metrics
from ledger.pg import DatabaseUnavailableError, retrying
from ledger.policy_store import PolicyFreshness, PolicyViewStaleError
from ledger.results import MAX_RESULT_BYTES, PreparedResult, ResultStore
from ledger.secrets import cut_tokens, scrub
from ledger.settings import Settings
from ledger.tools import CallOutcome, ContactLost, LookupResult, Provider
from processors.health import Health

log = logging.getLogger("opledger.recovery")

X = ExecutionState
#: Policy for a batch of requests, decisions in the same order (``PolicyStore.evaluate_many``).
PolicyCheck = Callable[[Sequence[PolicyRequest]], list[PolicyDecision]]

#: Operations handled per pass (a pass takes their leases in one statement).
BATCH = 500
#: Operations decided together as their lookups come back: policy is read once per subject for
#: each group, right before its decisions.
DECIDE_GROUP = 64
#: The lease a worker takes for an operation: long enough for a provider call and its record.
LEASE_MARGIN = timedelta(seconds=10)
#: Backoff of a lookup the provider could not answer: doubles from the first to the last.
LOOKUP_BACKOFF = (timedelta(seconds=1), timedelta(seconds=60))
#: A pass waits for lookup answers at most this long past the longest call timeout without any
#: answer coming; the lookups still out are then left for a later pass.
LOOKUP_GRACE = timedelta(seconds=2)
MAX_ERROR = 1000
#: How far ahead of this worker's clock an attempt may be stamped (writers' clocks differ a
#: little) before its age, on which a new attempt depends, is not believed.
CLOCK_SKEW_TOLERANCE = timedelta(seconds=60)

_CANDIDATES_SQL = """
SELECT o.operation_id, o.tenant_id, o.execution_state, o.tool_name, o.state_entered_at,
       o.attempt, l.token
  FROM agent_operations o
  LEFT JOIN operation_leases l ON l.operation_id = o.operation_id
 WHERE o.kafka_partition = ANY(%(partitions)s)
   AND o.execution_state IN ('INTENT_RECORDED', 'DISPATCHED', 'UNKNOWN')
   AND o.parked IS NULL
   -- a lease row of another tenant (an intent it recorded under this id, refused by the
   -- projector) owns nothing, whatever its expiry: LeaseStore.take_over gives it back
   AND (l.expires_at IS NULL OR l.expires_at <= now() OR l.tenant_id <> o.tenant_id)
 ORDER BY o.state_entered_at
 LIMIT %(limit)s
"""

_PARKED_AGE_SQL = """
SELECT COALESCE(extract(epoch FROM now() - min(decided_at)), 0)
  FROM agent_operations WHERE parked IS NOT NULL
"""


@runtime_checkable
class BatchLookup(Protocol):
    """A provider that can be asked about many idempotency keys at once: the worker then asks
    a pass's keys through it from one thread, instead of one pool thread per lookup."""

    tool_name: str

    def lookup_many(
        self, requests: Sequence[tuple[str, str | None]]
    ) -> Iterator[tuple[int, LookupResult]]:
        """``Provider.lookup`` for each ``(idempotency_key, provider_ref)``: yields ``(index
        in requests, answer)`` as the answers come, one per request; "I cannot tell" is
        ``UNAVAILABLE``, never an exception."""
        ...


@dataclass(frozen=True, slots=True)
class Candidate:
    operation_id: str
    tenant_id: str
    state: ExecutionState
    tool_name: str
    state_entered_at: datetime
    attempt: int
    #: the token of its lease row, if it has one
    lease_token: int | None = None


class RecoveryWorker:
    """One member of the recovery group; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool[Any],
        transport: Transport,
        leases: LeaseStore,
        history: HistoryReader,
        results: ResultStore,
        policy: PolicyCheck,
        providers: Iterable[Provider],
        metrics: Metrics,
        codec: Codec | None = None,
        threads: int = 32,
    ) -> None:
        self._settings = settings
        self._unleased_grace = timedelta(seconds=settings.recovery_unleased_grace_s)
        self._pool = pool
        self._leases = leases
        self._history = history
        self._results = results
        self._policy = policy
        self._policy_freshness = PolicyFreshness(settings)
        #: why this pass decided nothing for some operations (a stale policy view), if so
        self._held_for_policy: str | None = None
        self._providers = {p.tool_name: p for p in providers}
        self._batch_lookups = {
            name for name, p in self._providers.items() if isinstance(p, BatchLookup)
        }
        self._metrics = metrics
        self._log = LogWriter(transport, LogTopics.of(settings), "recovery", codec=codec)
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-recover")
        # Lookups have threads of their own: one a provider never answers holds its thread,
        # never one the pass needs for its calls.
        self._lookup_threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-lookup")
        # And calls theirs: a call is waited for at most its tool's call timeout, so one that
        # never returns holds its thread, never the pass (every other operation waits on it).
        self._call_threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-call")
        self._thread_count = threads
        #: operations whose lookup has not returned yet (perhaps from an earlier pass): not
        #: looked at again until it has, so a provider that hangs holds one thread per operation
        self._in_lookup: set[str] = set()
        self._lookup_lock = threading.Lock()
        self._stopping = threading.Event()
        self._consumer: Consumer | None = None
        self._assigned: set[int] = set()
        #: operation id -> (monotonic time before which it is not looked at again, next delay)
        self._backoff: dict[str, tuple[float, timedelta]] = {}
        self._warned_tools: set[str] = set()
        self._warned_tokens: set[str] = set()
        self._parked_checked_at = 0.0
        self.health = Health("recovery worker")

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, max_passes: int | None = None) -> None:
        """Join the group and work until :meth:`stop` (or ``max_passes``, for tests)."""
        self.join()
        interval = self._settings.recovery_interval_ms / 1000
        try:
            while not self._stopping.is_set() and (
                max_passes is None or self.health.done < max_passes
            ):
                self.poll_group(interval)
                self.run_once()
        finally:
            self.close()

    def join(self) -> None:
        """Subscribe to the execution topic in the recovery group. Records are not read (the
        partitions are paused): the assignment alone says which operations are this worker's."""
        consumer = new_consumer(
            self._settings,
            group_id=self._settings.recovery_group,
            client_id="opledger-recovery",
            overrides={
                "partition.assignment.strategy": "cooperative-sticky",
                # A SIGKILLed worker's partitions move once its session ends: 10 s, not the
                # default 45 s, during which nobody would sweep its operations.
                "session.timeout.ms": 10_000,
                "heartbeat.interval.ms": 2_000,
            },
        )
        consumer.subscribe(
            [self._settings.execution_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._consumer = consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._lookup_threads.shutdown(wait=False, cancel_futures=True)
        self._call_threads.shutdown(wait=False, cancel_futures=True)
        self._policy_freshness.close()

    def poll_group(self, timeout: float) -> None:
        """Serve the group protocol (rebalances, heartbeats) for up to ``timeout`` seconds."""
        assert self._consumer is not None, "join() first"
        message = self._consumer.poll(timeout)
        error = None if message is None else message.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            log.warning("recovery group: %s", error)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        consumer.pause(partitions)
        self._assigned |= {p.partition for p in partitions}
        self.health.partitions = tuple(sorted(self._assigned))
        log.info("recovery worker now looks after partitions %s", sorted(self._assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned -= {p.partition for p in partitions}
        consumer.incremental_unassign(partitions)
        self.health.partitions = tuple(sorted(self._assigned))

    @property
    def partitions(self) -> set[int]:
        return set(self._assigned)

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self, partitions: Iterable[int] | None = None) -> int:
        """Look after every due operation of ``partitions`` (default: the assigned ones);
        returns how many were handled. Never raises for a dependency that is away."""
        wanted = sorted(self._assigned if partitions is None else set(partitions))
        if not wanted:
            self.health.ok()
            return 0
        started = time.monotonic()
        self._held_for_policy = None
        try:
            handled = self._pass(wanted)
        except (DatabaseUnavailableError, HistoryError, KafkaException, RecordError) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("recovery pass failed, trying again next pass: %s", exc)
            self._stopping.wait(1.0)
            return 0
        self._report_parked()
        if self._held_for_policy is not None:
            self.health.stalled(self._held_for_policy)
        else:
            self.health.ok()
        self._metrics.recovery_pass_seconds.observe(time.monotonic() - started)
        return handled

    def _pass(self, partitions: Sequence[int]) -> int:
        due, view = self._still_due(self._due(self._candidates(partitions)))
        if not due:
            return 0
        taken, claimed = self._take_over(due)
        if not taken:
            return 0
        snapshots = self._load(view, taken, claimed)
        states = []
        for op_id, lease in taken.items():
            snapshot = snapshots.get(op_id)
            if snapshot is None or snapshot.execution is None:
                continue
            if snapshot.execution.lease_token != lease.token:
                continue  # another process claimed it after us
            provider = self._providers[snapshot.execution.tool_name]
            states.append(_State(snapshot.execution, lease, provider))
        for state in states:
            self._guarded(state, self._detect)
        self._look_up_and_decide(states)
        # Only the provider calls the decisions permit go back to the threads.
        self._concurrently(self._with_requests(states), self._call_stored)
        held = [s for s in states if isinstance(s.failure, PolicyViewStaleError)]
        if held:
            # One line for all of them, and /healthz says why nothing is decided.
            self._held_for_policy = f"{len(held)} operations held: {held[0].failure}"
            log.warning("recovery pass: %s", self._held_for_policy)
        for state in states:
            if state.failure is not None and state not in held:
                # one operation's trouble never stops the others
                log.warning("an operation was left for a later pass: %s", _said(state.failure))
        handled = self._record(states)
        self._leases.release(list(taken.values()))
        return handled

    def _look_up_and_decide(self, states: Sequence[_State]) -> None:
        """Ask the providers about every UNKNOWN attempt on the lookup threads and decide each
        operation here as the answers come back, a group at a time: policy is read once per
        subject for a group, right before its decisions (current policy, seed rule 3; nothing
        is kept from one group to the next), while the threads ask about the rest.

        A provider that stops answering stalls only its own operations: once no answer has
        come for the longest call timeout plus ``LOOKUP_GRACE``, the lookups still out are left
        for a later pass (backed off), and an operation is not asked about again until its
        unanswered lookup has returned."""
        live = [s for s in states if s.failure is None]
        group = [s for s in live if s.execution.state is X.INTENT_RECORDED]
        by_batch: dict[str, list[_State]] = {}
        one_by_one: deque[_State] = deque()
        for state in live:
            if state.execution.state is X.UNKNOWN:
                if state.provider.tool_name in self._batch_lookups:
                    by_batch.setdefault(state.provider.tool_name, []).append(state)
                else:
                    one_by_one.append(state)
        answered: queue.SimpleQueue[_State] = queue.SimpleQueue()
        outstanding = {id(s): s for s in one_by_one}
        outstanding.update((id(s), s) for batch in by_batch.values() for s in batch)
        with self._lookup_lock:
            self._in_lookup.update(s.execution.operation_id for s in outstanding.values())

        def drain() -> None:
            while True:
                try:
                    state = one_by_one.popleft()
                except IndexError:
                    return
                try:
                    self._guarded(state, self._look_up)
                finally:
                    self._looked_up([state])
                    answered.put(state)

        jobs = [
            self._lookup_threads.submit(self._look_up_many, b, answered) for b in by_batch.values()
        ]
        threads = min(self._thread_count - len(jobs), len(one_by_one))
        jobs += [
            self._lookup_threads.submit(drain) for _ in range(max(threads, 1 if one_by_one else 0))
        ]
        while True:
            if group:
                self._check_policy(group)
                for state in group:
                    self._guarded(state, self._decide)
            if not outstanding:
                break
            group = self._answers(answered, min(DECIDE_GROUP, len(outstanding)), jobs)
            if not group:
                self._give_up_lookups(list(outstanding.values()), one_by_one)
                return
            for state in group:
                outstanding.pop(id(state), None)
        for job in jobs:  # a job still running after its last answer is not waited for
            if job.done() and job.exception() is not None:
                raise RuntimeError("a lookup thread died") from job.exception()

    def _give_up_lookups(self, unanswered: Sequence[_State], not_started: deque[_State]) -> None:
        """No lookup answered for the patience: leave the operations still waiting for a later
        pass. Those whose lookup is under way stay marked as being looked up until it returns
        (whatever it says then is dropped); those not started yet are not started at all."""
        never: list[_State] = []
        with contextlib.suppress(IndexError):
            while True:
                never.append(not_started.popleft())
        self._looked_up(never)
        patience = self._lookup_patience().total_seconds()
        tools = sorted({s.provider.tool_name for s in unanswered})
        log.warning(
            "%d lookups (%s) unanswered after %.1fs without any answer; left for a later pass",
            len(unanswered),
            ", ".join(tools),
            patience,
        )
        for state in unanswered:
            state.failure = TimeoutError(
                f"{state.provider.tool_name}: no lookup answer within {patience:.1f}s"
            )
            self._back_off(state.execution.operation_id)

    def _looked_up(self, states: Iterable[_State]) -> None:
        with self._lookup_lock:
            self._in_lookup.difference_update(s.execution.operation_id for s in states)

    def _lookup_patience(self) -> timedelta:
        """How long a pass waits without any lookup answering before it gives up on the rest."""
        longest = max(p.terms.call_timeout for p in self._providers.values())
        return longest + LOOKUP_GRACE

    def _look_up_many(self, states: Sequence[_State], answered: queue.SimpleQueue[_State]) -> None:
        """Ask one provider about ``states`` at once (``BatchLookup``); each is put in
        ``answered`` once, with its answer or, if the provider broke off, its failure."""
        provider = states[0].provider
        assert isinstance(provider, BatchLookup)
        unanswered = dict(enumerate(states))
        try:
            for index, lookup in provider.lookup_many(
                [
                    (ids.idempotency_key(s.execution.operation_id), s.execution.provider_ref)
                    for s in states
                ]
            ):
                if not isinstance(index, int):
                    continue  # not an index into the requests: never anyone's answer
                state = unanswered.pop(index, None)
                if state is None:  # a second answer to one request is ignored
                    continue
                try:
                    self._answer(state, lookup)
                except Exception as exc:  # pragma: no cover - _answer reads defensively
                    state.failure = exc
                finally:
                    self._looked_up([state])
                    answered.put(state)
        except Exception as exc:  # left for a later pass; never decided by raising
            log.warning("lookups of %s broke off: %s", provider.tool_name, _said(exc))
            failure: Exception = exc
        else:
            failure = RuntimeError(f"{provider.tool_name}: lookup_many left requests unanswered")
        self._looked_up(unanswered.values())
        for state in unanswered.values():
            state.failure = failure
            answered.put(state)

    def _answers(
        self, answered: queue.SimpleQueue[_State], at_least: int, jobs: Sequence[Future[None]]
    ) -> list[_State]:
        """At least ``at_least`` answered operations (more if they are there already); fewer,
        possibly none, once no answer has come for the lookup patience."""
        patience = self._lookup_patience().total_seconds()
        group: list[_State] = []
        silent_since = time.monotonic()
        while len(group) < at_least:
            try:
                group.append(answered.get(timeout=min(1.0, patience)))
                silent_since = time.monotonic()
            except queue.Empty:
                for job in jobs:
                    if job.done() and job.exception() is not None:
                        raise RuntimeError("a lookup thread died") from job.exception()
                if time.monotonic() - silent_since >= patience:
                    break
        with contextlib.suppress(queue.Empty):
            while True:
                group.append(answered.get_nowait())
        return group

    def _concurrently(self, states: Sequence[_State], work: Callable[[_State], None]) -> None:
        """``work`` for each of ``states`` (those not failed yet) on the thread pool. Each thread
        takes the next operation itself: one hand-off per thread, not per operation."""
        todo = deque(s for s in states if s.failure is None)
        if not todo:
            return

        def drain() -> None:
            while True:
                try:
                    state = todo.popleft()
                except IndexError:
                    return
                self._guarded(state, work)

        for job in [self._threads.submit(drain) for _ in range(min(self._thread_count, len(todo)))]:
            job.result()

    @staticmethod
    def _guarded(state: _State, work: Callable[[_State], None]) -> None:
        """``work(state)`` unless the operation already failed; what it raises stays with it."""
        if state.failure is not None:
            return
        try:
            work(state)
        except Exception as exc:
            state.failure = exc

    def _record(self, states: Sequence[_State]) -> int:
        """Append what every operation of the pass decided, in one acknowledged send (one wait
        instead of one per operation); returns how many operations were handled. Each
        operation's records keep their order, and whatever a decision points at (a recovered
        result) was committed before it was queued. Records that must be durable before a
        provider call were sent at once (``_append(now=True)``)."""
        records = [record for state in states for record in state.pending]
        try:
            self._results.put_many([p for state in states for p in state.payloads])
            self._send_records(records)
        except RecordError as exc:
            # Some may have landed: a later pass reads the log again and decides from there.
            log.warning("a pass's decisions were not acknowledged; left for a later pass: %s", exc)
            return 0
        handled = 0
        for state in states:
            for counter in state.counted:
                counter.inc()
            if state.failure is None:
                handled += 1
        return handled

    def _candidates(self, partitions: Sequence[int]) -> list[Candidate]:
        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                _CANDIDATES_SQL, {"partitions": list(partitions), "limit": BATCH}
            ).fetchall()

        rows = retrying(self._pool, "find operations to recover", work)
        return [Candidate(r[0], r[1], ExecutionState(r[2]), r[3], r[4], r[5], r[6]) for r in rows]

    def _due(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        now, monotonic = datetime.now(UTC), time.monotonic()
        due = []
        for candidate in candidates:
            provider = self._providers.get(candidate.tool_name)
            if provider is None:
                if candidate.tool_name not in self._warned_tools:
                    self._warned_tools.add(candidate.tool_name)
                    log.warning(
                        "no provider for tool %s on this worker: its operations wait "
                        "(set OPLEDGER_PROVIDERS)",
                        candidate.tool_name,
                    )
                continue
            if candidate.lease_token is not None and candidate.lease_token >= MAX_TOKEN:
                if candidate.operation_id not in self._warned_tokens:
                    self._warned_tokens.add(candidate.operation_id)
                    log.error(
                        "%s: its lease token %d is at the ceiling no event can carry (%d): it "
                        "cannot be taken over, reconciled or cancelled; a person must look at "
                        "its operation_leases row",
                        candidate.operation_id,
                        candidate.lease_token,
                        MAX_TOKEN,
                    )
                continue
            if (
                candidate.lease_token is None
                and candidate.state is X.INTENT_RECORDED
                and now - candidate.state_entered_at < self._unleased_grace
            ):
                # Its writer may still be committing the lease and the request (a database
                # restart under it); taken over now, the intent could only be parked.
                continue
            backoff = self._backoff.get(candidate.operation_id)
            if backoff is not None and monotonic < backoff[0]:
                continue
            with self._lookup_lock:
                if candidate.operation_id in self._in_lookup:
                    continue  # its provider has not answered an earlier lookup yet
            if (
                candidate.state is X.DISPATCHED
                and now - candidate.state_entered_at < provider.terms.call_timeout
            ):
                continue  # its owner's call may still be under way
            due.append(candidate)
        return due

    def _still_due(self, due: Sequence[Candidate]) -> tuple[list[Candidate], View]:
        """The candidates that are really unfinished and unparked now, and the view they were
        read in. The projection may lag the log: an operation it still shows unfinished may
        have finished since, and taking it over would append an ownership change after its
        end."""
        if not due:
            return [], View({}, {}, {})
        view = self._history.view([(c.operation_id, c.tenant_id) for c in due])
        still = []
        for candidate in due:
            execution = view.snapshots[candidate.operation_id].execution
            if execution is None or execution.parked is not None:
                continue
            if execution.state not in (X.INTENT_RECORDED, X.DISPATCHED, X.UNKNOWN):
                continue
            still.append(candidate)
        return still, view

    def _take_over(
        self, due: Sequence[Candidate]
    ) -> tuple[dict[str, Lease], list[tuple[str, int, int]]]:
        """Take the leases of ``due`` and record the new owner of each (one acknowledged send);
        returns the leases taken and where the ownership records were written."""
        ttl = max(p.terms.call_timeout for p in self._providers.values()) + LEASE_MARGIN
        taken = self._leases.take_over([(c.operation_id, c.tenant_id) for c in due], ttl)
        if not taken:
            return {}, []
        by_id = {c.operation_id: c for c in due}
        claims = []
        unclaimable = []
        for op_id, lease in taken.items():
            try:
                claims.append(
                    OwnershipTaken(
                        event_id=self._event_id(),
                        operation_id=op_id,
                        tenant_id=lease.tenant_id,
                        actor_id="recovery-worker",
                        occurred_at=datetime.now(UTC),
                        attempt=by_id[op_id].attempt,
                        lease_token=lease.token,
                        reason=f"took over {by_id[op_id].state}: the previous lease expired",
                    )
                )
            except ValueError as exc:  # one operation's row never stops the others
                log.error("%s: its take-over cannot be recorded: %s", op_id, _said(exc))
                unclaimable.append(lease)
        if unclaimable:
            self._leases.release(unclaimable)
            for lease in unclaimable:
                del taken[lease.operation_id]
            if not taken:
                return {}, []
        claimed = self._send(claims)
        self._metrics.lease_takeovers.inc(len(taken))
        return taken, claimed

    def _load(
        self, view: View, taken: dict[str, Lease], claimed: Sequence[tuple[str, int, int]]
    ) -> dict[str, Snapshot]:
        # Read each partition up to (and including) this pass's claims: whatever the previous
        # owners appended before them counts, nothing after them can. The view the candidates
        # were checked in is moved on from where it was read, not read again.
        upto: dict[tuple[str, int], int] = {}
        for topic, partition, offset in claimed:
            key = (topic, partition)
            upto[key] = max(upto.get(key, 0), offset + 1)
        return self._history.advance(view, taken, upto=upto or None)

    # -- one operation -------------------------------------------------------------------------

    def _detect(self, state: _State) -> None:
        """DISPATCHED longer than the call timeout with its owner gone: UNKNOWN, with why."""
        if state.execution.state is not X.DISPATCHED:
            return
        reason = (
            f"no outcome within the tool's {state.provider.terms.call_timeout} call timeout "
            "and its owner went away (lease expired): the call may or may not have happened"
        )
        self._append(state, [self._transition(state, X.UNKNOWN, error=reason)])
        state.counted.append(self._metrics.detector_transitions)

    def _look_up(self, state: _State) -> None:
        """Ask the provider what became of an UNKNOWN attempt (a lookup never raises here)."""
        if state.execution.state is not X.UNKNOWN:
            return
        provider = state.provider
        key = ids.idempotency_key(state.execution.operation_id)
        try:
            lookup = provider.lookup(key, state.execution.provider_ref)
        except Exception as exc:  # a lookup never decides anything by raising
            log.warning("lookup of %s raised: %s", key, _said(exc))
            self._answer(state, None)
        else:
            self._answer(state, lookup)

    def _answer(self, state: _State, found: object) -> None:
        """Record the provider's answer; one nobody can read (not a ``LookupResult``, a status
        that is not a ``LookupStatus``, a result that is not bytes) is "I cannot tell":
        ``UNAVAILABLE``, retried later, never a reason to call."""
        if _readable(found):
            assert isinstance(found, LookupResult)
            status, lookup = found.status, found
        else:
            if found is not None:
                log.warning(
                    "%s: the lookup of %s answered %s, not a LookupResult with a LookupStatus "
                    "and bytes: taken as UNAVAILABLE",
                    state.provider.tool_name,
                    ids.idempotency_key(state.execution.operation_id),
                    type(found).__name__,
                )
            status, lookup = LookupStatus.UNAVAILABLE, None
        state.lookup, state.found = status, lookup
        self._metrics.provider_lookups.labels(state.provider.tool_name, status.value).inc()

    def _check_policy(self, states: Sequence[_State]) -> None:
        """Policy as it is now for every operation about to be decided, in one read per
        subject; when it cannot be read, none of them is decided in this pass."""
        deciding = (X.INTENT_RECORDED, X.UNKNOWN)
        asking = [s for s in states if s.failure is None and s.execution.state in deciding]
        if not asking:
            return
        try:
            # A view that may lack a revocation decides nothing: held for a later pass, like an
            # unreadable one, rather than resumed or attempted again under it (decision 022).
            stale = self._policy_freshness.stale_reason()
            if stale is not None:
                raise PolicyViewStaleError(stale)
            decisions = self._policy([self._policy_request(s) for s in asking])
        except Exception as exc:
            for state in asking:
                state.failure = exc
            return
        for state, decision in zip(asking, decisions, strict=True):
            state.policy = decision

    def _policy_request(self, state: _State) -> PolicyRequest:
        execution = state.execution
        purpose = (
            Purpose.NEW_ATTEMPT
            if execution.state is X.UNKNOWN and state.lookup is LookupStatus.NOT_FOUND
            else Purpose.DISPATCH
        )
        return PolicyRequest(
            tenant_id=execution.tenant_id,
            actor_id=execution.actor_id,
            tool_name=execution.tool_name,
            purpose=purpose,
            now=datetime.now(UTC),
            required_scope=state.provider.terms.required_scope,
            cancelled=execution.cancelled,
        )

    def _decide(self, state: _State) -> None:
        if state.execution.state is X.INTENT_RECORDED:
            self._resume(state)
        elif state.execution.state is X.UNKNOWN:
            self._reconcile(state)

    def _resume(self, state: _State) -> None:
        decision = state.policy
        assert decision is not None
        if not decision.allowed:
            decided = self._decision(
                state, Decision.REFUSE, LookupStatus.NOT_LOOKED_UP, decision, decision.reason
            )
            reason = f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
            self._append(
                state,
                [decided, self._transition(state, X.FAILED, error=reason, decided=decided)],
            )
            state.counted.append(self._metrics.resumed.labels("refused"))
            return
        state.wants_call = Decision.RESUME  # once its stored request is read

    def _reconcile(self, state: _State) -> None:
        execution = state.execution
        lookup_status, found, policy = state.lookup, state.found, state.policy
        assert lookup_status is not None and policy is not None
        now = datetime.now(UTC)
        dispatched_at = (
            execution.state_entered_at
            if execution.state is not X.UNKNOWN
            else self._dispatched_at(execution)
        )
        retention = state.provider.terms.key_retention
        verdict = decide(
            lookup_status,
            policy,
            dispatched_at=dispatched_at,
            now=now,
            key_retention=retention,
            provider_repeat_safe=state.provider.terms.repeat_safe,
        )
        ahead = dispatched_at - now
        if verdict.decision is Decision.NEW_ATTEMPT and ahead > CLOCK_SKEW_TOLERANCE:
            # The attempt's age is the writer's clock against this one: stamped in the future,
            # it proves nothing, and a not-found proves the call did not happen only within the
            # retention. A repeat could be a second effect: a person decides.
            verdict = Verdict(
                Decision.PARK,
                f"the provider has no record of the key, but the attempt is stamped {ahead} "
                "ahead of this worker's clock (its writer's clock runs ahead): whether it is "
                f"within the provider's key retention of {retention} cannot be told; a person "
                "decides",
            )
        provider_ref = (
            recordable_provider_ref(found.provider_ref) if found else None
        ) or execution.provider_ref

        if verdict.decision is Decision.RETRY_LOOKUP:
            self._back_off(execution.operation_id)
            if execution.decision is not Decision.RETRY_LOOKUP:
                # Recorded once per stretch of unavailability, not at every retry.
                self._append(
                    state,
                    [
                        self._decision(
                            state, verdict.decision, lookup_status, policy, verdict.reason
                        )
                    ],
                )
            state.counted.append(self._metrics.reconciliations.labels("retry_lookup"))
            return
        self._backoff.pop(execution.operation_id, None)
        if verdict.decision is Decision.MARK_SUCCEEDED:
            assert found is not None
            result = found.result if found.result is not None else b""
            if len(result) > MAX_RESULT_BYTES:
                # The effect happened; what it produced cannot be stored, so nothing could
                # ever point at it: a person decides, and the tool is never called again.
                reason = (
                    f"the provider confirms it succeeded, but its result is {len(result)} bytes, "
                    f"over the result store's limit of {MAX_RESULT_BYTES}: parked for a person "
                    "(the effect happened; it is not called again)"
                )
                self._append(
                    state,
                    [self._decision(state, Decision.PARK, lookup_status, policy, reason)],
                )
                state.counted.append(self._metrics.reconciliations.labels("parked"))
                return
            # The recovered result is durable before anything points at it (seed row 3): it is
            # stored with the pass's other results, in one commit, before any record is sent.
            prepared = self._results.prepare(
                execution.tenant_id, result, recordable_content_type(found.content_type)
            )
            state.payloads.append(prepared)
            result_ref = prepared.result_ref
            decided = self._decision(
                state, verdict.decision, lookup_status, policy, verdict.reason,
                provider_ref=provider_ref, result_ref=result_ref,
            )  # fmt: skip
            self._append(
                state,
                [
                    decided,
                    self._transition(
                        state,
                        X.SUCCEEDED,
                        result_ref=result_ref,
                        provider_ref=provider_ref,
                        decided=decided,
                    ),
                ],
            )
            state.counted.append(self._metrics.reconciliations.labels("succeeded"))
        elif verdict.decision is Decision.MARK_FAILED:
            reason = (found.reason if found else None) or "the provider reports the call failed"
            decided = self._decision(
                state, verdict.decision, lookup_status, policy, verdict.reason,
                provider_ref=provider_ref,
            )  # fmt: skip
            self._append(
                state,
                [decided, self._transition(state, X.FAILED, error=reason, decided=decided)],
            )
            state.counted.append(self._metrics.reconciliations.labels("failed"))
        elif verdict.decision is Decision.NEW_ATTEMPT:
            state.wants_call = Decision.NEW_ATTEMPT  # once its stored request is read
            state.verdict_reason = verdict.reason
        else:  # PARK or REFUSE: a person decides
            self._append(
                state,
                [self._decision(state, verdict.decision, lookup_status, policy, verdict.reason)],
            )
            outcome = "parked" if verdict.decision is Decision.PARK else "refused"
            state.counted.append(self._metrics.reconciliations.labels(outcome))

    def _with_requests(self, states: Sequence[_State]) -> list[_State]:
        """The operations whose decision permits a call, with their stored requests (read in
        one statement); one whose request was never stored is parked instead."""
        calling = [s for s in states if s.failure is None and s.wants_call is not None]
        if not calling:
            return []
        try:
            stored = self._leases.requests(
                [(s.execution.operation_id, s.execution.tenant_id) for s in calling]
            )
        except Exception as exc:
            for state in calling:
                state.failure = exc
            return []
        ready = []
        for state in calling:
            state.stored_request = stored.get(state.execution.operation_id)
            self._guarded(state, self._prepare_call)
            if state.failure is None and state.decided is not None:
                ready.append(state)
        return ready

    def _prepare_call(self, state: _State) -> None:
        body, policy = state.stored_request, state.policy
        assert policy is not None
        if state.wants_call is Decision.RESUME:
            if body is None:
                decided = self._decision(
                    state,
                    Decision.PARK,
                    LookupStatus.NOT_LOOKED_UP,
                    policy,
                    "the intent's request was never stored (recorded without a lease store, "
                    "or its lease and request failed to commit while the intent was sent): "
                    "it cannot be dispatched by anyone but its owner",
                )
                self._append(state, [decided])
                return
            state.request = json.loads(body)
            state.decided = self._decision(
                state,
                Decision.RESUME,
                LookupStatus.NOT_LOOKED_UP,
                policy,
                "the owner went away before dispatching: no call was made; dispatching it once",
            )
            return
        assert state.lookup is not None
        if body is None:
            self._append(
                state,
                [
                    self._decision(
                        state,
                        Decision.PARK,
                        state.lookup,
                        policy,
                        "a new attempt is allowed, but the request was never stored",
                    )
                ],
            )
            state.counted.append(self._metrics.reconciliations.labels("parked"))
            return
        state.counted.append(self._metrics.reconciliations.labels("new_attempt"))
        state.request = json.loads(body)
        state.decided = self._decision(
            state, Decision.NEW_ATTEMPT, state.lookup, policy, state.verdict_reason
        )

    def _call_stored(self, state: _State) -> None:
        assert state.decided is not None
        label = "resumed" if state.wants_call is Decision.RESUME else "new_attempt"
        self._call(state, state.provider, state.request, state.decided, label=label)

    def _call(
        self,
        state: _State,
        provider: Provider,
        request: Any,
        decided: ReconciliationDecided,
        *,
        label: str,
    ) -> None:
        """Record the decision and the dispatch it permits, then call the provider once: the
        call rule (``ledger.call_rule``), as every path that calls a tool performs it."""
        port = _WorkerCallPort(self, state, provider, request, decided)
        judged = run_now(perform_call(port, state.execution.operation_id, stage="recover"))
        outcome = judged.state.value.lower()
        self._metrics.provider_calls.labels(provider.tool_name, outcome).inc()
        if label == "resumed":
            state.counted.append(self._metrics.resumed.labels(outcome))

    def _bounded_call(self, provider: Provider, request: Any, key: str) -> CallOutcome:
        """``provider.call`` on a call thread, waited for at most the tool's call timeout: past
        it the outcome is unknown (:class:`ContactLost`). A call still queued then, every call
        thread held by calls that never returned, is never made: a confirmed failure, as the
        SDK records it."""
        seconds = provider.terms.call_timeout.total_seconds()
        queued = self._call_threads.submit(provider.call, request, key)
        try:
            return queued.result(timeout=seconds)
        except FutureTimeoutError:
            if queued.cancel():
                return CallOutcome(
                    False,
                    error=f"{provider.tool_name}: not called: all {self._thread_count} call "
                    f"threads stayed busy for the call timeout ({seconds:g}s)",
                )
            raise ContactLost(f"{provider.tool_name}: no answer within {seconds:g}s") from None

    # -- building and appending ----------------------------------------------------------------

    def _transition(
        self,
        state: _State,
        to: ExecutionState,
        *,
        error: str | None = None,
        result_ref: str | None = None,
        provider_ref: str | None = None,
        decided: ReconciliationDecided | None = None,
    ) -> ExecutionTransitioned:
        execution = state.execution
        attempt = execution.attempt + 1 if to is X.DISPATCHED else execution.attempt
        return ExecutionTransitioned(
            event_id=self._event_id(),
            operation_id=execution.operation_id,
            tenant_id=execution.tenant_id,
            actor_id="recovery-worker",
            occurred_at=datetime.now(UTC),
            attempt=attempt,
            state=to,
            tool_name=execution.tool_name,
            request_hash=execution.request_hash,
            provider_ref=provider_ref,
            result_ref=result_ref,
            error=None if error is None else _text(error),
            lease_token=state.lease.token,
            decision_id=None if decided is None else decided.event_id,
        )

    def _decision(
        self,
        state: _State,
        decision: Decision,
        lookup: LookupStatus,
        policy: PolicyDecision,
        reason: str,
        *,
        provider_ref: str | None = None,
        result_ref: str | None = None,
    ) -> ReconciliationDecided:
        execution = state.execution
        return ReconciliationDecided(
            event_id=self._event_id(),
            operation_id=execution.operation_id,
            tenant_id=execution.tenant_id,
            actor_id="recovery-worker",
            occurred_at=datetime.now(UTC),
            attempt=execution.attempt,
            lease_token=state.lease.token,
            decision=decision,
            lookup=lookup,
            provider_ref=provider_ref,
            result_ref=result_ref,
            policy_version=policy.version,
            policy_allowed=policy.allowed,
            provider_repeat_safe=state.provider.terms.repeat_safe,
            reason=_text(reason),
        )

    def _append(
        self, state: _State, events: Sequence[OperationEvent], *, now: bool = False
    ) -> None:
        """Fold ``events`` onto the operation (refusing to send what the fold would reject) and
        move the in-memory state on. The records are queued for the pass's one send, or, with
        ``now``, sent at once (after those the operation queued before) and acknowledged."""
        execution = state.execution
        for event in events:
            outcome = (
                apply_execution(execution, event)
                if isinstance(event, ExecutionTransitioned)
                else apply_control(execution, event)  # type: ignore[arg-type]
            )
            if not isinstance(outcome, Applied):
                raise RecordError(f"{execution.operation_id}: refusing to append: {outcome}")
            execution = outcome.record
        records = [self._outgoing(e) for e in events]
        if now:
            self._results.put_many(state.payloads)
            state.payloads.clear()
            self._send_records([*state.pending, *records])
            state.pending.clear()
        else:
            state.pending.extend(records)
        state.execution = execution

    def _outgoing(self, event: OperationEvent) -> OutgoingRecord:
        return self._log.builder.record(event)

    def _send(self, events: Sequence[OperationEvent]) -> Positions:
        return self._log.append(events)

    def _send_records(self, records: Sequence[OutgoingRecord]) -> Positions:
        return self._log.send(records)

    def _dispatched_at(self, execution: ExecutionRecord) -> datetime:
        # The record keeps when UNKNOWN was entered, not when the attempt was dispatched; the
        # difference is at most the call timeout, which is small next to any key retention.
        return execution.state_entered_at

    def _back_off(self, operation_id: str) -> None:
        first, last = LOOKUP_BACKOFF
        previous = self._backoff.get(operation_id)
        delay = first if previous is None else min(previous[1] * 2, last)
        self._backoff[operation_id] = (time.monotonic() + delay.total_seconds(), delay)

    def _event_id(self) -> str:
        return ids.event_id(time.time_ns() // 1_000_000, entropy(10))

    def _report_parked(self, every_s: float = 5.0) -> None:
        now = time.monotonic()
        if now - self._parked_checked_at < every_s:
            return
        self._parked_checked_at = now

        def work(conn: psycopg.Connection[Any]) -> float:
            row = conn.execute(_PARKED_AGE_SQL).fetchone()
            return 0.0 if row is None else float(row[0])

        try:
            self._metrics.parked_oldest_age_seconds.set(
                retrying(self._pool, "measure parked operations", work)
            )
        except RecordError as exc:
            log.debug("parked age not refreshed: %s", exc)


class _WorkerCallPort:
    """The call rule's steps as the worker performs them for one operation of its pass: the
    decision and the dispatch sent and acknowledged together before the call, the outcome
    queued for the pass's one send (its result stored first)."""

    __slots__ = ("_decided", "_provider", "_request", "_state", "_ttl", "_worker")

    def __init__(
        self,
        worker: RecoveryWorker,
        state: _State,
        provider: Provider,
        request: Any,
        decided: ReconciliationDecided,
    ) -> None:
        self._worker = worker
        self._state = state
        self._provider = provider
        self._request = request
        self._decided = decided
        self._ttl = provider.terms.call_timeout + LEASE_MARGIN

    @immediately
    def keep_lease(self, *, now: bool) -> None:
        state, leases = self._state, self._worker._leases
        if now and leases.holds(state.lease):
            return
        if now or state.lease.remaining() < self._ttl.total_seconds() / 2:
            # Reclaimed only if nobody took the operation over (else LeaseLostError: the
            # operation is left for a later pass, uncalled).
            state.lease = leases.reclaim(state.lease, self._ttl)

    @immediately
    def record_dispatch(self, provider_ref: str) -> None:
        worker, state = self._worker, self._state
        dispatch = worker._transition(
            state, ExecutionState.DISPATCHED, provider_ref=provider_ref, decided=self._decided
        )
        # Durable before the call (with whatever this operation queued before it), as always.
        worker._append(state, [self._decided, dispatch], now=True)

    @immediately
    def call(self, key: str) -> object:
        return self._worker._bounded_call(self._provider, self._request, key)

    @immediately
    def record_outcome(self, judged: Judged) -> None:
        worker, state = self._worker, self._state
        if judged.state is ExecutionState.SUCCEEDED:
            assert judged.result is not None
            result_ref = worker._results.put(
                state.execution.tenant_id, judged.result, judged.content_type
            )
            event = worker._transition(
                state,
                ExecutionState.SUCCEEDED,
                result_ref=result_ref,
                provider_ref=judged.provider_ref,
            )
        else:
            event = worker._transition(state, judged.state, error=_text(judged.error or ""))
        worker._append(state, [event])


class _State:
    """An operation being handled: its record as this worker last folded it, the lease, what
    this pass learnt about it, and what is still to be sent for it."""

    __slots__ = (
        "counted",
        "decided",
        "execution",
        "failure",
        "found",
        "lease",
        "lookup",
        "payloads",
        "pending",
        "policy",
        "provider",
        "request",
        "stored_request",
        "verdict_reason",
        "wants_call",
    )

    def __init__(self, execution: ExecutionRecord, lease: Lease, provider: Provider) -> None:
        self.execution = execution
        self.lease = lease
        self.provider = provider
        #: what the provider said about the UNKNOWN attempt, when it was asked
        self.lookup: LookupStatus | None = None
        self.found: LookupResult | None = None
        #: policy as read in this pass, right before deciding
        self.policy: PolicyDecision | None = None
        #: RESUME or NEW_ATTEMPT when the decision permits a call, and what it needs
        self.wants_call: Decision | None = None
        self.verdict_reason = ""
        self.stored_request: bytes | None = None
        self.request: Any = None
        self.decided: ReconciliationDecided | None = None
        #: records folded but not sent yet, in order: the pass sends them all at once
        self.pending: list[OutgoingRecord] = []
        #: results those records point at, stored (in one commit for the pass) before them
        self.payloads: list[PreparedResult] = []
        #: counters of recorded decisions, incremented once their records are acknowledged
        self.counted: list[Any] = []
        #: why this operation was left for a later pass, if it was
        self.failure: Exception | None = None


def _text(value: str | BaseException) -> str:
    text = value if isinstance(value, str) else f"{type(value).__name__}: {value}"
    # A provider's words, recorded even if unstorable. Cut first, at a whitespace, as the
    # delivery worker cuts a destination's answer: the scrub's cost grows faster than its input
    # (10,000 characters shaped for its keyword detector took over 20 s), and the cache below
    # would otherwise keep every long text a provider ever sent.
    return _scrubbed(storable_text(cut_tokens(text, MAX_ERROR)))


def _said(exc: BaseException) -> str:
    """An exception from outside (a provider's), cut for a log line: the log handlers scrub
    every line, at a cost that grows faster than its length."""
    return cut_tokens(f"{type(exc).__name__}: {exc}", MAX_ERROR)


def _readable(found: object) -> bool:
    """Whether a lookup's answer can be acted on: a LookupResult whose status is a
    LookupStatus and whose result, if any, is bytes."""
    return (
        isinstance(found, LookupResult)
        and isinstance(found.status, LookupStatus)
        and (found.result is None or isinstance(found.result, bytes))
    )


@functools.lru_cache(maxsize=4096)
def _scrubbed(text: str) -> str:
    # scrub is a pure function of the text, and a pass repeats the same few reasons hundreds
    # of times: detect-secrets' plugins over each of them cost more than the rest of a decision.
    return scrub(text, max_length=MAX_ERROR)
