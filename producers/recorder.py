"""The recorder: what a service calls to record an operation's transitions.

Every call builds the next event, folds it with the domain rules *before* anything is sent
(an illegal transition raises and writes nothing; a repeat returns without a second record),
appends it keyed by ``operation_id`` and returns only after the broker acknowledged it. A worker
that records and then acknowledges its own job therefore never acknowledges an unrecorded step.

When an append fails or its acknowledgement times out, the record may or may not be on the topic.
The handle is then *in doubt*: it keeps the exact event, and the only call it accepts is
:meth:`TransitionRecorder.resend`, which sends that identical event (same ``event_id``) again
until the broker acknowledges it. A repeat that did land first is a duplicate the projector
recognises by its event id; a *different* next step built on a guess could contradict what is
already written, so it is refused.

:class:`TransitionRecorder` is safe to share between threads (one producer and one connection
pool serve them all; each call waits only for its own acknowledgement). ``producers.aio`` has the
asyncio twin; both share everything here but the waiting: ``connect``, the planning code
(``producers.planner``), and the steps of an append (``producers.steps``; ``intent``'s and
``execute``'s are in ``producers.execution``), which each recorder performs its own way.

The imports run one way: this module imports ``producers.execution``, which imports the planner,
the steps and the handles; none of those imports a recorder.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Sequence,
)
from contextvars import ContextVar, Token
from datetime import datetime, timedelta
from typing import Any, ClassVar, Concatenate, ParamSpec, Protocol, Self, TypedDict, TypeVar, cast

from ledger.codec import Codec, default_codec
from ledger.domain.events import (
    OperationEvent,
)
from ledger.domain.policy import PolicyDecision, PolicyRequest
from ledger.domain.states import (
    DeliveryState,
    ExecutionState,
)
from ledger.entropy import entropy as entropy_pool
from ledger.errors import (
    DeliveryError,
    ForkedRecorderError,
    IllegalTransitionError,
    RecorderClosedError,
    RecordError,
)
from ledger.faults import fault_point
from ledger.history import HistoryReader
from ledger.leases import LeaseStore, process_identity
from ledger.log import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    KafkaTransport,
    LogTopics,
    OutgoingRecord,
    Positions,
    RecordBuilder,
    SplitTransport,
    Transport,
)
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyFreshness, PolicyStore
from ledger.results import ResultStore
from ledger.settings import Settings
from ledger.tools import AsyncProvider, Provider, is_async
from producers import execution
from producers.execution import (
    Collaborators,
    Execution,
    PolicyCheck,
    RunningExecutions,
    SharedHistory,
)
from producers.operation import (
    TrackedOperation,
    as_aware,
)
from producers.planner import Clock, Entropy, Plan, Planner, clean_error
from producers.steps import (
    AlongsideError,
    Blocking,
    Call,
    Effect,
    Record,
    Send,
    Stepper,
    Steps,
    T,
    alongside_outcome,
)

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


def _policy_check(pool: Any, settings: Settings) -> tuple[PolicyCheck, PolicyFreshness]:
    """The policy store's evaluation over ``pool``, behind the freshness gate of decision 022:
    a view that may lack a revocation on the topic refuses rather than allows (the probe it
    needs is returned too, for the recorder to close)."""
    store = PolicyStore(pool, settings)
    freshness = PolicyFreshness(settings)

    def check(request: PolicyRequest) -> PolicyDecision:
        stale = freshness.stale_reason()
        if stale is not None:
            return PolicyDecision(False, stale, None)
        return store.evaluate(request)

    return check, freshness


class RecorderOptions(TypedDict, total=False):
    """:class:`RecorderCore`'s keyword arguments, for a recorder that adds its own."""

    results: ResultStore | None
    clock_ns: Clock
    entropy: Entropy
    codec: Codec | None
    metrics: Metrics | None
    owns: Sequence[Closeable]
    leases: LeaseStore | None
    history: HistoryReader | None
    providers: Iterable[Provider | AsyncProvider]
    policy: PolicyCheck | None
    lease_ttl: timedelta


#: How long a lease lasts when the caller does not say (``execute`` sizes it from the tool).
DEFAULT_LEASE_TTL = timedelta(seconds=60)
# The recorders whose calls the current thread or task is inside: a call made from within one
# (a tool that records a nested tool call, a cancel's own append) belongs to it, so it is
# neither refused by a close() that waits for it nor counted as a call close() must wait for.
_INSIDE: ContextVar[tuple[int, ...]] = ContextVar("opledger_inside_recorders", default=())

