"""The asyncio recorder, for agent runtimes built on asyncio.

Same rules and same planning code as :class:`producers.recorder.TransitionRecorder`, and the same
``execute`` (``producers.execution``: the steps are written once, and this recorder awaits
each); only the waiting differs. An acknowledgement is awaited without blocking the event loop
(the producer's report thread resolves a future); the blocking PostgreSQL work (result payloads,
the lease, the policy check, history reads) runs on a small thread pool of the recorder's own,
and a synchronous provider's ``call`` on another, so neither a slow commit nor a slow tool stalls
other tasks.

    async with AsyncTransitionRecorder.connect(settings, providers=[email]) as recorder:
        done = await recorder.execute("acme", "agent-7", "send_email", {"to": "a@example.com"})
        if done.state is ExecutionState.UNKNOWN:
            ...  # contact was lost after dispatch: reconciled by the recovery worker, not retried

    async with AsyncTransitionRecorder.connect(settings) as recorder:
        op = await recorder.intent("acme", "agent-7", "send_email", {"to": "a@example.com"})
        await recorder.dispatched(op, provider_ref=op.operation_id)
        await recorder.succeeded(op, b'{"status": "sent"}', content_type="application/json")
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, Self, Unpack, cast

from ledger.domain.events import OperationEvent
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import IllegalTransitionError
from ledger.log import OutgoingRecord, Positions, SplitTransport, Transport
from ledger.settings import Settings
from ledger.tools import CallOutcome, ContactLost, Provider, is_async
from producers import execution
from producers.execution import Execution
from producers.operation import TrackedOperation, as_aware
from producers.planner import Plan, clean_error
from producers.recorder import CLOSE_WAIT_S, RecorderCore, RecorderOptions, guarded_async
from producers.steps import (
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


class AsyncTransitionRecorder(RecorderCore):
    """:class:`~producers.recorder.TransitionRecorder` for asyncio; every method is awaited.

    Tasks sharing one recorder each wait for their own acknowledgements; calls on one handle are
    serialised by the handle's asyncio lock. A handle is used by one kind of recorder: the
    threaded recorder's lock and this one's do not exclude each other.

    Build it with ``connect(settings, providers=..., owner=..., tool_threads=32)``, as the
    threaded one. Providers may be :class:`~ledger.tools.AsyncProvider` (awaited) or synchronous
    :class:`~ledger.tools.Provider` (called on one of ``tool_threads`` threads, apart from the
    ``store_threads`` that do the recorder's PostgreSQL work). Either way a call gets
    ``terms.call_timeout``; past it the outcome is unknown (UNKNOWN, reconciled). A synchronous
    call still waiting for a free thread when its timeout ends is never made: it is recorded
    FAILED ("not called").
    """

    awaits_providers = True

    def __init__(
        self,
        settings: Settings,
        transport: Transport,
        *,
        store_threads: int = 16,
        tool_threads: int = 32,
        **options: Unpack[RecorderOptions],
    ) -> None:
        super().__init__(settings, transport, **options)
        self._store_pool = ThreadPoolExecutor(store_threads, thread_name_prefix="opledger-results")
        # Apart from the store's threads: tools that hang must not hold up the ledger's writes.
        self._tool_threads = tool_threads
        self._tool_pool = ThreadPoolExecutor(tool_threads, thread_name_prefix="opledger-tools")

    @guarded_async
    async def execute(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        *,
        operation_id: str | None = None,
    ) -> Execution:
        """See :meth:`TransitionRecorder.execute`: the same steps, fault points and result.
        Lost contact (the provider's :class:`~ledger.tools.ContactLost`, any other exception from
        the call, or no answer within the tool's call timeout) is UNKNOWN, returned."""
        return await self._drive(
            execution.execute(
                self.collaborators,
                tenant_id,
                actor_id,
                tool_name,
                arguments,
                operation_id=operation_id,
            )
        )

    @guarded_async
    async def intent(
        self,
        tenant_id: str,
        actor_id: str,
        tool_name: str,
        arguments: Any,
        operation_id: str | None = None,
        *,
        lease_ttl: timedelta | None = None,
    ) -> TrackedOperation:
        """See :meth:`TransitionRecorder.intent` (the lease and request are stored off the event
        loop, while the intent's acknowledgement is awaited when the id is a fresh one)."""
        return await self._drive(
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

    @guarded_async
    async def dispatched(
        self,
        handle: TrackedOperation,
        provider_ref: str | None = None,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """See :meth:`TransitionRecorder.dispatched`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.DISPATCHED, actor_id, provider_ref=provider_ref
            ),
        )

    @guarded_async
    async def succeeded(
        self,
        handle: TrackedOperation,
        result: bytes | str,
        *,
        content_type: str = "application/octet-stream",
        provider_ref: str | None = None,
        actor_id: str | None = None,
    ) -> bool:
        """See :meth:`TransitionRecorder.succeeded`."""
        return await self._run(
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

    @guarded_async
    async def failed(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.failed`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.FAILED, actor_id, error=clean_error(error)
            ),
        )

    @guarded_async
    async def unknown(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.unknown`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_execution(
                handle, ExecutionState.UNKNOWN, actor_id, error=clean_error(error)
            ),
        )

    @guarded_async
    async def delivery_pending(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_pending`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_delivery(
                handle, destination, DeliveryState.PENDING, actor_id, attempt=0
            ),
        )

    @guarded_async
    async def delivery_sent(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_sent`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_delivery(handle, destination, DeliveryState.SENT, actor_id),
        )

    @guarded_async
    async def delivery_acked(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_acked`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_delivery(handle, destination, DeliveryState.ACKED, actor_id),
        )

    @guarded_async
    async def delivery_retry(
        self,
        handle: TrackedOperation,
        destination: str,
        next_attempt_at: datetime,
        error: str | BaseException,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_retry`."""
        due = as_aware(next_attempt_at)
        if destination not in handle.state.deliveries:
            raise IllegalTransitionError(f"no delivery to {destination} to retry; nothing was sent")
        return await self._run(
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

    @guarded_async
    async def delivery_dead_lettered(
        self,
        handle: TrackedOperation,
        destination: str,
        error: str | BaseException,
        *,
        actor_id: str | None = None,
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_dead_lettered`."""
        return await self._run(
            [handle],
            lambda: self._planner.plan_delivery(
                handle, destination, DeliveryState.DEAD_LETTERED, actor_id, error=clean_error(error)
            ),
        )

    @guarded_async
    async def append(
        self, events: Sequence[OperationEvent], *, known: Iterable[TrackedOperation] = ()
    ) -> dict[str, TrackedOperation]:
        """See :meth:`TransitionRecorder.append`."""
        handles = {h.operation_id: h for h in known}
        touched: dict[str, TrackedOperation] = {}

        def plan() -> Plan | None:
            planned = self._planner.plan_append(events, handles)
            if planned is not None:
                touched.update((p.handle.operation_id, p.handle) for p in planned.parts)
            return planned

        await self._run(handles.values(), plan)
        return touched

    @guarded_async
    async def resend(self, handle: TrackedOperation) -> bool:
        """See :meth:`TransitionRecorder.resend`."""
        return await self._run([handle], lambda: self._planner.plan_resend(handle))

    async def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Refuse new calls, let the running ones finish (up to ``timeout`` seconds), then flush
        queued records and close what this recorder opened. A tool call still running on a
        thread (its caller gave up on it) is left to finish on its own. Closing again does
        nothing; in a forked child it only lets go of the parent's connections."""
        if self._forked_close():
            return
        if self._calls:
            # The running calls need this event loop to finish: wait off it.
            await asyncio.to_thread(self._stop_calls, timeout)
        else:
            self._stop_calls(0)
        owned, self._owned = self._owned, []
        loop = asyncio.get_running_loop()
        for item in owned:
            await loop.run_in_executor(self._store_pool, item.close)
        self._store_pool.shutdown(wait=False)
        self._tool_pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _drive(self, steps: Steps[T]) -> T:
        return await Stepper(steps).run_async(self._perform)

    async def _perform(self, effect: Effect) -> Any:
        """Do what a step asks for without blocking the event loop (see ``producers.steps``)."""
        loop = asyncio.get_running_loop()
        if isinstance(effect, Record):
            return await self._run([effect.handle], effect.planner, effect.alongside)
        if isinstance(effect, Send):
            if effect.alongside is not None:
                return await self._send_alongside(effect.records, effect.alongside)
            send_async = getattr(self._transport, "send_async", None)
            if send_async is not None:
                return await send_async(effect.records)
            records = effect.records
            return await loop.run_in_executor(self._store_pool, self._transport.send, records)
        if isinstance(effect, Blocking):
            return await loop.run_in_executor(self._store_pool, effect.work)
        if isinstance(effect, Call):
            return await self._call(effect)
        await asyncio.sleep(effect.seconds)
        return None

    async def _send_alongside(
        self, records: Sequence[OutgoingRecord], work: Callable[[], None]
    ) -> Positions | None:
        """Hand ``records`` over, run ``work`` on the store's threads while they are in flight,
        then await them (``producers.steps.Send``; asked only of a SplitTransport)."""
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
            await asyncio.get_running_loop().run_in_executor(self._store_pool, work)
        except Exception as exc:
            work_error = exc
        if send_error is None:
            try:
                positions = await transport.wait_async(submitted)
            except Exception as exc:
                send_error = exc
        return cast(Positions | None, alongside_outcome(positions, send_error, work_error))

    async def _call(self, call: Call) -> CallOutcome:
        provider = call.provider
        seconds = provider.terms.call_timeout.total_seconds()
        gave_up = ContactLost(f"{provider.tool_name}: no answer within {seconds:g}s")
        if is_async(provider):
            try:
                return await asyncio.wait_for(provider.call(call.request, call.key), seconds)
            except TimeoutError:
                raise gave_up from None
        blocking = cast(Provider, provider).call  # not an AsyncProvider, as checked above
        queued = self._tool_pool.submit(blocking, call.request, call.key)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(queued), seconds)
        except TimeoutError:
            if queued.cancel():
                # It never left the queue (every tool thread stayed busy), and now never will:
                # the call provably did not happen, which is a confirmed failure.
                return CallOutcome(
                    False,
                    error=f"{provider.tool_name}: not called: all {self._tool_threads} tool "
                    f"threads stayed busy for the call timeout ({seconds:g}s)",
                )
            raise gave_up from None

    async def _run(
        self,
        handles: Iterable[TrackedOperation],
        planner: Callable[[], Plan | None],
        alongside: Callable[[], None] | None = None,
    ) -> bool:
        async with contextlib.AsyncExitStack() as stack:
            for handle in sorted(handles, key=lambda h: h.operation_id):
                await stack.enter_async_context(handle.async_lock)
            return await self._drive(self._append_steps(planner, alongside))
