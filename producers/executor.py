"""The reference executor: how a service should run one tool call and deliver its result,
recording every step through the SDK.

    intent -> dispatched(provider_ref = idempotency key) -> provider.call
        -> succeeded(result) | failed(error) | unknown(error)
    then, for SUCCEEDED only, per destination:
        delivery_pending -> delivery_sent -> destination.deliver
        -> delivery_acked | delivery_retry (SENT -> PENDING) ... | delivery_dead_lettered

Two rules from the seed shape it. An outcome that is not *confirmed* (lost response, any
unexpected error after dispatch) is recorded UNKNOWN and the call is never repeated here: only
reconciliation may decide. And a delivery that fails is retried as a delivery, with the stored
result: nothing on the delivery path can reach the provider.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from ledger.domain.ids import idempotency_key
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import DeliveryTimeoutError
from producers.operation import TrackedOperation
from producers.provider import Destination, ToolProvider
from producers.recorder import TransitionRecorder, clean_error

T = TypeVar("T")
log = logging.getLogger("opledger.executor")


def exponential_backoff(attempt: int) -> timedelta:
    """1 s, 2 s, 4 s ... capped at 5 minutes: the delay before delivery attempt ``attempt + 1``."""
    return timedelta(seconds=min(2 ** (attempt - 1), 300))


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """What one :meth:`Executor.execute` did, as the executor saw it."""

    operation_id: str
    tenant_id: str
    state: ExecutionState
    provider_calls: int
    #: destination -> final delivery state (empty unless SUCCEEDED)
    deliveries: dict[str, DeliveryState] = field(default_factory=dict)
    #: destination -> sends made
    delivery_attempts: dict[str, int] = field(default_factory=dict)


class Executor:
    """Runs tool calls exactly as the ledger expects, through one :class:`TransitionRecorder`.

    ``destinations`` maps each destination name (as recorded) to what delivers to it.
    ``max_delivery_attempts`` sends are made before a delivery is dead-lettered; between them the
    executor waits ``backoff(attempt)`` through ``sleep`` (pass ``lambda _s: None`` to retry at
    once, as the demo does; the recorded ``next_attempt_at`` still says when it was due).
    """

    def __init__(
        self,
        recorder: TransitionRecorder,
        provider: ToolProvider,
        destinations: Mapping[str, Destination],
        *,
        max_delivery_attempts: int = 3,
        record_retries: int = 2,
        backoff: Callable[[int], timedelta] = exponential_backoff,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if max_delivery_attempts < 1:
            raise ValueError("max_delivery_attempts must be at least 1")
        self._recorder = recorder
        self._provider = provider
        self._destinations = dict(destinations)
        self._max_attempts = max_delivery_attempts
        self._record_retries = record_retries
        self._backoff = backoff
        self._sleep = sleep
        self._clock = clock

    def execute(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        destinations: Sequence[str],
    ) -> ExecutionReport:
        """Record, dispatch and (if it succeeded) deliver one tool call.

        Raises :class:`producers.RecordError` when a step could not be recorded; steps after it
        are not taken (a dispatch that was not recorded is never sent to the provider).
        """
        unknown = [d for d in destinations if d not in self._destinations]
        if unknown:
            # Checked before the intent: a typo must not leave a SUCCEEDED operation whose
            # result can never be delivered.
            raise ValueError(f"no destination configured for {', '.join(unknown)}")
        # The id is fixed before the first try, so a retried intent repeats this operation
        # instead of starting a second one.
        operation_id = self._recorder.new_operation_id()
        handle = self._record(
            self._recorder.intent, tenant_id, actor_id, tool_name, arguments, operation_id
        )
        key = idempotency_key(handle.operation_id)
        # Recorded (acknowledged by the broker) before the call: a crash between the two leaves
        # DISPATCHED without a call, which reconciliation resolves by looking the key up.
        self._record(self._recorder.dispatched, handle, provider_ref=key)
        calls = 1  # counted before the call: a call that raises was still made
        try:
            response = self._provider.call(tool_name, arguments, key)
        except Exception as exc:  # any unconfirmed outcome is UNKNOWN, by design
            # ResponseLost or anything else after dispatch: the side effect may have happened.
            # Never retry here; reconciliation looks the key up with the provider.
            self._record(self._recorder.unknown, handle, exc)
            return self._report(handle, ExecutionState.UNKNOWN, calls)
        if not response.succeeded:
            self._record(
                self._recorder.failed, handle, response.error or "provider reported failure"
            )
            return self._report(handle, ExecutionState.FAILED, calls)
        if response.result is None:
            # A success without a result cannot be delivered; record that it happened anyway.
            result: bytes = b""
        else:
            result = response.result
        self._record(self._recorder.succeeded, handle, result, content_type=response.content_type)
        for destination in destinations:
            self.deliver(handle, destination)
        return self._report(handle, ExecutionState.SUCCEEDED, calls)

    def deliver(self, handle: TrackedOperation, destination: str) -> DeliveryState:
        """Deliver the stored result of a SUCCEEDED operation to ``destination``.

        Retries the *delivery* (never the execution) until acknowledged or
        ``max_delivery_attempts`` sends were made, then dead-letters it.
        """
        execution = handle.require_execution()
        if execution.state is not ExecutionState.SUCCEEDED or execution.result_ref is None:
            raise ValueError(f"{handle.operation_id} has no result to deliver ({execution.state})")
        target = self._destinations[destination]
        if destination not in handle.deliveries:
            self._record(self._recorder.delivery_pending, handle, destination)
        while True:
            self._record(self._recorder.delivery_sent, handle, destination)
            attempt = handle.deliveries[destination].attempts
            try:
                receipt = target.deliver(handle.operation_id, execution.result_ref)
                error = None if receipt.accepted else f"HTTP {receipt.status} from {destination}"
            except Exception as exc:  # any failed send is retried as a delivery
                error = clean_error(exc)
            if error is None:
                self._record(self._recorder.delivery_acked, handle, destination)
                return DeliveryState.ACKED
            if attempt >= self._max_attempts:
                self._record(
                    self._recorder.delivery_dead_lettered,
                    handle,
                    destination,
                    f"gave up after {attempt} attempts: {error}",
                )
                return DeliveryState.DEAD_LETTERED
            delay = self._backoff(attempt)
            self._record(
                self._recorder.delivery_retry, handle, destination, self._clock() + delay, error
            )
            self._sleep(delay.total_seconds())

    def _record(self, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Take one recording step; when the broker's acknowledgement timed out, resend the very
        same event (same event id) until it is acknowledged or the retries run out.

        The record may well be durable already (the ack, not the write, was lost): the repeat is
        then recognised by its event id and counted as a duplicate, never applied twice. A new
        event built instead could contradict what is already written, so the handle refuses it.
        """
        try:
            return step(*args, **kwargs)
        except DeliveryTimeoutError as exc:
            failure = exc
        for attempt in range(self._record_retries):
            log.info(
                "acknowledgement timed out (%s, try %d); resending the same event",
                getattr(step, "__name__", "step"),
                attempt + 1,
            )
            handle = failure.handle
            try:
                self._recorder.resend(handle)
            except DeliveryTimeoutError as exc:
                failure = exc
                continue
            # intent() returns the new handle; every other step returns True once recorded.
            return cast(T, handle if step == self._recorder.intent else True)
        raise failure

    @staticmethod
    def _report(handle: TrackedOperation, state: ExecutionState, calls: int) -> ExecutionReport:
        deliveries = handle.deliveries
        return ExecutionReport(
            operation_id=handle.operation_id,
            tenant_id=handle.require_execution().tenant_id,
            state=state,
            provider_calls=calls,
            deliveries={d: r.state for d, r in deliveries.items()},
            delivery_attempts={d: r.attempts for d, r in deliveries.items()},
        )
