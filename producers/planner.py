"""Planning a recorder's appends, before any I/O: building each event (with the recorder's
clock and entropy), folding it onto its handle with the domain rules, and the :class:`Plan` of
what one call will store and send. Shared by the threaded and the asyncio recorder and by the
steps of ``execute`` (``producers.execution``); it imports no other recorder module, so the
SDK's imports run one way: recorder -> execution -> planner, steps, operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from ledger.domain import ids
from ledger.domain.events import (
    MAX_ERROR_LENGTH,
    DeliveryTransitioned,
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
    Transition,
)
from ledger.domain.states import (
    DELIVERY_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    DeliveryState,
    ExecutionState,
)
from ledger.errors import (
    ConflictError,
    IllegalTransitionError,
    InDoubtError,
    InvalidTransitionError,
    LeaseLostError,
)
from ledger.leases import MAX_REQUEST_BYTES
from ledger.log import OutgoingRecord, RecordBuilder
from ledger.secrets import scrub
from producers.operation import (
    InDoubt,
    OperationState,
    TrackedOperation,
    advance,
    delivery_result_ref,
    next_delivery_attempt,
    next_execution_attempt,
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Clock = Callable[[], int]
"""Nanoseconds since the epoch (``time.time_ns``)."""
Entropy = Callable[[int], bytes]
"""``n`` random bytes (``ledger.entropy``: the kernel's, a block at a time)."""

#: A new operation's first lease token.
FIRST_TOKEN = 1


def canonical_request(tool_name: str, arguments: Any) -> tuple[bytes, str]:
    """The stored request (canonical JSON of the arguments) and its hash, or a clear error."""
    try:
        request = ids.canonical_json(arguments)
        request_hash = ids.request_hash(tool_name, arguments)
    except RecursionError:
        # Not a ValueError: it would escape as a crash of the SDK rather than a refusal.
        raise InvalidTransitionError(
            "arguments are nested too deeply to be stored as JSON: flatten them; nothing was sent"
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidTransitionError(
            f"arguments are not canonical JSON ({exc}): pass JSON-serialisable values "
            "without NaN or infinity; nothing was sent"
        ) from exc
    if len(request) > MAX_REQUEST_BYTES:
        # Checked here, not only by the lease store: for a fresh id the lease is taken while the
        # intent is in flight, so a refusal there would come after the intent was written.
        raise InvalidTransitionError(
            f"arguments are {len(request)} bytes as JSON, over the {MAX_REQUEST_BYTES} a request "
            "may be: pass a reference to large content instead; nothing was sent"
        )
    return request, request_hash


def hashed_request(tool_name: str, arguments: Any) -> str:
    """The hash an intent records for ``arguments`` (see :func:`canonical_request`)."""
    return canonical_request(tool_name, arguments)[1]


def clean_error(error: str | BaseException) -> str:
    """Error text safe to put in an event: credentials redacted (detect-secrets and the
    contract's own shapes), bounded length (cut without splitting a placeholder)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return scrub(text, max_length=MAX_ERROR_LENGTH)


@dataclass(frozen=True, slots=True)
class PlanPart:
    """What one call appends for one operation."""

    handle: TrackedOperation
    pending: InDoubt


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one call will do, decided before any I/O: the payload to store first (tenant,
    bytes, content type), then the records to append, per handle."""

    parts: tuple[PlanPart, ...]
    payload: tuple[str, bytes, str] | None = None

    @property
    def records(self) -> list[OutgoingRecord]:
        return [record for part in self.parts for record in part.pending.records]


class Planner:
    """Builds a recorder's events (ids and times from its clock and entropy) and plans its
    appends: each public step of the recorder, and each step of ``execute``, is planned here
    (called with the handles' locks held), and nothing here does I/O."""

    __slots__ = ("_clock_ns", "_entropy", "_records")

    def __init__(self, records: RecordBuilder, clock_ns: Clock, entropy: Entropy) -> None:
        self._records = records
        self._clock_ns = clock_ns
        self._entropy = entropy

    def new_operation_id(self) -> str:
        """A fresh ``op_`` ULID from the clock and entropy."""
        return ids.operation_id(self._clock_ns() // 1_000_000, self._entropy(10))

    def new_event_id(self) -> str:
        """A fresh event id from the clock and entropy (for an event built by hand)."""
        return ids.event_id(self._clock_ns() // 1_000_000, self._entropy(10))

    def step(
        self,
        handle: TrackedOperation,
        state: ExecutionState,
        *,
        provider_ref: str | None = None,
        result: bytes | None = None,
        content_type: str = "application/octet-stream",
        error: str | BaseException | None = None,
    ) -> Callable[[], Plan | None]:
        """The planner of one execution step on ``handle``, as the public methods plan it."""
        cleaned = None if error is None else clean_error(error)
        return lambda: self.plan_execution(
            handle,
            state,
            None,
            provider_ref=provider_ref,
            result=result,
            content_type=content_type,
            error=cleaned,
        )

    # -- planners (called with the handles' locks held) ---------------------------------------

    def intent_event(
        self,
        operation_id: str,
        *,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        request_hash: str,
        lease_token: int | None,
    ) -> Transition:
        return self.build(
            ExecutionTransitioned,
            operation_id=operation_id,
            tenant_id=tenant_id,
            actor_id=actor_id,
            attempt=0,
            state=ExecutionState.INTENT_RECORDED,
            tool_name=tool_name,
            request_hash=request_hash,
            lease_token=lease_token,
        )

    def plan_execution(
        self,
        handle: TrackedOperation,
        state: ExecutionState,
        actor_id: str | None,
        *,
        provider_ref: str | None = None,
        result: bytes | str | None = None,
        error: str | None = None,
        content_type: str = "application/octet-stream",
        decision_id: str | None = None,
    ) -> Plan | None:
        require_settled(handle)
        current = handle.require_execution()
        require_lease(handle)
        if state is not current.state and state not in EXECUTION_TRANSITIONS[current.state]:
            # Checked before the event is built: the event model would otherwise refuse the
            # attempt number first, with a less useful message than the table's.
            raise IllegalTransitionError(
                f"illegal execution transition {current.state} -> {state}; nothing was sent"
            )
        payload: tuple[str, bytes, str] | None = None
        result_ref: str | None = None
        if isinstance(result, bytes | bytearray | memoryview):
            payload = (current.tenant_id, bytes(result), content_type)
            result_ref = ids.content_ref(bytes(result))
        elif result is not None:
            result_ref = result
        if state is current.state and next_execution_attempt(current, state) == current.attempt:
            # This handle already recorded this very step: a repeated call sends nothing (a new
            # event for it would be a conflict with the one on the topic).
            if state is ExecutionState.SUCCEEDED and result_ref != current.result_ref:
                raise ConflictError(
                    f"{current.operation_id} already SUCCEEDED with {current.result_ref}; "
                    "nothing was sent"
                )
            return None
        event = self.build(
            ExecutionTransitioned,
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
            lease_token=None if handle.lease is None else handle.lease.token,
            decision_id=decision_id,
        )
        plan = self.plan_events(handle, [event])
        if plan is None:
            return None
        return Plan(plan.parts, payload)

    def plan_delivery(
        self,
        handle: TrackedOperation,
        destination: str,
        state: DeliveryState,
        actor_id: str | None,
        *,
        attempt: int | None = None,
        next_attempt_at: datetime | None = None,
        error: str | None = None,
    ) -> Plan | None:
        require_settled(handle)
        snapshot = handle.state
        current = snapshot.deliveries.get(destination)
        if (
            current is not None
            and state is not current.state
            and state not in DELIVERY_TRANSITIONS[current.state]
        ):
            raise IllegalTransitionError(
                f"illegal delivery transition {current.state} -> {state} ({destination}); "
                "nothing was sent"
            )
        attempt_now = next_delivery_attempt(current, state) if attempt is None else attempt
        if current is not None and state is current.state and attempt_now == current.attempts:
            return None  # this step is already recorded by this handle: nothing to send
        execution = snapshot.execution
        if execution is None:
            raise IllegalTransitionError(
                f"{handle.operation_id}: its execution is not known to this handle, so a "
                f"delivery to {destination} cannot be checked against it; record or load the "
                "operation first. Nothing was sent"
            )
        event = self.build(
            DeliveryTransitioned,
            operation_id=handle.operation_id,
            tenant_id=execution.tenant_id,
            actor_id=actor_id or execution.actor_id,
            attempt=attempt_now,
            destination=destination,
            state=state,
            result_ref=delivery_result_ref(snapshot),
            next_attempt_at=next_attempt_at,
            error=error,
        )
        return self.plan_events(handle, [event])

    def plan_events(self, handle: TrackedOperation, events: Sequence[Transition]) -> Plan | None:
        """Fold ``events`` onto ``handle``'s state; None when every one is a repeat."""
        require_settled(handle)
        state = handle.state
        sent: list[Transition] = []
        for event in events:
            advanced = advance(state, event)
            if advanced is not None:
                state = advanced
                sent.append(event)
        if not sent:
            return None
        records = tuple(self.outgoing(e) for e in sent)
        return Plan((PlanPart(handle, InDoubt(tuple(sent), records, state)),))

    def plan_append(
        self, events: Sequence[OperationEvent], handles: dict[str, TrackedOperation]
    ) -> Plan | None:
        working: dict[str, OperationState] = {}
        sent: dict[str, list[OperationEvent]] = {}
        for index, given in enumerate(events):
            event = given
            if not isinstance(event, APPENDABLE):
                raise InvalidTransitionError(
                    f"event {index} is a {type(event).__name__}, not a transition; nothing was sent"
                )
            operation_id = event.operation_id
            handle = handles.get(operation_id)
            if handle is not None and handle.lease is not None:
                require_lease(handle)
                if isinstance(event, ExecutionTransitioned) and event.lease_token is None:
                    # Written under the handle's lease: say so, or it would be fenced.
                    event = event.model_copy(update={"lease_token": handle.lease.token})
            state = working.get(operation_id)
            if state is None:
                if handle is not None:
                    require_settled(handle)
                state = handle.state if handle else OperationState(operation_id)
            try:
                advanced = advance(state, event)
            except IllegalTransitionError as exc:
                raise IllegalTransitionError(
                    f"event {index} ({event.event_id}): {exc.reason}; nothing was sent"
                ) from None
            if advanced is not None:
                working[operation_id] = advanced
                sent.setdefault(operation_id, []).append(event)
        if not sent:
            return None
        parts = []
        for operation_id, group in sent.items():
            handle = handles.get(operation_id) or TrackedOperation.unknown(operation_id)
            records = tuple(self.outgoing(e) for e in group)
            parts.append(PlanPart(handle, InDoubt(tuple(group), records, working[operation_id])))
        return Plan(tuple(parts))

    @staticmethod
    def plan_resend(handle: TrackedOperation) -> Plan | None:
        pending = handle.in_doubt
        if pending is None:
            return None
        return Plan((PlanPart(handle, pending),))

    def build(
        self,
        model: type[ExecutionTransitioned] | type[DeliveryTransitioned],
        **fields: Any,
    ) -> Transition:
        now_ns = self._clock_ns()
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
            raise InvalidTransitionError(
                f"invalid {model.__name__} ({problems}): fix the arguments; nothing was sent"
            ) from None

    def outgoing(self, event: OperationEvent) -> OutgoingRecord:
        return self._records.record(event)


APPENDABLE = (ExecutionTransitioned, DeliveryTransitioned, OwnershipTaken, ReconciliationDecided)


def require_lease(handle: TrackedOperation) -> None:
    """Refuse, before anything is sent, to write under a lease this process may have lost: past
    its local deadline another process may already own the operation."""
    lease = handle.lease
    if lease is not None and not lease.valid():
        raise LeaseLostError(
            f"{handle.operation_id}: the lease (token {lease.token}) ran out; another process "
            "may own the operation now (take it over again to continue); this step was not sent"
        )


def require_settled(handle: TrackedOperation) -> None:
    pending = handle.in_doubt
    if pending is None:
        return
    last = pending.events[-1]
    if isinstance(last, ExecutionTransitioned):
        what = f"{last.state} attempt {last.attempt}"
    elif isinstance(last, DeliveryTransitioned):
        what = f"delivery to {last.destination} {last.state} attempt {last.attempt}"
    else:
        what = f"{last.kind} event"
    raise InDoubtError(
        f"{handle.operation_id}: the append of {what} ({last.event_id}) failed or timed out, "
        "so it may or may not be recorded. Call recorder.resend(handle) until it succeeds; "
        "no other step is allowed before that",
        handle,
    )
