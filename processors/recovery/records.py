"""What the recovery worker's passes share: the operation a pass looks after
(:class:`Operation`), the one way each of its events is made and appended (:class:`Records`), and
:func:`guarded`, which keeps one operation's trouble its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from ledger.domain import ids
from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    ReconciliationDecided,
)
from ledger.domain.fold import Applied, ExecutionRecord, apply_control, apply_execution
from ledger.domain.policy import PolicyDecision
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.entropy import entropy
from ledger.errors import RecordError
from ledger.leases import Lease
from ledger.log import LogWriter, OutgoingRecord, Positions
from ledger.results import PreparedResult, ResultStore
from ledger.tools import LookupResult, Provider
from processors.recovery.texts import recordable

log = logging.getLogger("opledger.recovery")

#: Who the recovery worker's events say acted.
RECOVERY_WORKER = "recovery-worker"


class Operation:
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


def guarded(operation: Operation, work: Callable[[Operation], None]) -> None:
    """``work(operation)`` unless the operation already failed; what it raises stays with it."""
    if operation.failure is not None:
        return
    try:
        work(operation)
    except Exception as exc:
        operation.failure = exc


def event_id() -> str:
    """A new event's id."""
    return ids.event_id(time.time_ns() // 1_000_000, entropy(10))


class Records:
    """The events the recovery worker appends: each one built here, folded onto its operation,
    and sent at once or with the rest of the pass."""

    def __init__(self, log: LogWriter, results: ResultStore) -> None:
        self._log = log
        self._results = results

    def transition(
        self,
        operation: Operation,
        to: ExecutionState,
        *,
        error: str | None = None,
        result_ref: str | None = None,
        provider_ref: str | None = None,
        decided: ReconciliationDecided | None = None,
    ) -> ExecutionTransitioned:
        """The operation's step to ``to`` (``error`` made recordable), citing ``decided``."""
        execution = operation.execution
        attempt = execution.attempt + 1 if to is ExecutionState.DISPATCHED else execution.attempt
        return ExecutionTransitioned(
            event_id=event_id(),
            operation_id=execution.operation_id,
            tenant_id=execution.tenant_id,
            actor_id=RECOVERY_WORKER,
            occurred_at=datetime.now(UTC),
            attempt=attempt,
            state=to,
            tool_name=execution.tool_name,
            request_hash=execution.request_hash,
            provider_ref=provider_ref,
            result_ref=result_ref,
            error=None if error is None else recordable(error),
            lease_token=operation.lease.token,
            decision_id=None if decided is None else decided.event_id,
        )

    def decision(
        self,
        operation: Operation,
        decision: Decision,
        lookup: LookupStatus,
        policy: PolicyDecision,
        reason: str,
        *,
        provider_ref: str | None = None,
        result_ref: str | None = None,
    ) -> ReconciliationDecided:
        """The operation's ``decision``, with its evidence: the lookup, the policy, the reason."""
        execution = operation.execution
        return ReconciliationDecided(
            event_id=event_id(),
            operation_id=execution.operation_id,
            tenant_id=execution.tenant_id,
            actor_id=RECOVERY_WORKER,
            occurred_at=datetime.now(UTC),
            attempt=execution.attempt,
            lease_token=operation.lease.token,
            decision=decision,
            lookup=lookup,
            provider_ref=provider_ref,
            result_ref=result_ref,
            policy_version=policy.version,
            policy_allowed=policy.allowed,
            provider_repeat_safe=operation.provider.terms.repeat_safe,
            reason=recordable(reason),
        )

    def append(
        self, operation: Operation, events: Sequence[OperationEvent], *, now: bool = False
    ) -> None:
        """Fold ``events`` onto the operation (refusing to send what the fold would reject) and
        move the in-memory state on. The records are queued for the pass's one send, or, with
        ``now``, sent at once (after those the operation queued before) and acknowledged."""
        execution = operation.execution
        for event in events:
            outcome = (
                apply_execution(execution, event)
                if isinstance(event, ExecutionTransitioned)
                else apply_control(execution, event)  # type: ignore[arg-type]
            )
            if not isinstance(outcome, Applied):
                raise RecordError(f"{execution.operation_id}: refusing to append: {outcome}")
            execution = outcome.record
        records = [self._log.builder.record(e) for e in events]
        if now:
            self._results.put_many(operation.payloads)
            operation.payloads.clear()
            self._log.send([*operation.pending, *records])
            operation.pending.clear()
        else:
            operation.pending.extend(records)
        operation.execution = execution

    def send(self, events: Sequence[OperationEvent]) -> Positions:
        """Append ``events`` at once, acknowledged; returns where they were written."""
        return self._log.append(events)

    def send_pass(self, operations: Sequence[Operation]) -> int:
        """Append what every operation of the pass decided, in one acknowledged send (one wait
        instead of one per operation); returns how many operations were handled. Each
        operation's records keep their order, and whatever a decision points at (a recovered
        result) was committed before it was queued. Records that must be durable before a
        provider call were sent at once (``append(now=True)``)."""
        records = [record for operation in operations for record in operation.pending]
        try:
            self._results.put_many([p for operation in operations for p in operation.payloads])
            self._log.send(records)
        except RecordError as exc:
            # Some may have landed: a later pass reads the log again and decides from there.
            log.warning("a pass's decisions were not acknowledged; left for a later pass: %s", exc)
            return 0
        handled = 0
        for operation in operations:
            for counter in operation.counted:
                counter.inc()
            if operation.failure is None:
                handled += 1
        return handled
