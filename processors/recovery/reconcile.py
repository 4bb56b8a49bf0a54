"""The reconcile pass: an UNKNOWN attempt decided from what its provider says and policy as it is
now (``ledger.domain.reconcile.decide``): what the provider says happened is recorded (a recovered
result stored first, seed row 3); a new attempt only when policy explicitly allows it and the key
is within the provider's retention; a parked or refused operation otherwise; and never a call
while the provider cannot be asked (backed off, retried by a later pass)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from ledger.domain.call import recordable_content_type
from ledger.domain.events import recordable_provider_ref
from ledger.domain.fold import ExecutionRecord
from ledger.domain.reconcile import Decision, Verdict, decide
from ledger.domain.states import ExecutionState
from ledger.metrics import Metrics
from ledger.results import MAX_RESULT_BYTES, ResultStore
from processors.recovery.lookups import Backoff
from processors.recovery.records import Operation, Records

#: How far ahead of this worker's clock an attempt may be stamped (writers' clocks differ a
#: little) before its age, on which a new attempt depends, is not believed.
CLOCK_SKEW_TOLERANCE = timedelta(seconds=60)


class Reconcile:
    """Decides each UNKNOWN attempt of a pass, and readies the new attempts it permits."""

    def __init__(
        self, *, records: Records, results: ResultStore, metrics: Metrics, backoff: Backoff
    ) -> None:
        self._records = records
        self._results = results
        self._metrics = metrics
        self._backoff = backoff

    def decide(self, operation: Operation) -> None:
        """Record the verdict on the operation's UNKNOWN attempt, or mark it for a new attempt
        once its stored request is read."""
        records = self._records
        execution = operation.execution
        lookup_status, found, policy = operation.lookup, operation.found, operation.policy
        assert lookup_status is not None and policy is not None
        now = datetime.now(UTC)
        dispatched_at = (
            execution.state_entered_at
            if execution.state is not ExecutionState.UNKNOWN
            else _dispatched_at(execution)
        )
        retention = operation.provider.terms.key_retention
        verdict = decide(
            lookup_status,
            policy,
            dispatched_at=dispatched_at,
            now=now,
            key_retention=retention,
            provider_repeat_safe=operation.provider.terms.repeat_safe,
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
            self._backoff.back_off(execution.operation_id)
            if execution.decision is not Decision.RETRY_LOOKUP:
                # Recorded once per stretch of unavailability, not at every retry.
                records.append(
                    operation,
                    [
                        records.decision(
                            operation, verdict.decision, lookup_status, policy, verdict.reason
                        )
                    ],
                )
            operation.counted.append(self._metrics.reconciliations.labels("retry_lookup"))
            return
        self._backoff.clear(execution.operation_id)
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
                records.append(
                    operation,
                    [records.decision(operation, Decision.PARK, lookup_status, policy, reason)],
                )
                operation.counted.append(self._metrics.reconciliations.labels("parked"))
                return
            # The recovered result is durable before anything points at it (seed row 3): it is
            # stored with the pass's other results, in one commit, before any record is sent.
            prepared = self._results.prepare(
                execution.tenant_id, result, recordable_content_type(found.content_type)
            )
            operation.payloads.append(prepared)
            result_ref = prepared.result_ref
            decided = records.decision(
                operation, verdict.decision, lookup_status, policy, verdict.reason,
                provider_ref=provider_ref, result_ref=result_ref,
            )  # fmt: skip
            records.append(
                operation,
                [
                    decided,
                    records.transition(
                        operation,
                        ExecutionState.SUCCEEDED,
                        result_ref=result_ref,
                        provider_ref=provider_ref,
                        decided=decided,
                    ),
                ],
            )
            operation.counted.append(self._metrics.reconciliations.labels("succeeded"))
        elif verdict.decision is Decision.MARK_FAILED:
            reason = (found.reason if found else None) or "the provider reports the call failed"
            decided = records.decision(
                operation, verdict.decision, lookup_status, policy, verdict.reason,
                provider_ref=provider_ref,
            )  # fmt: skip
            failed = records.transition(
                operation, ExecutionState.FAILED, error=reason, decided=decided
            )
            records.append(operation, [decided, failed])
            operation.counted.append(self._metrics.reconciliations.labels("failed"))
        elif verdict.decision is Decision.NEW_ATTEMPT:
            operation.wants_call = Decision.NEW_ATTEMPT  # once its stored request is read
            operation.verdict_reason = verdict.reason
        else:  # PARK or REFUSE: a person decides
            records.append(
                operation,
                [
                    records.decision(
                        operation, verdict.decision, lookup_status, policy, verdict.reason
                    )
                ],
            )
            outcome = "parked" if verdict.decision is Decision.PARK else "refused"
            operation.counted.append(self._metrics.reconciliations.labels(outcome))

    def prepare(self, operation: Operation) -> None:
        """The decision to attempt the call again, with its stored request; parked if it has
        none."""
        policy, lookup = operation.policy, operation.lookup
        assert policy is not None and lookup is not None
        body = operation.stored_request
        if body is None:
            parked = self._records.decision(
                operation,
                Decision.PARK,
                lookup,
                policy,
                "a new attempt is allowed, but the request was never stored",
            )
            self._records.append(operation, [parked])
            operation.counted.append(self._metrics.reconciliations.labels("parked"))
            return
        operation.counted.append(self._metrics.reconciliations.labels("new_attempt"))
        operation.request = json.loads(body)
        operation.decided = self._records.decision(
            operation, Decision.NEW_ATTEMPT, lookup, policy, operation.verdict_reason
        )


def _dispatched_at(execution: ExecutionRecord) -> datetime:
    # The record keeps when UNKNOWN was entered, not when the attempt was dispatched; the
    # difference is at most the call timeout, which is small next to any key retention.
    return execution.state_entered_at