#: How long ``close()`` waits for calls already running to finish before it closes anyway.
CLOSE_WAIT_S = 30.0

_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C", bound="RecorderCore")


def guarded(method: Callable[Concatenate[_C, _P], _R]) -> Callable[Concatenate[_C, _P], _R]:
    """A public call of the threaded recorder: refused after close() or in a forked child."""

    @functools.wraps(method)
    def call(self: _C, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        token = self._enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave(token)

    return call


def guarded_async(
    method: Callable[Concatenate[_C, _P], Awaitable[_R]],
) -> Callable[Concatenate[_C, _P], Coroutine[Any, Any, _R]]:
    """:func:`guarded` for the asyncio recorder's coroutines."""

    @functools.wraps(method)
    async def call(self: _C, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        token = self._enter()
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._leave(token)

    return call


class RecorderCore:
    """What the threaded and the asyncio recorder share: what they were built with (the
    :class:`~producers.execution.Collaborators` of ``execute``'s steps), their planner
    (``producers.planner``), the steps of an append and the settling of handles after its I/O
    succeeded or failed; the steps hand their I/O to the recorder (``producers.steps``). Only
    the recorders wait for anything."""

    #: whether this kind of recorder can await an asyncio provider's call
    awaits_providers: ClassVar[bool] = False

    def __init__(
        self,
        settings: Settings,
        transport: Transport,
        *,
        results: ResultStore | None = None,
        clock_ns: Clock = time.time_ns,
        entropy: Entropy = entropy_pool,
        codec: Codec | None = None,
        metrics: Metrics | None = None,
        owns: Sequence[Closeable] = (),
        leases: LeaseStore | None = None,
        history: HistoryReader | None = None,
        providers: Iterable[Provider | AsyncProvider] = (),
        policy: PolicyCheck | None = None,
        lease_ttl: timedelta = DEFAULT_LEASE_TTL,
    ) -> None:
        if not self.awaits_providers:
            providers = _synchronous(providers)
        self._transport = transport
        # Whether a send can do other work while its acknowledgements are in flight.
        self._splits = isinstance(transport, SplitTransport)
        self._owned = list(owns)
        self._settings = settings
        self._planner = Planner(
            RecordBuilder(LogTopics.of(settings), codec or default_codec(), "sdk"),
            clock_ns,
            entropy,
        )
        self._metrics = metrics
        self._execution_topic = settings.execution_topic
        #: What ``execute``'s steps and the ownership calls work with (``producers.execution``);
        #: a field replaced here is used from the next read on.
        self.collaborators = Collaborators(
            planner=self._planner,
            # Looked up at each call, not bound now: one replaced on this recorder later counts.
            new_operation_id=lambda: self.new_operation_id(),  # noqa: PLW0108
            transport=transport,
            history=SharedHistory(history),
            running=RunningExecutions(),
            providers={p.tool_name: p for p in providers},
            lease_ttl=lease_ttl,
            leases=leases,
            results=results,
            policy=policy,
        )
        # librdkafka's threads and psycopg's sockets do not survive a fork: a child must not
        # touch them (decision 020).
        self._pid = os.getpid()
        self._closed = False
        self._calls = 0
        self._calls_changed = threading.Condition()

    # -- calls and their end (decision 020) ----------------------------------------------------

    def _enter(self) -> Token[tuple[int, ...]]:
        """Admit one public call (refused, with nothing done, in a forked child or once closed)."""
        if os.getpid() != self._pid:
            raise ForkedRecorderError(
                f"this recorder was created in process {self._pid} and this is process "
                f"{os.getpid()}, a fork of it: its Kafka producer and PostgreSQL connections are "
                "the parent's and cannot be used here. Create a recorder in each process "
                "(after the fork); nothing was recorded"
            )
        inside = _INSIDE.get()
        with self._calls_changed:
            if self._closed and id(self) not in inside:
                raise RecorderClosedError(
                    "this recorder is closed (or closing); nothing was recorded. Connect a new "
                    "recorder for further calls"
                )
            self._calls += 1
        return _INSIDE.set((*inside, id(self)))

    def _leave(self, token: Token[tuple[int, ...]]) -> None:
        _INSIDE.reset(token)
        with self._calls_changed:
            self._calls -= 1
            self._calls_changed.notify_all()

    def _stop_calls(self, timeout: float) -> bool:
        """Refuse new calls, then wait up to ``timeout`` for the running ones (but not for the
        calls this one is made from, which cannot end before it). False when time ran out."""
        own = _INSIDE.get().count(id(self))
        with self._calls_changed:
            self._closed = True
            finished = self._calls_changed.wait_for(lambda: self._calls <= own, timeout)
            if not finished:
                log.warning(
                    "closing the recorder with %d call(s) still running after %.0fs; they end "
                    "with an error (an append in doubt is reported as such)",
                    self._calls - own,
                    timeout,
                )
            return finished

    def _forked_close(self) -> bool:
        """In a forked child: drop what the parent owns without closing it (a flush would wait
        for threads that do not exist here, and closing a connection would end the parent's
        session); True when this is such a child."""
        if os.getpid() == self._pid:
            return False
        self._closed = True
        self._owned.clear()
        return True

    @classmethod
    def connect(
        cls,
        settings: Settings,
        *,
        providers: Iterable[Provider | AsyncProvider] = (),
        owner: str | None = None,
        with_results: bool = True,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        compression: str = "lz4",
        metrics: Metrics | None = None,
        wrap_transport: Callable[[Transport], Transport] | None = None,
        **tuning: Any,
    ) -> Self:
        """A recorder with its own Kafka producer and one PostgreSQL pool (at settings.dsn) for
        results, leases, stored requests, policy and history reads.

        Nothing here creates tables: run ``opledger db migrate`` (the workers do at start-up),
        and nothing blocks for long: the producer connects in the background and the pool opens
        its connections on demand. ``providers`` are the tools ``execute`` can run (asyncio ones
        only for the asyncio recorder). ``owner`` names this recorder as a lease holder (made
        unique: name@host:pid/random, so two recorders never pass for one another).
        ``wrap_transport`` interposes on every send (fault injection in the demo and tests).
        ``with_results=False`` gives a recorder without PostgreSQL (no results, leases, policy).
        ``tuning`` goes to the constructor (the asyncio recorder's ``tool_threads``).
        """
        if not cls.awaits_providers:
            providers = _synchronous(providers)  # refused before anything is opened
        transport: Transport = KafkaTransport(
            settings, delivery_timeout_s=delivery_timeout_s, compression=compression
        )
        if wrap_transport is not None:
            transport = wrap_transport(transport)
        options = RecorderOptions(owns=[transport], metrics=metrics, providers=providers)
        if with_results:
            # The SDK's own database role (decision 034), unless OPLEDGER_PG_ROLE chose one.
            settings = settings.as_pg_role("sdk")
            pool = open_pool(
                settings.dsn, name="opledger-sdk", lock_timeout_ms=settings.pg_lock_timeout_ms
            )
            history = HistoryReader(settings, pool)
            policy, freshness = _policy_check(pool, settings)
            options.update(
                RecorderOptions(
                    results=ResultStore(pool),
                    leases=LeaseStore(pool, process_identity(owner or "sdk")),
                    history=history,
                    policy=policy,
                    # the producer flushes before the pool closes
                    owns=[transport, history, freshness, pool],
                )
            )
        return cls(settings, transport, **options, **tuning)

    def new_operation_id(self) -> str:
        """A fresh ``op_`` ULID from this recorder's clock and entropy."""
        return self._planner.new_operation_id()

    # -- appending (the handles' locks held) ---------------------------------------------------

    def _append_steps(
        self, planner: Callable[[], Plan | None], alongside: Callable[[], None] | None = None
    ) -> Steps[bool]:
        """Plan, store the result payload, send, settle: False when nothing needed sending.
        ``alongside`` runs while the records are in flight (:class:`~producers.steps.Send`);
        if it raises, its error is raised once the records' fate is known."""
        plan = planner()
        if plan is None:
            if alongside is not None:
                yield Blocking(alongside)
            return False
        payload = plan.payload
        if payload is not None:
            results = self.collaborators.results
            if results is None:
                raise RecordError(
                    "succeeded(bytes) needs a result store: connect with with_results=True "
                    "or pass results=; nothing was sent"
                )
            # Durable before the event that points at it exists (and before the caller
            # acknowledges its job). A crash after this leaves an unreferenced row, which
            # a retried call stores again as a no-op.
            yield Blocking(lambda: results.put(*payload))
            fault_point("producer.after_result_write_before_record")
        if alongside is not None and not (
            self._splits and cast(SplitTransport, self._transport).warm
        ):
            # This transport only sends and waits in one go, or its producer is too fresh to
            # send at once (SplitTransport.warm): the work first, and nothing is sent if it
            # fails.
            yield Blocking(alongside)
            alongside = None
        records = plan.records
        started = time.monotonic()
        failed: AlongsideError | None = None
        try:
            with self._sending(plan):
                yield Send(records, alongside)
        except AlongsideError as exc:
            failed = exc
        if failed is not None:
            raise failed.error  # outside the handler: not shown as raised while handling it
        self._settle(plan)
        self._observe(records, time.monotonic() - started)
        return True

    @contextlib.contextmanager
    def _sending(self, plan: Plan) -> Iterator[None]:
        """Leave ``plan``'s handles in doubt when its send fails or is interrupted."""
        try:
            yield
        except AlongsideError as exc:
            # The work beside the send failed (its error is the call's); the handles are left
            # as the broker answered: settled, or in doubt.
            if exc.send_error is None:
                self._settle(plan)
            elif isinstance(exc.send_error, RecordError):
                self._doubt(plan, exc.send_error)
            else:
                self._doubt(plan, DeliveryError(f"the Kafka client failed: {exc.send_error!r}"))
            raise
        except RecordError as exc:
            raise self._doubt(plan, exc) from None
        except Exception as exc:  # the client itself failed: the outcome is unknown
            raise self._doubt(
                plan, DeliveryError(f"the Kafka client failed while appending: {exc!r}")
            ) from exc
        except BaseException:
            # Interrupted (a cancelled task, Ctrl-C; the steps closed) with records in flight:
            # whether they landed is unknown, so the handles must not be used as if they had not.
            self._doubt(plan, DeliveryError("interrupted while waiting for the acknowledgement"))
            raise

    # -- settling ------------------------------------------------------------------------------

    @staticmethod
    def _settle(plan: Plan) -> None:
        for part in plan.parts:
            part.handle.commit(part.pending.advanced)

    @staticmethod
    def _doubt(plan: Plan, error: RecordError) -> RecordError:
        """Mark every handle of ``plan`` in doubt and attach them to ``error``."""
        for part in plan.parts:
            part.handle.doubt(part.pending)
        if isinstance(error, DeliveryError):
            error.handles = {p.handle.operation_id: p.handle for p in plan.parts}
        return error

    def _observe(self, records: Sequence[OutgoingRecord], seconds: float) -> None:
        if self._metrics is None:
            return
        self._metrics.append_seconds.observe(seconds)
        executions = sum(1 for r in records if r.topic == self._execution_topic)
        if executions:
            self._metrics.records_appended.labels(machine="execution").inc(executions)
        if len(records) - executions:
            self._metrics.records_appended.labels(machine="delivery").inc(len(records) - executions)


def _synchronous(providers: Iterable[Provider | AsyncProvider]) -> list[Provider]:
    listed = list(providers)
    for provider in listed:
        if is_async(provider):
            raise TypeError(
                f"the provider of {provider.tool_name!r} is an asyncio one (async def call): "
                "run it with producers.AsyncTransitionRecorder"
            )
    return cast(list[Provider], listed)


@contextlib.contextmanager
def _locked(handles: Iterable[TrackedOperation]) -> Any:
    with contextlib.ExitStack() as stack:
        # Sorted, so two calls sharing handles take their locks in the same order.
        for handle in sorted(handles, key=lambda h: h.operation_id):
            stack.enter_context(handle.lock)
        yield


class TransitionRecorder(RecorderCore):
    """Records execution and delivery transitions of operations, durably, in order.

    Build it with :meth:`connect` at the edge of a service; tests pass their own transport,
    clock and entropy. Safe to share between threads: calls on one operation are serialised by
    its handle, calls on different operations run concurrently. Its providers are synchronous
    (:class:`~ledger.tools.Provider`); an asyncio one is refused when the recorder is built.
    """

    # -- the everyday form and ownership (producers/execution.py) ------------------------------

    @guarded
    def execute(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        *,
        operation_id: str | None = None,
    ) -> Execution:
        """Run one tool call through the ledger with its registered provider: intent (lease and
        request stored first), policy, dispatch, call, result, outcome. Lost contact is UNKNOWN,
        returned, never raised (``producers.execution``). An ``operation_id`` given again never
        calls again: the operation is reported as the log holds it (``Execution.repeat``)."""
        return self._drive(
            execution.execute(
                self.collaborators,
                tenant_id,
                actor_id,
                tool_name,
                arguments,
                operation_id=operation_id,
            )
        )

    @guarded
    def resume(self, handle: TrackedOperation) -> Execution:
        """Dispatch (once) an intent taken over from an owner that went away before it did."""
        return self._drive(execution.resume(self.collaborators, handle))

    @guarded
    def load(self, operation_id: str, tenant_id: str) -> TrackedOperation:
        """The operation as the log says it is now (read-only handle, no lease)."""
        return execution.load(self.collaborators, operation_id, tenant_id)

    @guarded
    def cancel(
        self, operation_id: str, tenant_id: str, actor_id: str, reason: str
    ) -> TrackedOperation:
        """Cancel an operation: final before dispatch, reconciled (never retried) after it."""
        return execution.cancel(
            self.collaborators,
            operation_id,
            tenant_id,
            actor_id,
            reason,
            append=lambda events, known: self.append(events, known=known),
        )

    @guarded
    def take_over(
        self,
        operation_id: str,
        tenant_id: str,
        *,
        reason: str,
        ttl: timedelta | None = None,
        force: bool = False,
    ) -> TrackedOperation:
        """Take the operation over under a new lease (recorded first), as it is now."""
        return execution.take_over(
            self.collaborators, operation_id, tenant_id, reason=reason, ttl=ttl, force=force
        )

    # -- execution ---------------------------------------------------------------------------

    @guarded
    def intent(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        operation_id: str | None = None,
        *,
        lease_ttl: timedelta | None = None,
    ) -> TrackedOperation:
        """Record INTENT_RECORDED for a new operation; returns its handle once acknowledged.

        With a lease store (``connect`` has one), the operation's lease (token 1, for
        ``lease_ttl``) and its request are stored in one commit: the request lets a recovery
        worker dispatch the intent if this process goes away before it does. For an id this
        recorder makes, nobody else's, the commit runs while the intent's acknowledgement is in
        flight, and the handle comes back once both are done; for an ``operation_id`` passed in,
        which may be someone else's, the lease comes first and nothing is sent without it.

        If the lease cannot be taken (LeaseLostError, PostgreSQL down), that error is raised and
        nothing more is appended. The intent of a fresh id may be in the log by then, with token
        1, no lease and no stored request: the recovery worker takes it over once projected and
        parks it (no request to dispatch it with), so it is never called. (Should the commit
        have happened unseen, the intent is one whose owner went away: dispatched once by the
        recovery worker when the lease expires.)

        ``operation_id`` defaults to a fresh ``op_`` ULID; pass one to record a known operation.
        Only the hash of ``arguments`` (canonical JSON) travels, never the arguments. If the
        append fails, the error's ``handles`` holds the handle, in doubt: resend it.
        """
        return self._drive(
            execution.intent_steps(
                self.collaborators,
                tenant_id,
                actor_id,
                tool_name,
                arguments,
                operation_id=operation_id,
                lease_ttl=lease_ttl,
            )
        )

    @guarded
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
        return self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.DISPATCHED, actor_id, provider_ref=provider_ref
            ),
        )

    @guarded
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
        return self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle,
                ExecutionState.SUCCEEDED,
                actor_id,
                provider_ref=provider_ref,
                result=result,
                content_type=content_type,
            ),
        )

    @guarded
    def failed(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """Record FAILED: the provider confirmed the call did not happen / did not succeed."""
        return self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.FAILED, actor_id, error=clean_error(error)
            ),
        )

    @guarded
    def unknown(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """Record UNKNOWN: contact was lost after dispatch; reconcile, never blind-retry."""
        return self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.UNKNOWN, actor_id, error=clean_error(error)
            ),
        )

    # -- delivery ----------------------------------------------------------------------------

    @guarded
    def delivery_pending(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record that the result must be delivered to ``destination`` (PENDING, attempt 0)."""
        return self._run(
            [handle],
            lambda: self._planner.plan_delivery(
                handle, destination, DeliveryState.PENDING, actor_id, attempt=0
            ),
        )

    @guarded
    def delivery_sent(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record a send to ``destination`` (SENT, one more attempt)."""
        return self._run(
            [handle],
            lambda: self._planner.plan_delivery(handle, destination, DeliveryState.SENT, actor_id),
        )

    @guarded
    def delivery_acked(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """Record that ``destination`` acknowledged receipt (ACKED)."""
        return self._run(
            [handle],
            lambda: self._planner.plan_delivery(handle, destination, DeliveryState.ACKED, actor_id),
        )

    @guarded
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
        due = as_aware(next_attempt_at)
        if destination not in handle.state.deliveries:
            raise IllegalTransitionError(f"no delivery to {destination} to retry; nothing was sent")
        return self._run(
            [handle],
            lambda: self._planner.plan_delivery(
                handle,
                destination,
                DeliveryState.PENDING,
                actor_id,
                next_attempt_at=due,
                error=clean_error(error),
            ),
        )

    @guarded
    def delivery_dead_lettered(
        self,
        handle: TrackedOperation,
        destination: str,
        error: str | BaseException,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """Give up on delivering to ``destination`` (DEAD_LETTERED), saying why."""
        return self._run(
            [handle],
            lambda: self._planner.plan_delivery(
                handle, destination, DeliveryState.DEAD_LETTERED, actor_id, error=clean_error(error)
            ),
        )

    # -- batches and doubt ---------------------------------------------------------------------

    @guarded
    def append(
        self, events: Sequence[OperationEvent], *, known: Iterable[TrackedOperation] = ()
    ) -> dict[str, TrackedOperation]:
        """Append many already-built events with one wait for all acknowledgements.

        Each event is folded, in order, onto its operation: the handle in ``known`` if given
        (updated after the ack), else an empty history, so an operation whose earlier events
        were appended by another call must be passed in ``known`` (a delivery needs its
        execution). An execution event of a handle holding a lease is written under that lease
        (its token is filled in when the event has none). One illegal event refuses the whole
        batch before anything is sent; repeats are dropped. Returns the handles of every
        operation touched.
        """
        handles = {h.operation_id: h for h in known}
        touched: dict[str, TrackedOperation] = {}

        def plan() -> Plan | None:
            planned = self._planner.plan_append(events, handles)
            if planned is not None:
                touched.update((p.handle.operation_id, p.handle) for p in planned.parts)
            return planned

        self._run(handles.values(), plan)
        return touched

    @guarded
    def resend(self, handle: TrackedOperation) -> bool:
        """Send the in-doubt events of ``handle`` again, identical (same event ids), and settle
        the handle once they are acknowledged. Returns False when nothing was in doubt."""
        return self._run([handle], lambda: self._planner.plan_resend(handle))

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Refuse new calls, let the running ones finish (up to ``timeout`` seconds), then flush
        queued records and close what this recorder opened. Closing again does nothing; in a
        forked child it only lets go of the parent's connections."""
        if self._forked_close():
            return
        self._stop_calls(timeout)
        owned, self._owned = self._owned, []
        for item in owned:
            item.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O -------------------------------------------------------------------------------------

    def _drive(self, steps: Steps[T]) -> T:
        return Stepper(steps).run(self._perform)

    def _perform(self, effect: Effect) -> Any:
        """Do what a step asks for, in this thread (see ``producers.steps``)."""
        if isinstance(effect, Record):
            return self._run([effect.handle], effect.planner, effect.alongside)
        if isinstance(effect, Send):
            if effect.alongside is None:
                return self._transport.send(effect.records)
            return self._send_alongside(effect.records, effect.alongside)
        if isinstance(effect, Blocking):
            return effect.work()
        if isinstance(effect, Call):
            # Asyncio providers are refused when the recorder is built.
            return cast(Provider, effect.provider).call(effect.request, effect.key)
        time.sleep(effect.seconds)
        return None

    def _send_alongside(
        self, records: Sequence[OutgoingRecord], work: Callable[[], None]
    ) -> Positions | None:
        """Hand ``records`` over, do ``work`` while they are in flight, then wait for them
        (``producers.steps.Send``; the steps ask for it only of a SplitTransport)."""
        transport = cast(SplitTransport, self._transport)
        submitted: Any = None
        positions: Positions | None = None
        send_error: Exception | None = None
        work_error: Exception | None = None
        try:
            submitted = transport.submit(records)
        except Exception as exc:
            send_error = exc
        try:
            work()
        except Exception as exc:
            work_error = exc
        if send_error is None:
            try:
                positions = transport.wait(submitted)
            except Exception as exc:
                send_error = exc
        return cast(Positions | None, alongside_outcome(positions, send_error, work_error))

    def _run(
        self,
        handles: Iterable[TrackedOperation],
        planner: Callable[[], Plan | None],
        alongside: Callable[[], None] | None = None,
    ) -> bool:
        if isinstance(handles, list) and len(handles) == 1:
            # The per-call API's one handle: its lock alone, without sorting and an ExitStack.
            with handles[0].lock:
                return self._drive(self._append_steps(planner, alongside))
        with _locked(handles):
            return self._drive(self._append_steps(planner, alongside))
