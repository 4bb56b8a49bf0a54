"""Policy as it is now, read for the operations a pass is about to decide (seed rule 3): once per
subject for a group, right before its decisions, and never under a view that may lack a
revocation (decision 022)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.reconcile import LookupStatus
from ledger.domain.states import ExecutionState
from ledger.policy_store import PolicyFreshness, PolicyViewStaleError
from ledger.settings import Settings
from processors.recovery.records import Operation

#: Policy for a batch of requests, decisions in the same order (``PolicyStore.evaluate_many``).
PolicyCheck = Callable[[Sequence[PolicyRequest]], list[PolicyDecision]]

#: The states whose next step policy decides: a resume, or a reconciliation.
_DECIDING = (ExecutionState.INTENT_RECORDED, ExecutionState.UNKNOWN)


class CurrentPolicy:
    """Reads policy for a group of operations through ``policy``, if the view is fresh."""

    def __init__(self, settings: Settings, policy: PolicyCheck) -> None:
        self._policy = policy
        self._freshness = PolicyFreshness(settings)

    def close(self) -> None:
        self._freshness.close()

    def read(self, operations: Sequence[Operation]) -> None:
        """Policy as it is now for every operation about to be decided, in one read per
        subject; when it cannot be read, none of them is decided in this pass."""
        asking = [s for s in operations if s.failure is None and s.execution.state in _DECIDING]
        if not asking:
            return
        try:
            # A view that may lack a revocation decides nothing: held for a later pass, like an
            # unreadable one, rather than resumed or attempted again under it (decision 022).
            stale = self._freshness.stale_reason()
            if stale is not None:
                raise PolicyViewStaleError(stale)
            decisions = self._policy([_request(s) for s in asking])
        except Exception as exc:
            for state in asking:
                state.failure = exc
            return
        for state, decision in zip(asking, decisions, strict=True):
            state.policy = decision


def _request(operation: Operation) -> PolicyRequest:
    execution = operation.execution
    purpose = (
        Purpose.NEW_ATTEMPT
        if execution.state is ExecutionState.UNKNOWN and operation.lookup is LookupStatus.NOT_FOUND
        else Purpose.DISPATCH
    )
    return PolicyRequest(
        tenant_id=execution.tenant_id,
        actor_id=execution.actor_id,
        tool_name=execution.tool_name,
        purpose=purpose,
        now=datetime.now(UTC),
        required_scope=operation.provider.terms.required_scope,
        cancelled=execution.cancelled,
    )
