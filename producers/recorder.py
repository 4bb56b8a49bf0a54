"""The recorder: what a service calls to record an operation's transitions.

Every call builds the next event, folds it with the domain rules *before* anything is sent
(an illegal transition raises and writes nothing; a repeat returns without a second record),
appends it keyed by ``operation_id`` and returns only after the broker acknowledged it. A worker
that records and then acknowledges its own job therefore never acknowledges an unrecorded step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Self

from pydantic import ValidationError

from ledger.codec import Codec, default_codec
from ledger.domain import ids
from ledger.domain.events import (
    MAX_ERROR_LENGTH,
    DeliveryTransitioned,
    ExecutionTransitioned,
    Transition,
)
from ledger.domain.redact import redact
from ledger.domain.states import (
    DELIVERY_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    DeliveryState,
    ExecutionState,
)
from ledger.faults import fault_point
from ledger.metrics import Metrics
from ledger.settings import Settings
from producers.errors import IllegalTransitionError, InvalidTransitionError, RecordError
from producers.operation import (
    OperationState,
    TrackedOperation,
    advance,
    as_aware,
    delivery_result_ref,
    next_delivery_attempt,
    next_execution_attempt,
)
from producers.results import ResultStore
from producers.transport import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    KafkaTransport,
    OutgoingRecord,
    Transport,
)

SCHEMA_HEADER = "opledger-schema"
TENANT_HEADER = "tenant_id"
_EXECUTION_SCHEMA = b"ExecutionTransitioned"
_DELIVERY_SCHEMA = b"DeliveryTransitioned"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Clock = Callable[[], int]
"""Nanoseconds since the epoch (``time.time_ns``)."""
Entropy = Callable[[int], bytes]
"""``n`` random bytes (``os.urandom``)."""


def clean_error(error: str | BaseException) -> str:
    """Error text safe to put in an event: credentials redacted, bounded length."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return redact(text)[:MAX_ERROR_LENGTH]


