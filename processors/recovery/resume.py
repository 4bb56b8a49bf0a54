"""The resume pass: an intent whose owner went away before dispatching (no provider call
happened) is dispatched once, with its stored request, if policy allows it now (seed row 1);
refused (FAILED, with the policy's reason) otherwise, and parked when its request was never
stored."""

from __future__ import annotations

import json

from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.metrics import Metrics
from processors.recovery.records import Operation, Records


class Resume:
    """Decides each orphaned intent of a pass, and readies the calls it permits."""

    def __init__(self, *, records: Records, metrics: Metrics) -> None:
        self._records = records
        self._metrics = metrics

    def decide(self, operation: Operation) -> None:
        """Refuse the intent, or mark it for a call once its stored request is read."""
        decision = operation.policy
        assert decision is not None
        if not decision.allowed:
            decided = self._records.decision(
                operation, Decision.REFUSE, LookupStatus.NOT_LOOKED_UP, decision, decision.reason
            )
            reason = f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
            failed = self._records.transition(
                operation, ExecutionState.FAILED, error=reason, decided=decided
            )
            self._records.append(operation, [decided, failed])
            operation.counted.append(self._metrics.resumed.labels("refused"))
            return
        operation.wants_call = Decision.RESUME  # once its stored request is read

    def prepare(self, operation: Operation) -> None:
        """The decision to dispatch it, with its stored request; parked if it has none."""
        policy = operation.policy
        assert policy is not None
        body = operation.stored_request
        if body is None:
            decided = self._records.decision(
                operation,
                Decision.PARK,
                LookupStatus.NOT_LOOKED_UP,
                policy,
                "the intent's request was never stored (recorded without a lease store, "
                "or its lease and request failed to commit while the intent was sent): "
                "it cannot be dispatched by anyone but its owner",
            )
            self._records.append(operation, [decided])
            return
        operation.request = json.loads(body)
        operation.decided = self._records.decision(
            operation,
            Decision.RESUME,
            LookupStatus.NOT_LOOKED_UP,
            policy,
            "the owner went away before dispatching: no call was made; dispatching it once",
        )
