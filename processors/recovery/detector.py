"""The detector pass: which of this worker's operations are unfinished with their owner gone, and
taking them over (decision 006).

The candidates are read from the projection (not finished, not parked, lease expired, on the
partitions the group gave this worker), the due ones checked against the log's tail (the
projection may lag it), and their leases taken in one statement, each take-over recorded (new
lease token, one acknowledged send) and each operation's history read up to that record. A
DISPATCHED attempt whose owner went away longer ago than the tool's call timeout is then recorded
UNKNOWN, with why (:meth:`Detector.detect`), for the reconcile pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger.domain.events import OwnershipTaken
from ledger.domain.states import ExecutionState
from ledger.history import HistoryReader, Snapshot, View
from ledger.leases import MAX_TOKEN, Lease, LeaseStore
from ledger.metrics import Metrics
from ledger.pg import retrying
from ledger.settings import Settings
from ledger.tools import Provider
from processors.recovery.lookups import Backoff
from processors.recovery.records import RECOVERY_WORKER, Operation, Records, event_id
from processors.recovery.texts import said

log = logging.getLogger("opledger.recovery")

#: Operations handled per pass (a pass takes their leases in one statement).
BATCH = 500
#: The lease a worker takes for an operation: long enough for a provider call and its record.
LEASE_MARGIN = timedelta(seconds=10)

#: The states an owner can leave behind unfinished.
_UNFINISHED = (ExecutionState.INTENT_RECORDED, ExecutionState.DISPATCHED, ExecutionState.UNKNOWN)

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


@dataclass(frozen=True, slots=True)
class Candidate:
    """An operation the projection shows unfinished with no live lease."""

    operation_id: str
    tenant_id: str
    state: ExecutionState
    tool_name: str
    state_entered_at: datetime
    attempt: int
    #: the token of its lease row, if it has one
    lease_token: int | None = None


class Detector:
    """Finds the operations due for recovery on given partitions and takes them over."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool[Any],
        history: HistoryReader,
        leases: LeaseStore,
        providers: Mapping[str, Provider],
        records: Records,
        metrics: Metrics,
        backoff: Backoff,
        in_lookup: Callable[[str], bool],
    ) -> None:
        self._unleased_grace = timedelta(seconds=settings.recovery_unleased_grace_s)
        self._pool = pool
        self._history = history
        self._leases = leases
        self._providers = providers
        self._records = records
        self._metrics = metrics
        self._backoff = backoff
        self._in_lookup = in_lookup
        self._warned_tools: set[str] = set()
        self._warned_tokens: set[str] = set()

    def take_over(self, partitions: Sequence[int]) -> tuple[list[Operation], list[Lease]]:
        """The operations of ``partitions`` due now, taken over and read up to their take-over
        records, and the leases taken (to release once the pass has recorded its decisions)."""
        due, view = self._still_due(self._due(self._candidates(partitions)))
        if not due:
            return [], []
        taken, claimed = self._claim(due)
        if not taken:
            return [], []
        snapshots = self._load(view, taken, claimed)
        operations = []
        for op_id, lease in taken.items():
            snapshot = snapshots.get(op_id)
            if snapshot is None or snapshot.execution is None:
                continue
            if snapshot.execution.lease_token != lease.token:
                continue  # another process claimed it after us
            provider = self._providers[snapshot.execution.tool_name]
            operations.append(Operation(snapshot.execution, lease, provider))
        return operations, list(taken.values())

    def detect(self, operation: Operation) -> None:
        """DISPATCHED longer than the call timeout with its owner gone: UNKNOWN, with why."""
        if operation.execution.state is not ExecutionState.DISPATCHED:
            return
        reason = (
            f"no outcome within the tool's {operation.provider.terms.call_timeout} call timeout "
            "and its owner went away (lease expired): the call may or may not have happened"
        )
        unknown = self._records.transition(operation, ExecutionState.UNKNOWN, error=reason)
        self._records.append(operation, [unknown])
        operation.counted.append(self._metrics.detector_transitions)

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
                and candidate.state is ExecutionState.INTENT_RECORDED
                and now - candidate.state_entered_at < self._unleased_grace
            ):
                # Its writer may still be committing the lease and the request (a database
                # restart under it); taken over now, the intent could only be parked.
                continue
            if self._backoff.waiting(candidate.operation_id, monotonic):
                continue
            if self._in_lookup(candidate.operation_id):
                continue  # its provider has not answered an earlier lookup yet
            if (
                candidate.state is ExecutionState.DISPATCHED
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
            if execution.state not in _UNFINISHED:
                continue
            still.append(candidate)
        return still, view

    def _claim(
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
                        event_id=event_id(),
                        operation_id=op_id,
                        tenant_id=lease.tenant_id,
                        actor_id=RECOVERY_WORKER,
                        occurred_at=datetime.now(UTC),
                        attempt=by_id[op_id].attempt,
                        lease_token=lease.token,
                        reason=f"took over {by_id[op_id].state}: the previous lease expired",
                    )
                )
            except ValueError as exc:  # one operation's row never stops the others
                log.error("%s: its take-over cannot be recorded: %s", op_id, said(exc))
                unclaimable.append(lease)
        if unclaimable:
            self._leases.release(unclaimable)
            for lease in unclaimable:
                del taken[lease.operation_id]
            if not taken:
                return {}, []
        claimed = self._records.send(claims)
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
