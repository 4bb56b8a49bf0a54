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

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg_pool import ConnectionPool

from ledger.codec import Codec, default_codec
from ledger.domain import ids
from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.fold import Applied, ExecutionRecord, apply_control, apply_execution
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.reconcile import Decision, LookupStatus, decide
from ledger.domain.states import ExecutionState
from ledger.errors import RecordError
from ledger.faults import fault_point
from ledger.history import HistoryError, HistoryReader, Snapshot
from ledger.kafka import consumer_config
from ledger.leases import Lease, LeaseStore
from ledger.metrics import Metrics
from ledger.pg import DatabaseUnavailableError, retrying
from ledger.results import ResultStore
from ledger.secrets import scrub
from ledger.settings import Settings
from ledger.tools import ContactLost, Provider
from ledger.transport import OutgoingRecord, Transport

log = logging.getLogger("opledger.recovery")

X = ExecutionState
PolicyCheck = Callable[[PolicyRequest], PolicyDecision]

#: Operations handled per pass (a pass takes their leases in one statement).
BATCH = 500
#: The lease a worker takes for an operation: long enough for a provider call and its record.
LEASE_MARGIN = timedelta(seconds=10)
#: Backoff of a lookup the provider could not answer: doubles from the first to the last.
LOOKUP_BACKOFF = (timedelta(seconds=1), timedelta(seconds=60))
MAX_ERROR = 1000

_CANDIDATES_SQL = """
SELECT o.operation_id, o.tenant_id, o.execution_state, o.tool_name, o.state_entered_at,
       o.attempt
  FROM agent_operations o
  LEFT JOIN operation_leases l ON l.operation_id = o.operation_id
 WHERE o.kafka_partition = ANY(%(partitions)s)
   AND o.execution_state IN ('INTENT_RECORDED', 'DISPATCHED', 'UNKNOWN')
   AND o.parked IS NULL
   AND (l.expires_at IS NULL OR l.expires_at <= now())
 ORDER BY o.state_entered_at
 LIMIT %(limit)s
"""

_PARKED_AGE_SQL = """
SELECT COALESCE(extract(epoch FROM now() - min(decided_at)), 0)
  FROM agent_operations WHERE parked IS NOT NULL
"""


@dataclass(frozen=True, slots=True)
class Candidate:
    operation_id: str
    tenant_id: str
    state: ExecutionState
    tool_name: str
    state_entered_at: datetime
    attempt: int


