"""The judge pass: each answer to a send becomes its delivery's next step (decision 010).

The pure ``ledger.domain.delivery.judge`` says ACKED, PENDING again with a backoff (a throttling
destination is paused on this worker), or DEAD_LETTERED; a send that never left for want of a
connection after all is PENDING again at once, its verdict not an attempt's (decision 026). A 410
also disables the destination: its later deliveries are dead-lettered, it said it is gone. A
webhook whose address is in a refused network (loopback, private, link-local, ...: decision 019)
was never connected to: its delivery is dead-lettered with the rule, and the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from ledger.destinations import DestinationStore
from ledger.domain import delivery
from ledger.domain.delivery import DELIVERY_WORKER, Outcome, SendResult, Verdict
from ledger.domain.events import DeliveryTransitioned
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState
from ledger.faults import fault_point
from ledger.metrics import Metrics
from processors.delivery.records import Item, Outcomes, Records, event
from processors.delivery.senders import AddressRefused
from processors.delivery.sending import InFlight

log = logging.getLogger("opledger.delivery")


class Pause(Protocol):
    """Send nothing to ``destination`` of ``tenant`` before ``until`` (it throttles)."""

    def __call__(
        self, tenant: str, destination: str, until: datetime, *, now: datetime
    ) -> None: ...


class Judge:
    """Records the outcome of each send of a pass, once all are answered."""

    def __init__(
        self,
        *,
        destinations: DestinationStore,
        records: Records,
        outcomes: Outcomes,
        metrics: Metrics,
        retry: RetryPolicy,
        unit_random: Callable[[], float],
        pause: Pause,
    ) -> None:
        self._destinations = destinations
        self._records = records
        self._outcomes = outcomes
        self._metrics = metrics
        self._retry = retry
        self._random = unit_random
        self._pause = pause
        self._latencies: dict[str, Any] = {}

    def record(self, in_flight: InFlight) -> None:
        """Wait for the sends ``in_flight`` and record each one's outcome (after the send,
        always: a crash before this leaves SENTs that are sent again once stale)."""
        sends = in_flight.items
        results = in_flight.results()
        fault_point("deliver.after_send_before_ack")
        after = datetime.now(UTC)
        verdicts = [
            # An address the guard refuses is refused at every send until it is allowed: a
            # lasting failure, dead-lettered at once (like a 413), for a redrive after that.
            Verdict(Outcome.DEAD_LETTERED, reason=result.detail)
            if isinstance(result, AddressRefused)
            else delivery.judge(
                result,
                round_attempts=item.record.round_attempts,
                round_start=item.record.round_start,
                now=after,
                policy=self._retry,
                unit_random=self._random(),
            )
            for item, result in zip(sends, results, strict=True)
        ]
        self._log_refused(sends, results)
        self._disable_gone(sends, verdicts)
        finals: list[DeliveryTransitioned] = []
        for item, verdict in zip(sends, verdicts, strict=True):
            finals.append(self._verdict_event(item, verdict, after))
            if verdict.outcome is Outcome.THROTTLED and verdict.next_attempt_at is not None:
                record = item.record
                self._pause(
                    record.tenant_id, record.destination, verdict.next_attempt_at, now=after
                )
        self._records.append(finals)
        for item, final, verdict in zip(sends, finals, verdicts, strict=True):
            item.record = self._records.applied(item.record, final, item.execution)
            destination = item.record.destination
            self._outcomes.count(destination, verdict.outcome.value)
            if verdict.outcome is Outcome.ACKED:
                self._ack_latency(destination).observe(
                    max((after - item.execution.state_entered_at).total_seconds(), 0.0)
                )

    def _ack_latency(self, destination: str) -> Any:
        child = self._latencies.get(destination)
        if child is None:
            child = self._metrics.confirmation_to_ack_seconds.labels(destination)
            self._latencies[destination] = child
        return child

    def _log_refused(self, sends: Sequence[Item], results: Sequence[SendResult]) -> None:
        refused = {
            (i.record.tenant_id, i.record.destination): r.detail
            for i, r in zip(sends, results, strict=True)
            if isinstance(r, AddressRefused)
        }
        for (tenant, name), reason in refused.items():
            log.warning("destination %s of tenant %s not connected to: %s", name, tenant, reason)

    def _disable_gone(self, sends: Sequence[Item], verdicts: Sequence[Verdict]) -> None:
        gone = {
            (i.record.tenant_id, i.record.destination): v.reason
            for i, v in zip(sends, verdicts, strict=True)
            if v.outcome is Outcome.DISABLED
        }
        for (tenant, name), reason in gone.items():
            self._destinations.set_enabled(
                tenant, name, enabled=False, changed_by=DELIVERY_WORKER, reason=reason, gone=True
            )
            log.warning("destination %s of tenant %s disabled: %s", name, tenant, reason)

    def _verdict_event(self, item: Item, verdict: Verdict, now: datetime) -> DeliveryTransitioned:
        record = item.record
        if verdict.outcome is Outcome.ACKED:
            return event(record, DeliveryState.ACKED, record.attempts, now)
        if verdict.outcome in (Outcome.RETRY, Outcome.THROTTLED, Outcome.NOT_SENT):
            return event(
                record,
                DeliveryState.PENDING,
                record.attempts,
                now,
                verdict.reason,
                next_attempt_at=verdict.next_attempt_at,
            )
        return event(record, DeliveryState.DEAD_LETTERED, record.attempts, now, verdict.reason)
