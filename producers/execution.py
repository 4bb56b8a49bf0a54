"""The everyday form: one call that runs a tool call as the ledger expects, and the ownership
calls that let a process load an operation and carry it on under a new lease.

    with TransitionRecorder.connect(settings, providers=[email]) as recorder:
        done = recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})

    async with AsyncTransitionRecorder.connect(settings, providers=[email]) as recorder:
        done = await recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})

``execute`` records the intent (taking the lease and storing the request in one commit), checks
policy, records the dispatch, checks the lease is still this process's, calls the provider with
the operation id as idempotency key, stores the result and records the outcome. The lease's
commit (for an id ``execute`` made, nobody else's) and the policy read run while the intent's
acknowledgement is in flight; neither the dispatch nor the call happens before all three are
done. Lost contact (a
timeout, a reset) becomes UNKNOWN - an answer, not an exception the caller might retry - and the
lease is released so the recovery worker reconciles it at once. An append whose acknowledgement
is lost is resent (the identical event) a few times before the error is raised. An
``operation_id`` the caller passes again is never called again: the second ``execute`` reports
what the log holds for it (``Execution.repeat``).

The decisions are written once, as steps (``producers.steps``) that both recorders run: the
threaded one in the calling thread, the asyncio one without blocking its event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ledger.call_rule import perform_call
from ledger.domain.call import Judged
from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    OwnershipTaken,
    ReconciliationDecided,
)
from ledger.domain.fate import fate
from ledger.domain.names import InvalidNameError, NameKind, check_name
from ledger.domain.policy import PolicyDecision, PolicyRequest, Purpose
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import ExecutionState
from ledger.errors import (
    ConflictError,
    DeliveryError,
    IllegalTransitionError,
    InvalidTransitionError,
    LeaseLostError,
    RecordError,
    UnknownToolError,
)
from ledger.faults import fault_point
from ledger.history import HistoryReader, Snapshot
from ledger.leases import LeaseStore
from ledger.log import Transport
from ledger.results import ResultStore
from ledger.tools import AsyncProvider, Provider
from producers.operation import OperationState, TrackedOperation
from producers.planner import FIRST_TOKEN, Plan, Planner, canonical_request, hashed_request
from producers.steps import Blocking, Call, Pause, Record, Steps

log = logging.getLogger("opledger.execute")

#: Added to a tool's call timeout for the lease of an ``execute``: recording the outcome after
#: the call must fit in the lease too.
LEASE_MARGIN = timedelta(seconds=5)
#: How many times an append whose acknowledgement was lost is resent before giving up.
RESENDS = 3


PolicyCheck = Callable[[PolicyRequest], PolicyDecision]
"""Evaluates policy now (``ledger.policy_store.PolicyStore.evaluate``)."""


class SharedHistory:
    """A recorder's history reader, shared by its calls: its one consumer reads one operation's
    tail at a time."""

    __slots__ = ("_lock", "_reader")

    def __init__(self, reader: HistoryReader | None) -> None:
        self._reader = reader
        self._lock = threading.Lock()

    def load(
        self,
        operations: Iterable[tuple[str, str]],
        *,
        upto: Mapping[tuple[str, int], int] | None = None,
    ) -> dict[str, Snapshot]:
        """``HistoryReader.load``, one read at a time (blocking: Kafka and PostgreSQL)."""
        if self._reader is None:
            raise RecordError("this recorder cannot read history (connect() gives it a reader)")
        with self._lock:
            return self._reader.load(operations, upto=upto)


class RunningExecutions:
    """The operations a recorder is executing now."""

    __slots__ = ("_lock", "_operation_ids")

    def __init__(self) -> None:
        self._operation_ids: set[str] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def claim(self, operation_id: str) -> Iterator[None]:
        """Refuse a second ``execute`` of ``operation_id`` while one runs in this recorder: the
        lease (one owner per recorder) cannot tell two calls of one recorder apart."""
        with self._lock:
            if operation_id in self._operation_ids:
                raise LeaseLostError(
                    f"{operation_id} is being executed by another call of this recorder; "
                    "nothing was recorded"
                )
            self._operation_ids.add(operation_id)
        try:
            yield
        finally:
            with self._lock:
                self._operation_ids.discard(operation_id)


@dataclass(slots=True)
class Collaborators:
    """What a recorder was built with that the steps here work with; the recorder keeps one
    (``recorder.collaborators``) and the steps read its fields when they need them, so a field
    replaced on a running recorder (a test's policy) is the one used from then on."""

    planner: Planner
    #: the recorder's ``new_operation_id``, as it is when called (a subclass's, or one a test
    #: replaced on the recorder, makes the ids of ``execute`` and ``intent`` too)
    new_operation_id: Callable[[], str]
    transport: Transport
    history: SharedHistory
    running: RunningExecutions
    providers: Mapping[str, Provider | AsyncProvider]
    lease_ttl: timedelta
    leases: LeaseStore | None = None
    results: ResultStore | None = None
    policy: PolicyCheck | None = None


@dataclass(frozen=True, slots=True)
class Execution:
    """What ``execute`` (or ``resume``) did."""

    operation_id: str
    tenant_id: str
    state: ExecutionState
    attempt: int
    handle: TrackedOperation
    #: the provider's result (SUCCEEDED), stored under ``result_ref``
    result: bytes | None = None
    result_ref: str | None = None
    #: why it FAILED, went UNKNOWN or was refused
    error: str | None = None
    #: policy refused the dispatch (the intent is recorded FAILED at attempt 0, no call made)
    refused: bool = False
    #: the policy decision at dispatch, with its version (the grant's event id)
    policy: PolicyDecision | None = None
    #: an earlier ``execute`` with this operation id began it: nothing was called or recorded
    #: now, and this is the operation as the log holds it (an unfinished one is the recovery
    #: worker's to carry on)
    repeat: bool = False


def recorded(
    collaborators: Collaborators, handle: TrackedOperation, planner: Callable[[], Plan | None]
) -> Steps[None]:
    """Take one recording step; if its acknowledgement is lost, resend the identical event a few
    times (a repeat that did land is a recognised duplicate)."""
    try:
        yield Record(handle, planner)
        return
    except DeliveryError as exc:
        failure = exc
    for attempt in range(RESENDS):
        log.info("acknowledgement lost (%s); resending the same event, try %d", failure, attempt)
        yield Pause(0.2 * (attempt + 1))
        try:
            yield Record(handle, lambda: collaborators.planner.plan_resend(handle))
        except DeliveryError as exc:
            failure = exc
            continue
        return
    raise failure


def execute(
    collaborators: Collaborators,
    tenant_id: str,
    actor_id: str,
    tool_name: str,
    arguments: Any,
    *,
    operation_id: str | None = None,
) -> Steps[Execution]:
    """Run one tool call through the ledger; see the module docstring."""
    provider = _provider(collaborators, tool_name)
    _check_identity(tenant_id, actor_id, operation_id)
    # An empty id is refused above, never taken for "none": a caller retrying with the same
    # empty id would otherwise get a new operation, and a second call, every time.
    op_id = collaborators.new_operation_id() if operation_id is None else operation_id
    with collaborators.running.claim(op_id):
        if operation_id is not None:  # the caller's own id: an earlier call may have begun it
            earlier = yield from _begun(collaborators, op_id, tenant_id, tool_name, arguments)
            if earlier is not None:
                return earlier
        ttl = provider.terms.call_timeout + LEASE_MARGIN
        early = _EarlyPolicy(collaborators, tenant_id, actor_id, provider)
        handle: TrackedOperation | None = None
        try:
            try:
                handle = yield from intent_steps(
                    collaborators,
                    tenant_id,
                    actor_id,
                    tool_name,
                    arguments,
                    operation_id=op_id,
                    lease_ttl=ttl,
                    fresh=operation_id is None,
                    alongside=early.read if collaborators.policy is not None else None,
                )
            except DeliveryError as exc:
                handle = doubtful = exc.handle
                yield from recorded(
                    collaborators, doubtful, lambda: collaborators.planner.plan_resend(doubtful)
                )
                early.decision = None  # the resends took a while: policy is read again here
            fault_point("execute.after_intent_before_dispatch")
            return (
                yield from _dispatch_and_call(
                    collaborators, handle, provider, arguments, early.decision
                )
            )
        except RecordError as exc:
            if handle is not None:
                told(exc, handle, leased=collaborators.leases is None or handle.lease is not None)
            raise


def told(exc: RecordError, handle: TrackedOperation, *, leased: bool = True) -> RecordError:
    """``exc``, saying what the log holds for ``handle``'s operation and what happens next;
    ``leased``: its lease (with its stored request) was committed."""
    execution = handle.execution
    doubt = handle.in_doubt
    in_doubt = (
        []
        if doubt is None
        else [e.state for e in doubt.events if isinstance(e, ExecutionTransitioned)]
    )
    said = fate(
        handle.operation_id,
        None if execution is None else execution.state,
        0 if execution is None else execution.attempt,
        in_doubt,
        request_stored=leased,
    )
    return exc.tell(handle.operation_id, said.holds, said.next_step)


def intent_steps(
    collaborators: Collaborators,
    tenant_id: str,
    actor_id: str,
    tool_name: str,
    arguments: Any,
    *,
    operation_id: str | None,
    lease_ttl: timedelta | None,
    fresh: bool | None = None,
    alongside: Callable[[], None] | None = None,
) -> Steps[TrackedOperation]:
    """``intent`` (see ``TransitionRecorder.intent``). ``fresh``: the id was made by this
    recorder (by default, when none is given); ``alongside``: blocking work to do while the
    intent's acknowledgement is in flight (``execute``'s policy read), after the lease."""
    if fresh is None:
        fresh = operation_id is None
    handle = TrackedOperation.unknown(
        collaborators.new_operation_id() if operation_id is None else operation_id
    )
    request, request_hash = canonical_request(tool_name, arguments)
    # Validated before the lease is taken: nothing is stored for an intent that cannot be.
    event = collaborators.planner.intent_event(
        handle.operation_id,
        tenant_id=tenant_id,
        actor_id=actor_id,
        tool_name=tool_name,
        request_hash=request_hash,
        lease_token=None if collaborators.leases is None else FIRST_TOKEN,
    )
    leases = collaborators.leases

    def plan() -> Plan | None:
        return collaborators.planner.plan_events(handle, [event])

    if leases is None:
        yield Record(handle, plan, alongside)
        return handle
    ttl = collaborators.lease_ttl if lease_ttl is None else lease_ttl

    def take_lease() -> None:
        handle.lease = leases.create(
            handle.operation_id,
            tenant_id,
            ttl,
            tool_name=tool_name,
            request_hash=request_hash,
            request=request,
        )

    if not fresh:
        # The caller's id may be someone else's: nothing is appended before it is ours.
        yield Blocking(take_lease)
        yield Record(handle, plan, alongside)
        return handle

    def take_lease_then_alongside() -> None:
        take_lease()
        if alongside is not None:
            alongside()

    # An id this recorder just made is nobody else's, so the lease's commit and the
    # intent's acknowledgement are waited for together, not one after the other. If the
    # lease fails, its error is raised and nothing more is appended: the log may then hold
    # this intent (token 1) with no lease and no stored request, which the recovery worker
    # takes over after a grace (OPLEDGER_RECOVERY_UNLEASED_GRACE_S) and parks, never
    # dispatches. The error says so.
    try:
        yield Record(handle, plan, take_lease_then_alongside)
    except RecordError as exc:
        if not isinstance(exc, DeliveryError):  # the caller resends those: in doubt
            told(exc, handle, leased=handle.lease is not None)
        raise
    return handle


def resume(collaborators: Collaborators, handle: TrackedOperation) -> Steps[Execution]:
    """Carry on an operation taken over at INTENT_RECORDED: its owner went away before
    dispatching, so no provider call happened; dispatch it once, with the stored request.

    Any other state is not the SDK's to move: DISPATCHED and UNKNOWN are reconciled by the
    recovery worker (looking the key up), never re-dispatched here.
    """
    execution = handle.require_execution()
    if execution.state is not ExecutionState.INTENT_RECORDED:
        raise IllegalTransitionError(
            f"{handle.operation_id} is {execution.state}: only an intent is resumed here; "
            "a dispatched or UNKNOWN operation is reconciled by the recovery worker"
        )
    if handle.lease is None or collaborators.leases is None:
        raise LeaseLostError(
            f"{handle.operation_id}: take the operation over (take_over) before resuming it"
        )
    provider = _provider(collaborators, execution.tool_name)
    leases = collaborators.leases
    stored = yield Blocking(lambda: leases.requests([(handle.operation_id, execution.tenant_id)]))
    body = stored.get(handle.operation_id)
    if body is None:
        raise RecordError(
            f"{handle.operation_id}: its request was never stored (recorded without a lease "
            "store), so it cannot be dispatched again here"
        )
    try:
        return (yield from _dispatch_and_call(collaborators, handle, provider, json.loads(body)))
    except RecordError as exc:
        told(exc, handle)
        raise


def load(collaborators: Collaborators, operation_id: str, tenant_id: str) -> TrackedOperation:
    """The operation as the log says it is now (projection + unprojected tail), read-only:
    the handle holds no lease. Another tenant's operation reads as unknown."""
    snapshot = collaborators.history.load([(operation_id, tenant_id)])[operation_id]
    if snapshot.execution is None:
        raise IllegalTransitionError(f"no operation {operation_id} for tenant {tenant_id}")
    return TrackedOperation(
        OperationState(operation_id, snapshot.execution, dict(snapshot.deliveries))
    )


def take_over(
    collaborators: Collaborators,
    operation_id: str,
    tenant_id: str,
    *,
    reason: str,
    ttl: timedelta | None = None,
    force: bool = False,
) -> TrackedOperation:
    """Take ``operation_id`` over under a new lease and return it as it is now.

    The lease must have expired (``force`` takes it anyway: a cancel). The new token is
    recorded first (OwnershipTaken); the history is then read up to that record, so nothing
    the previous owner still appends after it counts: it is fenced.
    """
    leases = _require_leases(collaborators)
    before = collaborators.history.load([(operation_id, tenant_id)])[operation_id].execution
    if before is None:
        raise IllegalTransitionError(f"no operation {operation_id} for tenant {tenant_id}")
    if before.state in (ExecutionState.SUCCEEDED, ExecutionState.FAILED):
        raise IllegalTransitionError(
            f"{operation_id} already finished ({before.state}); there is nothing to take over"
        )
    taken = leases.take_over(
        [(operation_id, tenant_id)], collaborators.lease_ttl if ttl is None else ttl, force=force
    )
    lease = taken.get(operation_id)
    if lease is None:
        raise LeaseLostError(
            f"{operation_id} is held by another process whose lease has not expired"
        )
    now = datetime.now(UTC)
    claim = OwnershipTaken(
        event_id=collaborators.planner.new_event_id(),
        operation_id=operation_id,
        tenant_id=tenant_id,
        actor_id=leases.owner.split("/")[0][:128],
        occurred_at=now,
        attempt=before.attempt,
        lease_token=lease.token,
        reason=reason,
    )
    positions = collaborators.transport.send([collaborators.planner.outgoing(claim)])
    upto = {(t, p): o + 1 for t, p, o in positions or ()}
    snapshot = collaborators.history.load([(operation_id, tenant_id)], upto=upto or None)[
        operation_id
    ]
    execution = snapshot.execution
    if execution is None or execution.lease_token != lease.token:
        raise LeaseLostError(
            f"{operation_id}: another process claimed it with a higher token meanwhile"
        )
    return TrackedOperation(
        OperationState(operation_id, execution, dict(snapshot.deliveries)), lease
    )


# -- internals -------------------------------------------------------------------------------


def _check_identity(tenant_id: Any, actor_id: Any, operation_id: Any) -> None:
    """Refuse ids no event can carry before any I/O (a caller's own id is looked up in
    PostgreSQL first, where a NUL or a number would surface as a database error)."""
    checks = [("tenant_id", NameKind.TENANT, tenant_id), ("actor_id", NameKind.ACTOR, actor_id)]
    if operation_id is not None:
        checks.append(("operation_id", NameKind.OPERATION_ID, operation_id))
    for parameter, kind, value in checks:
        try:
            check_name(kind, value)
        except InvalidNameError as exc:
            fresh = " (or none, for a fresh one)" if kind is NameKind.OPERATION_ID else ""
            raise InvalidTransitionError(
                f"{parameter}: {exc}{fresh}: fix it; nothing was recorded"
            ) from None


def _provider(collaborators: Collaborators, tool_name: str) -> Provider | AsyncProvider:
    provider = collaborators.providers.get(tool_name) if isinstance(tool_name, str) else None
    if provider is None:
        known = ", ".join(sorted(collaborators.providers)) or "none"
        raise UnknownToolError(
            f"no provider registered for tool {tool_name!r} (registered: {known}); "
            "pass it to connect(providers=...). Nothing was recorded"
        )
    return provider


def _begun(
    collaborators: Collaborators, operation_id: str, tenant_id: str, tool_name: str, arguments: Any
) -> Steps[Execution | None]:
    """The operation as the log holds it when an earlier call began ``operation_id`` (a caller
    retrying with its own id), else None: its tool is never called a second time."""
    leases = collaborators.leases
    if leases is None:
        return None  # no lease store, no stored requests: nothing to recognise a repeat by
    owner_tenant = yield Blocking(lambda: leases.tenant_of(operation_id))
    if owner_tenant is None:
        return None
    if owner_tenant != tenant_id:
        raise IllegalTransitionError(
            f"operation id {operation_id} is already in use; choose another. Nothing was recorded"
        )
    snapshots = yield Blocking(lambda: collaborators.history.load([(operation_id, tenant_id)]))
    snapshot = snapshots[operation_id]
    execution = snapshot.execution
    if execution is None:
        return None  # its intent never reached the log (the earlier call failed first)
    if execution.request_hash != hashed_request(tool_name, arguments):
        raise ConflictError(
            f"{operation_id} was begun with another tool or other arguments; nothing was recorded"
        )
    handle = TrackedOperation(OperationState(operation_id, execution, dict(snapshot.deliveries)))
    result: bytes | None = None
    results, ref = collaborators.results, execution.result_ref
    if execution.state is ExecutionState.SUCCEEDED and ref is not None and results is not None:
        result = yield Blocking(lambda: results.get(tenant_id, ref))
    error = execution.error
    if execution.state not in (ExecutionState.SUCCEEDED, ExecutionState.FAILED):
        error = (
            f"begun by an earlier call and not called again; it is {execution.state} and the "
            "recovery worker carries it on"
        )
    return _report(handle, result=result, error=error, repeat=True)


def _dispatch_and_call(
    collaborators: Collaborators,
    handle: TrackedOperation,
    provider: Provider | AsyncProvider,
    arguments: Any,
    decision: PolicyDecision | None = None,
) -> Steps[Execution]:
    """Policy (``decision`` when it was already read), dispatch, the lease check, the call and
    its outcome."""
    if collaborators.leases is not None and handle.lease is None:
        raise LeaseLostError(
            f"{handle.operation_id}: not held under a lease; nothing was dispatched or called"
        )
    execution = handle.require_execution()
    if decision is None:
        decision = yield from _check_policy(
            collaborators, execution.tenant_id, execution.actor_id, provider
        )
    if not decision.allowed:
        reason = f"refused by policy {decision.version or '(no grant)'}: {decision.reason}"
        yield from recorded(
            collaborators,
            handle,
            collaborators.planner.step(handle, ExecutionState.FAILED, error=reason),
        )
        return _report(handle, error=reason, refused=True, policy=decision)
    port = _RecorderCallPort(collaborators, handle, provider, arguments)
    judged = yield from perform_call(port, handle.operation_id, stage="execute")
    return _report(handle, result=judged.result, error=judged.error, policy=decision)


class _RecorderCallPort:
    """The call rule's steps (``ledger.call_rule``) as a recorder performs them: each append
    acknowledged before the next step, the lease kept in the lease store."""

    __slots__ = ("_collaborators", "_handle", "_provider", "_request", "_ttl")

    def __init__(
        self,
        collaborators: Collaborators,
        handle: TrackedOperation,
        provider: Provider | AsyncProvider,
        request: Any,
    ) -> None:
        self._collaborators = collaborators
        self._handle = handle
        self._provider = provider
        self._request = request
        self._ttl = provider.terms.call_timeout + LEASE_MARGIN

    def keep_lease(self, *, now: bool) -> Steps[None]:
        collaborators, handle = self._collaborators, self._handle
        leases, lease = collaborators.leases, handle.lease
        if now and lease is not None and leases is not None:
            held = yield Blocking(lambda: leases.holds(lease))
            if held:
                return
        # Not held any more (ran out during a stalled append, or taken over): reclaimed only
        # if nobody took it over.
        yield from _lease_kept(collaborators, handle, self._ttl, always=now)

    def record_dispatch(self, provider_ref: str) -> Steps[None]:
        collaborators, handle = self._collaborators, self._handle
        dispatched = collaborators.planner.step(
            handle, ExecutionState.DISPATCHED, provider_ref=provider_ref
        )
        yield from recorded(collaborators, handle, dispatched)

    def call(self, key: str) -> Steps[object]:
        answer: object = yield Call(self._provider, self._request, key)
        return answer

    def record_outcome(self, judged: Judged) -> Steps[None]:
        collaborators, handle = self._collaborators, self._handle
        if judged.state is ExecutionState.UNKNOWN:
            # An exception here could be retried by the caller; UNKNOWN leaves it to
            # reconciliation.
            assert judged.error is not None
            yield from _left_unknown(collaborators, handle, judged.error)
        elif judged.state is ExecutionState.FAILED:
            failed = collaborators.planner.step(handle, ExecutionState.FAILED, error=judged.error)
            yield from recorded(collaborators, handle, failed)
        else:
            succeeded = collaborators.planner.step(
                handle,
                ExecutionState.SUCCEEDED,
                result=judged.result,
                content_type=judged.content_type,
                provider_ref=judged.provider_ref,
            )
            yield from recorded(collaborators, handle, succeeded)


def _lease_kept(
    collaborators: Collaborators, handle: TrackedOperation, ttl: timedelta, *, always: bool = False
) -> Steps[None]:
    """Reclaim ``handle``'s lease when less than half of ``ttl`` is left of it (or ``always``):
    an append that stalled (a broker being fenced after a SIGKILL) must not cost a caller its
    call while nobody else has touched the operation. Raises LeaseLostError, saying the lease
    was taken over, when someone has."""
    leases, lease = collaborators.leases, handle.lease
    if leases is None or lease is None:
        return
    if not always and lease.remaining() >= ttl.total_seconds() / 2:
        return
    handle.lease = yield Blocking(lambda: leases.reclaim(lease, ttl))


def _left_unknown(
    collaborators: Collaborators, handle: TrackedOperation, error: str | BaseException
) -> Steps[None]:
    """Record UNKNOWN after dispatch and release the lease, so that the recovery worker
    reconciles the operation now rather than when the lease runs out."""
    yield from recorded(
        collaborators,
        handle,
        collaborators.planner.step(handle, ExecutionState.UNKNOWN, error=error),
    )
    leases, lease = collaborators.leases, handle.lease
    if lease is not None and leases is not None:
        yield Blocking(lambda: leases.release([lease]))


def _check_policy(
    collaborators: Collaborators, tenant_id: str, actor_id: str, provider: Provider | AsyncProvider
) -> Steps[PolicyDecision]:
    policy = collaborators.policy
    if policy is None:
        # No policy store was configured (a recorder built by hand, in tests): say so in
        # the record rather than pretend a check happened.
        return PolicyDecision(True, "no policy store configured", None)
    decision: PolicyDecision = yield Blocking(
        lambda: policy(_policy_request(tenant_id, actor_id, provider))
    )
    return decision


def _policy_request(
    tenant_id: str, actor_id: str, provider: Provider | AsyncProvider
) -> PolicyRequest:
    return PolicyRequest(
        tenant_id=tenant_id,
        actor_id=actor_id,
        tool_name=provider.tool_name,
        purpose=Purpose.DISPATCH,
        now=datetime.now(UTC),
        required_scope=provider.terms.required_scope,
    )


class _EarlyPolicy:
    """``execute``'s policy read, done while the intent's acknowledgement is in flight (and
    after the lease, when both are): a read made before the dispatch, as when it followed the
    acknowledgement, and the decision it returns is the one acted on and reported."""

    __slots__ = ("_actor_id", "_collaborators", "_provider", "_tenant_id", "decision")

    def __init__(
        self,
        collaborators: Collaborators,
        tenant_id: str,
        actor_id: str,
        provider: Provider | AsyncProvider,
    ) -> None:
        self._collaborators = collaborators
        self._tenant_id = tenant_id
        self._actor_id = actor_id
        self._provider = provider
        self.decision: PolicyDecision | None = None

    def read(self) -> None:
        policy = self._collaborators.policy
        if policy is not None:
            self.decision = policy(_policy_request(self._tenant_id, self._actor_id, self._provider))


def _report(
    handle: TrackedOperation,
    *,
    result: bytes | None = None,
    error: str | None = None,
    refused: bool = False,
    policy: PolicyDecision | None = None,
    repeat: bool = False,
) -> Execution:
    execution = handle.require_execution()
    return Execution(
        operation_id=handle.operation_id,
        tenant_id=execution.tenant_id,
        state=execution.state,
        attempt=execution.attempt,
        handle=handle,
        result=result,
        result_ref=execution.result_ref,
        error=error,
        refused=refused,
        policy=policy,
        repeat=repeat,
    )


def _require_leases(collaborators: Collaborators) -> LeaseStore:
    if collaborators.leases is None:
        raise LeaseLostError("this recorder has no lease store (connect() gives it one)")
    return collaborators.leases


def cancel(
    collaborators: Collaborators,
    operation_id: str,
    tenant_id: str,
    actor_id: str,
    reason: str,
    *,
    append: Callable[[Sequence[OperationEvent], Iterable[TrackedOperation]], object],
) -> TrackedOperation:
    """Cancel an operation on behalf of ``actor_id`` (a person or a service of the tenant).

    Before dispatch the cancel is final: the intent is recorded FAILED at attempt 0 and no call
    is ever made. After dispatch the call may have happened, so the operation is reconciled as
    usual (the provider is asked what became of it) but never attempted again. The operation is
    taken over by force first, so its current owner can append nothing after the cancel.
    ``append`` is the recorder's (``append(events, known)``).
    """
    if not reason.strip():
        raise InvalidTransitionError("a cancel needs a reason; nothing was recorded")
    handle = take_over(
        collaborators, operation_id, tenant_id, reason=f"cancel by {actor_id}", force=True
    )
    execution = handle.require_execution()
    if execution.state in (ExecutionState.SUCCEEDED, ExecutionState.FAILED):
        raise IllegalTransitionError(
            f"{operation_id} already finished ({execution.state}); there is nothing to cancel"
        )
    assert handle.lease is not None
    decided = ReconciliationDecided(
        event_id=collaborators.planner.new_event_id(),
        operation_id=operation_id,
        tenant_id=tenant_id,
        actor_id=actor_id,
        occurred_at=datetime.now(UTC),
        attempt=execution.attempt,
        lease_token=handle.lease.token,
        decision=Decision.CANCEL,
        lookup=LookupStatus.NOT_LOOKED_UP,
        reason=reason,
    )
    events: list[Any] = [decided]
    if execution.state is ExecutionState.INTENT_RECORDED:
        events.append(
            collaborators.planner.build(
                ExecutionTransitioned,
                operation_id=operation_id,
                tenant_id=tenant_id,
                actor_id=actor_id,
                attempt=0,
                state=ExecutionState.FAILED,
                tool_name=execution.tool_name,
                request_hash=execution.request_hash,
                error=f"cancelled before dispatch by {actor_id}: {reason}",
                lease_token=handle.lease.token,
                decision_id=decided.event_id,
            )
        )
    append(events, [handle])
    if collaborators.leases is not None:
        collaborators.leases.release([handle.lease])
    return handle