class Health:
    """Whether the worker is doing its job, for ``/healthz``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.progressing = True
        self.reason: str | None = None
        self.since = time.monotonic()
        self.passes = 0
        self.partitions: tuple[int, ...] = ()

    def ok(self) -> None:
        with self._lock:
            self.passes += 1
            if not self.progressing:
                self.progressing, self.reason, self.since = True, None, time.monotonic()

    def stalled(self, reason: str) -> None:
        with self._lock:
            if self.progressing:
                self.progressing, self.since = False, time.monotonic()
            self.reason = reason

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "status": "ok" if self.progressing else "stalled",
                "progressing": self.progressing,
                "reason": self.reason,
                "for_s": round(time.monotonic() - self.since, 1),
                "passes": self.passes,
                "partitions": list(self.partitions),
            }


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
        self._pool = pool
        self._transport = transport
        self._leases = leases
        self._history = history
        self._results = results
        self._policy = policy
        self._providers = {p.tool_name: p for p in providers}
        self._metrics = metrics
        self._codec = codec or default_codec()
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-recover")
        self._stopping = threading.Event()
        self._consumer: Consumer | None = None
        self._assigned: set[int] = set()
        #: operation id -> (monotonic time before which it is not looked at again, next delay)
        self._backoff: dict[str, tuple[float, timedelta]] = {}
        self._warned_tools: set[str] = set()
        self._parked_checked_at = 0.0
        self.health = Health()

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, max_passes: int | None = None) -> None:
        """Join the group and work until :meth:`stop` (or ``max_passes``, for tests)."""
        self.join()
        interval = self._settings.recovery_interval_ms / 1000
        try:
            while not self._stopping.is_set() and (
                max_passes is None or self.health.passes < max_passes
            ):
                self.poll_group(interval)
                self.run_once()
        finally:
            self.close()

    def join(self) -> None:
        """Subscribe to the execution topic in the recovery group. Records are not read (the
        partitions are paused): the assignment alone says which operations are this worker's."""
        consumer = Consumer(
            {
                **consumer_config(
                    self._settings,
                    group_id=self._settings.recovery_group,
                    client_id="opledger-recovery",
                ),
                "partition.assignment.strategy": "cooperative-sticky",
            }
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
        try:
            handled = self._pass(wanted)
        except (DatabaseUnavailableError, HistoryError, KafkaException, RecordError) as exc:
            self.health.stalled(f"{type(exc).__name__}: {exc}")
            log.warning("recovery pass failed, trying again next pass: %s", exc)
            self._stopping.wait(1.0)
            return 0
        self._report_parked()
        self.health.ok()
        self._metrics.recovery_pass_seconds.observe(time.monotonic() - started)
        return handled

    def _pass(self, partitions: Sequence[int]) -> int:
        due = self._still_due(self._due(self._candidates(partitions)))
        if not due:
            return 0
        taken, claimed = self._take_over(due)
        if not taken:
            return 0
        snapshots = self._load(taken, claimed)
        jobs = []
        for op_id, lease in taken.items():
            snapshot = snapshots.get(op_id)
            if snapshot is None or snapshot.execution is None:
                continue
            if snapshot.execution.lease_token != lease.token:
                continue  # another process claimed it after us
            jobs.append(self._threads.submit(self._handle, snapshot, lease))
        handled = 0
        for job in jobs:
            try:
                job.result()
                handled += 1
            except Exception as exc:  # one operation's trouble never stops the others
                log.warning("an operation was left for a later pass: %s", exc)
        self._leases.release(list(taken.values()))
        return handled

    def _candidates(self, partitions: Sequence[int]) -> list[Candidate]:
        def work(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(
                _CANDIDATES_SQL, {"partitions": list(partitions), "limit": BATCH}
            ).fetchall()

        rows = retrying(self._pool, "find operations to recover", work)
        return [Candidate(r[0], r[1], ExecutionState(r[2]), r[3], r[4], r[5]) for r in rows]

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
            backoff = self._backoff.get(candidate.operation_id)
            if backoff is not None and monotonic < backoff[0]:
                continue
            if (
                candidate.state is X.DISPATCHED
                and now - candidate.state_entered_at < provider.terms.call_timeout
            ):
                continue  # its owner's call may still be under way
            due.append(candidate)
        return due

    def _still_due(self, due: Sequence[Candidate]) -> list[Candidate]:
        """The candidates that are really unfinished and unparked now. The projection may lag
        the log: an operation it still shows unfinished may have finished since, and taking it
        over would append an ownership change after its end."""
        if not due:
            return []
        exact = self._history.load([(c.operation_id, c.tenant_id) for c in due])
        still = []
        for candidate in due:
            execution = exact[candidate.operation_id].execution
            if execution is None or execution.parked is not None:
                continue
            if execution.state not in (X.INTENT_RECORDED, X.DISPATCHED, X.UNKNOWN):
                continue
            still.append(candidate)
        return still

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
        for op_id, lease in taken.items():
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
        claimed = self._send(claims)
        self._metrics.lease_takeovers.inc(len(taken))
        return taken, claimed

    def _load(
        self, taken: dict[str, Lease], claimed: Sequence[tuple[str, int, int]]
    ) -> dict[str, Snapshot]:
        # Read each partition up to (and including) this pass's claims: whatever the previous
        # owners appended before them counts, nothing after them can.
        upto: dict[tuple[str, int], int] = {}
        for topic, partition, offset in claimed:
            key = (topic, partition)
            upto[key] = max(upto.get(key, 0), offset + 1)
        return self._history.load(
            [(op, lease.tenant_id) for op, lease in taken.items()], upto=upto or None
        )

    # -- one operation -------------------------------------------------------------------------

    def _handle(self, snapshot: Snapshot, lease: Lease) -> None:
        execution = snapshot.execution
        assert execution is not None
        provider = self._providers[execution.tool_name]
        state = _State(execution, lease)
        if execution.state is X.INTENT_RECORDED:
            self._resume(state, provider)
            return
        if execution.state is X.DISPATCHED:
            reason = (
                f"no outcome within the tool's {provider.terms.call_timeout} call timeout and "
                "its owner went away (lease expired): the call may or may not have happened"
            )
            self._append(state, [self._transition(state, X.UNKNOWN, error=reason)])
            self._metrics.detector_transitions.inc()
        if state.execution.state is X.UNKNOWN:
            self._reconcile(state, provider)

    def _resume(self, state: _State, provider: Provider) -> None:
        decision = self._check(state.execution, provider, Purpose.DISPATCH)
        if not decision.allowed:
            decided = self._decision(
                state, Decision.REFUSE, LookupStatus.NOT_LOOKED_UP, decision, decision.reason
            )
            reason = f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
            self._append(
                state,
                [decided, self._transition(state, X.FAILED, error=reason, decided=decided)],
            )
            self._metrics.resumed.labels("refused").inc()
            return
        stored = self._leases.requests([(state.execution.operation_id, state.execution.tenant_id)])
        body = stored.get(state.execution.operation_id)
        if body is None:
            decided = self._decision(
                state,
                Decision.PARK,
                LookupStatus.NOT_LOOKED_UP,
                decision,
                "the intent's request was never stored (recorded without a lease store): it "
                "cannot be dispatched by anyone but its owner",
            )
            self._append(state, [decided])
            return
        decided = self._decision(
            state,
            Decision.RESUME,
            LookupStatus.NOT_LOOKED_UP,
            decision,
            "the owner went away before dispatching: no call was made; dispatching it once",
        )
        self._call(state, provider, json.loads(body), decided, label="resumed")

    def _reconcile(self, state: _State, provider: Provider) -> None:
        execution = state.execution
        key = ids.idempotency_key(execution.operation_id)
        try:
            lookup = provider.lookup(key, execution.provider_ref)
        except Exception as exc:  # a lookup never decides anything by raising
            log.warning("lookup of %s raised: %s", key, exc)
            lookup_status, found = LookupStatus.UNAVAILABLE, None
        else:
            lookup_status, found = lookup.status, lookup
        self._metrics.provider_lookups.labels(provider.tool_name, lookup_status.value).inc()
        purpose = (
            Purpose.NEW_ATTEMPT if lookup_status is LookupStatus.NOT_FOUND else Purpose.DISPATCH
        )
        policy = self._check(execution, provider, purpose)
        verdict = decide(
            lookup_status,
            policy,
            dispatched_at=execution.state_entered_at
            if execution.state is not X.UNKNOWN
            else self._dispatched_at(execution),
            now=datetime.now(UTC),
            key_retention=provider.terms.key_retention,
        )
        provider_ref = (found.provider_ref if found else None) or execution.provider_ref

        def decision_only() -> ReconciliationDecided:
            return self._decision(state, verdict.decision, lookup_status, policy, verdict.reason)

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
            self._metrics.reconciliations.labels("retry_lookup").inc()
            return
        self._backoff.pop(execution.operation_id, None)
        if verdict.decision is Decision.MARK_SUCCEEDED:
            assert found is not None
            result = found.result if found.result is not None else b""
            # The recovered result is durable before anything points at it (seed row 3).
            result_ref = self._results.put(execution.tenant_id, result, found.content_type)
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
            self._metrics.reconciliations.labels("succeeded").inc()
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
            self._metrics.reconciliations.labels("failed").inc()
        elif verdict.decision is Decision.NEW_ATTEMPT:
            decided = decision_only()
            stored = self._leases.requests([(execution.operation_id, execution.tenant_id)])
            body = stored.get(execution.operation_id)
            if body is None:
                self._append(
                    state,
                    [
                        self._decision(
                            state,
                            Decision.PARK,
                            lookup_status,
                            policy,
                            "a new attempt is allowed, but the request was never stored",
                        )
                    ],
                )
                self._metrics.reconciliations.labels("parked").inc()
                return
            self._metrics.reconciliations.labels("new_attempt").inc()
            self._call(state, provider, json.loads(body), decided, label="new_attempt")
        else:  # PARK or REFUSE: a person decides
            self._append(
                state,
                [self._decision(state, verdict.decision, lookup_status, policy, verdict.reason)],
            )
            outcome = "parked" if verdict.decision is Decision.PARK else "refused"
            self._metrics.reconciliations.labels(outcome).inc()

    def _call(
        self,
        state: _State,
        provider: Provider,
        request: Any,
        decided: ReconciliationDecided,
        *,
        label: str,
    ) -> None:
        """Record the decision and the dispatch it permits, then call the provider once."""
        key = ids.idempotency_key(state.execution.operation_id)
        dispatch = self._transition(state, X.DISPATCHED, provider_ref=key, decided=decided)
        self._append(state, [decided, dispatch])
        if not self._leases.holds(state.lease):
            log.warning("%s: lease lost before the call; not calling", key)
            return
        fault_point("recover.after_dispatch_before_call")
        try:
            outcome = provider.call(request, key)
        except Exception as exc:  # an unconfirmed outcome is UNKNOWN, by design
            lost = f"contact lost after dispatch: {exc}" if isinstance(exc, ContactLost) else exc
            self._append(state, [self._transition(state, X.UNKNOWN, error=_text(lost))])
            self._metrics.provider_calls.labels(provider.tool_name, "unknown").inc()
            if label == "resumed":
                self._metrics.resumed.labels("unknown").inc()
            return
        if outcome.succeeded:
            result = outcome.result if outcome.result is not None else b""
            result_ref = self._results.put(state.execution.tenant_id, result, outcome.content_type)
            event = self._transition(
                state, X.SUCCEEDED, result_ref=result_ref, provider_ref=outcome.provider_ref
            )
            label_outcome = "succeeded"
        else:
            event = self._transition(
                state, X.FAILED, error=_text(outcome.error or "the provider reported a failure")
            )
            label_outcome = "failed"
        self._append(state, [event])
        self._metrics.provider_calls.labels(provider.tool_name, label_outcome).inc()
        if label == "resumed":
            self._metrics.resumed.labels(label_outcome).inc()

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
            reason=_text(reason),
        )

    def _append(self, state: _State, events: Sequence[OperationEvent]) -> None:
        """Fold ``events`` onto the operation (refusing to send what the fold would reject),
        append them in one acknowledged send, and move the in-memory state on."""
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
        self._send(events)
        state.execution = execution

    def _send(self, events: Sequence[OperationEvent]) -> list[tuple[str, int, int]]:
        records = [
            OutgoingRecord(
                self._settings.execution_topic,
                e.operation_id.encode("ascii"),
                self._codec.encode(e),
                [("opledger-schema", type(e).__name__.encode())],
            )
            for e in events
        ]
        # A resend of the very same records after a lost acknowledgement is harmless: the fold
        # recognises each by its event id.
        for attempt in range(3):
            try:
                return self._transport.send(records) or []
            except RecordError:
                if attempt == 2:
                    raise
                time.sleep(0.2 * (attempt + 1))
        return []

    def _check(
        self, execution: ExecutionRecord, provider: Provider, purpose: Purpose
    ) -> PolicyDecision:
        return self._policy(
            PolicyRequest(
                tenant_id=execution.tenant_id,
                actor_id=execution.actor_id,
                tool_name=execution.tool_name,
                purpose=purpose,
                now=datetime.now(UTC),
                required_scope=provider.terms.required_scope,
                cancelled=execution.cancelled,
            )
        )

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
        return ids.event_id(time.time_ns() // 1_000_000, os.urandom(10))

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


class _State:
    """An operation being handled: its record as this worker last appended it, and the lease."""

    __slots__ = ("execution", "lease")

    def __init__(self, execution: ExecutionRecord, lease: Lease) -> None:
        self.execution = execution
        self.lease = lease


def _text(value: str | BaseException) -> str:
    text = value if isinstance(value, str) else f"{type(value).__name__}: {value}"
    return scrub(text, max_length=MAX_ERROR)