class TransitionRecorder:
    """Records execution and delivery transitions of operations, durably, in order.

    Build it with :meth:`connect` at the edge of a service; tests pass their own transport,
    clock and entropy. Thread-safe: calls on one operation are serialised by its handle.
    """

    def __init__(
        self,
        settings: Settings,
        transport: Transport,
        *,
        results: ResultStore | None = None,
        clock_ns: Clock = time.time_ns,
        entropy: Entropy = os.urandom,
        codec: Codec | None = None,
        metrics: Metrics | None = None,
        owns: Sequence[Transport | ResultStore] = (),
    ) -> None:
        self._settings = settings
        self._transport = transport
        self._results = results
        self._clock_ns = clock_ns
        self._entropy = entropy
        self._codec = codec or default_codec()
        self._metrics = metrics
        self._owned = list(owns)
        self._execution_topic = settings.execution_topic
        self._delivery_topic = settings.delivery_topic

    @classmethod
    def connect(
        cls,
        settings: Settings,
        *,
        with_results: bool = True,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        compression: str = "lz4",
        metrics: Metrics | None = None,
        wrap_transport: Callable[[Transport], Transport] | None = None,
    ) -> Self:
        """A recorder with its own Kafka producer and (optionally) result store at settings.dsn.

        The result store's migrations are applied here, so ``succeeded(result=bytes)`` works.
        ``wrap_transport`` interposes on every send (fault injection in the demo and tests).
        """
        transport: Transport = KafkaTransport(
            settings, delivery_timeout_s=delivery_timeout_s, compression=compression
        )
        if wrap_transport is not None:
            transport = wrap_transport(transport)
        results = None
        if with_results:
            results = ResultStore.connect(settings.dsn)
            results.migrate()
        owned: list[Transport | ResultStore] = [transport]
        if results is not None:
            owned.append(results)
        return cls(settings, transport, results=results, metrics=metrics, owns=owned)

    # -- execution ---------------------------------------------------------------------------

    def intent(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        operation_id: str | None = None,
    ) -> TrackedOperation:
        """Record INTENT_RECORDED for a new operation; returns its handle once acknowledged.

        ``operation_id`` defaults to a fresh ``op_`` ULID; pass one to record a known operation.
        Only the hash of ``arguments`` (canonical JSON) travels, never the arguments.
        """
        now_ns = self._clock_ns()
        if operation_id is None:
            operation_id = self.new_operation_id()
        try:
            request_hash = ids.request_hash(tool_name, arguments)
        except (TypeError, ValueError) as exc:
            raise InvalidTransitionError(f"arguments are not canonical JSON: {exc}") from exc
        event = self._build(
            ExecutionTransitioned,
            now_ns,
            operation_id=operation_id,
            tenant_id=tenant_id,
            actor_id=actor_id,
            attempt=0,
            state=ExecutionState.INTENT_RECORDED,
            tool_name=tool_name,
            request_hash=request_hash,
        )
        handle = TrackedOperation.unknown(operation_id)
        with handle.lock:
            self._record(handle, event)
        return handle

    def new_operation_id(self) -> str:
        """A fresh ``op_`` ULID from this recorder's clock and entropy.

        Take one before :meth:`intent` when the intent may have to be retried: a retry with the
        same id is recognised as a repeat, while a retry without it would start a new operation.
        """
        return ids.operation_id(self._clock_ns() // 1_000_000, self._entropy(10))

    def dispatched(
        self,
        handle: TrackedOperation,
        provider_ref: str | None = None,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """Record DISPATCHED (a new attempt, unless this dispatch was already recorded).

        Returns False when it was a repeat and nothing was sent.
        """
        return self._execution(
            handle, ExecutionState.DISPATCHED, actor_id, provider_ref=provider_ref
        )

    def succeeded(
        self,
        handle: TrackedOperation,
        result: bytes | str,
        *,
        content_type: str = "application/octet-stream",
        provider_ref: str | None = None,
        actor_id: str | None = None,
    ) -> bool:
        """Record SUCCEEDED. ``result`` is the payload (stored durably first, only its ref is
        sent) or an existing ``sha256:`` result ref."""
        if isinstance(result, bytes | bytearray | memoryview):
            payload: bytes | None = bytes(result)
            result_ref = ids.content_ref(bytes(result))
        else:
            payload, result_ref = None, result
        return self._execution(
            handle,
            ExecutionState.SUCCEEDED,
            actor_id,
            provider_ref=provider_ref,
            result_ref=result_ref,
            payload=payload,
            content_type=content_type,
        )

    def failed(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """Record FAILED: the provider confirmed the call did not happen / did not succeed."""
        return self._execution(handle, ExecutionState.FAILED, actor_id, error=clean_error(error))

    def unknown(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """Record UNKNOWN: contact was lost after dispatch; reconcile, never blind-retry."""
        return self._execution(handle, ExecutionState.UNKNOWN, actor_id, error=clean_error(error))

    # -- delivery ----------------------------------------------------------------------------

    def delivery_pending(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record that the result must be delivered to ``destination`` (PENDING, attempt 0)."""
        return self._delivery(handle, destination, DeliveryState.PENDING, actor_id, attempt=0)

    def delivery_sent(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record a send to ``destination`` (SENT, one more attempt)."""
        return self._delivery(handle, destination, DeliveryState.SENT, actor_id)

    def delivery_acked(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record that ``destination`` acknowledged receipt (ACKED)."""
        return self._delivery(handle, destination, DeliveryState.ACKED, actor_id)

    def delivery_retry(
        self,
        handle: TrackedOperation,
        destination: str,
        next_attempt_at: datetime,
        error: str | BaseException,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """Schedule another send of the *delivery* (SENT -> PENDING); never re-executes."""
        if destination not in handle.state.deliveries:
            raise IllegalTransitionError(f"no delivery to {destination} to retry")
        return self._delivery(
            handle,
            destination,
            DeliveryState.PENDING,
            actor_id,
            next_attempt_at=as_aware(next_attempt_at),
            error=clean_error(error),
        )

    def delivery_dead_lettered(
        self,
        handle: TrackedOperation,
        destination: str,
        error: str | BaseException,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """Give up on delivering to ``destination`` (DEAD_LETTERED), saying why."""
        return self._delivery(
            handle, destination, DeliveryState.DEAD_LETTERED, actor_id, error=clean_error(error)
        )

    # -- batches -----------------------------------------------------------------------------

    def append(
        self, events: Sequence[Transition], *, known: Iterable[TrackedOperation] = ()
    ) -> dict[str, TrackedOperation]:
        """Append many already-built events with one wait for all acknowledgements.

        Each event is folded, in order, onto its operation: the handle in ``known`` if given
        (updated after the ack), else an empty history, so an operation whose earlier events
        were appended by another call must be passed in ``known``. One illegal event refuses
        the whole batch before anything is sent; repeats are dropped. Returns the handles of
        every operation touched.
        """
        handles = {h.operation_id: h for h in known}
        with contextlib.ExitStack() as locks:
            # Sorted, so two batches sharing handles take their locks in the same order.
            for operation_id in sorted(handles):
                locks.enter_context(handles[operation_id].lock)
            working: dict[str, OperationState] = {}
            outgoing: list[OutgoingRecord] = []
            for index, event in enumerate(events):
                if not isinstance(event, ExecutionTransitioned | DeliveryTransitioned):
                    raise InvalidTransitionError(f"event {index} is a {type(event).__name__}")
                operation_id = event.operation_id
                state = working.get(operation_id)
                if state is None:
                    handle = handles.get(operation_id)
                    state = handle.state if handle else OperationState(operation_id)
                try:
                    advanced = advance(state, event)
                except IllegalTransitionError as exc:
                    raise IllegalTransitionError(
                        f"event {index} ({event.event_id}): {exc.reason}; nothing was sent"
                    ) from None
                if advanced is not None:
                    working[operation_id] = advanced
                    outgoing.append(self._outgoing(event))
            self._send(outgoing)
            touched: dict[str, TrackedOperation] = {}
            for operation_id, state in working.items():
                handle = handles.get(operation_id) or TrackedOperation(state)
                handle.commit(state)
                touched[operation_id] = handle
        return touched

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush queued records and close what this recorder opened."""
        for owned in self._owned:
            owned.close()
        self._owned.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _execution(
        self,
        handle: TrackedOperation,
        state: ExecutionState,
        actor_id: str | None,
        *,
        provider_ref: str | None = None,
        result_ref: str | None = None,
        error: str | None = None,
        payload: bytes | None = None,
        content_type: str = "application/octet-stream",
    ) -> bool:
        with handle.lock:
            current = handle.require_execution()
            if state is not current.state and state not in EXECUTION_TRANSITIONS[current.state]:
                # Checked before the event is built: the event model would otherwise refuse the
                # attempt number first, with a less useful message than the table's.
                raise IllegalTransitionError(
                    f"illegal execution transition {current.state} -> {state}"
                )
            if (
                state is ExecutionState.SUCCEEDED
                and current.state is ExecutionState.SUCCEEDED
                and result_ref != current.result_ref
            ):
                # The fold would call this a duplicate and silently keep the first result.
                raise IllegalTransitionError(
                    f"{current.operation_id} already SUCCEEDED with {current.result_ref}"
                )
            event = self._build(
                ExecutionTransitioned,
                self._clock_ns(),
                operation_id=current.operation_id,
                tenant_id=current.tenant_id,
                actor_id=actor_id or current.actor_id,
                attempt=next_execution_attempt(current, state),
                state=state,
                tool_name=current.tool_name,
                request_hash=current.request_hash,
                provider_ref=provider_ref,
                result_ref=result_ref,
                error=error,
            )
            advanced = advance(handle.state, event)
            if advanced is None:
                return False
            if payload is not None:
                # Durable before the event that points at it exists (and before the caller
                # acknowledges its job). A crash after this leaves an unreferenced row, which
                # a retried call stores again as a no-op.
                if self._results is None:
                    raise RecordError("succeeded(bytes) needs a result store; pass results=")
                self._results.put(current.tenant_id, payload, content_type)
                fault_point("producer.after_result_write_before_record")
            self._send([self._outgoing(event)])
            handle.commit(advanced)
            return True

    def _delivery(
        self,
        handle: TrackedOperation,
        destination: str,
        state: DeliveryState,
        actor_id: str | None,
        *,
        attempt: int | None = None,
        next_attempt_at: datetime | None = None,
        error: str | None = None,
    ) -> bool:
        with handle.lock:
            snapshot = handle.state
            current = snapshot.deliveries.get(destination)
            if (
                current is not None
                and state is not current.state
                and state not in DELIVERY_TRANSITIONS[current.state]
            ):
                raise IllegalTransitionError(
                    f"illegal delivery transition {current.state} -> {state} ({destination})"
                )
            owner = snapshot.execution or current
            if owner is None:
                raise IllegalTransitionError(
                    f"{handle.operation_id}: neither its execution nor a delivery to "
                    f"{destination} is known, so its tenant is not"
                )
            event = self._build(
                DeliveryTransitioned,
                self._clock_ns(),
                operation_id=handle.operation_id,
                tenant_id=owner.tenant_id,
                actor_id=actor_id or owner.actor_id,
                attempt=next_delivery_attempt(current, state) if attempt is None else attempt,
                destination=destination,
                state=state,
                result_ref=delivery_result_ref(snapshot) or (current and current.result_ref),
                next_attempt_at=next_attempt_at,
                error=error,
            )
            advanced = advance(snapshot, event)
            if advanced is None:
                return False
            self._send([self._outgoing(event)])
            handle.commit(advanced)
            return True

    def _record(self, handle: TrackedOperation, event: Transition) -> bool:
        advanced = advance(handle.state, event)
        if advanced is None:
            return False
        self._send([self._outgoing(event)])
        handle.commit(advanced)
        return True

    def _build(
        self,
        model: type[ExecutionTransitioned] | type[DeliveryTransitioned],
        now_ns: int,
        **fields: Any,
    ) -> Transition:
        try:
            return model(
                event_id=ids.event_id(now_ns // 1_000_000, self._entropy(10)),
                occurred_at=_EPOCH + timedelta(microseconds=now_ns // 1000),
                **fields,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:3]
            )
            raise InvalidTransitionError(f"invalid {model.__name__}: {problems}") from None

    def _outgoing(self, event: Transition) -> OutgoingRecord:
        if isinstance(event, ExecutionTransitioned):
            topic, schema = self._execution_topic, _EXECUTION_SCHEMA
        else:
            topic, schema = self._delivery_topic, _DELIVERY_SCHEMA
        return OutgoingRecord(
            topic,
            event.operation_id.encode("ascii"),
            self._codec.encode(event),
            [(SCHEMA_HEADER, schema), (TENANT_HEADER, event.tenant_id.encode("utf-8"))],
        )

    def _send(self, records: list[OutgoingRecord]) -> None:
        if not records:
            return
        started = time.monotonic()
        self._transport.send(records)
        if self._metrics is not None:
            self._metrics.append_seconds.observe(time.monotonic() - started)
            executions = sum(1 for r in records if r.topic == self._execution_topic)
            if executions:
                self._metrics.records_appended.labels(machine="execution").inc(executions)
            if len(records) - executions:
                self._metrics.records_appended.labels(machine="delivery").inc(
                    len(records) - executions
                )
