"""The asyncio recorder, for agent runtimes built on asyncio.

Same rules and same planning code as :class:`producers.recorder.TransitionRecorder`; only the
waiting differs. An acknowledgement is awaited without blocking the event loop (the producer's
report thread resolves a future), and the PostgreSQL write of a result payload runs on a small
thread pool of its own, so a slow commit never stalls other tasks.

    async with AsyncTransitionRecorder.connect(settings) as recorder:
        op = await recorder.intent("acme", "agent-7", "send_email", {"to": "a@example.com"})
        await recorder.dispatched(op, provider_ref=op.operation_id)
        await recorder.succeeded(op, b'{"status": "sent"}', content_type="application/json")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, Self

from ledger.codec import Codec
from ledger.domain.events import OperationEvent
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.errors import DeliveryError, IllegalTransitionError, RecordError
from ledger.faults import fault_point
from ledger.metrics import Metrics
from ledger.results import ResultStore
from ledger.settings import Settings
from ledger.transport import DEFAULT_DELIVERY_TIMEOUT_S, KafkaTransport, Transport
from producers.operation import TrackedOperation, as_aware
from producers.recorder import (
    FIRST_TOKEN,
    Clock,
    Entropy,
    Plan,
    RecorderCore,
    canonical_request,
    clean_error,
)


class AsyncTransitionRecorder(RecorderCore):
    """:class:`~producers.recorder.TransitionRecorder` for asyncio; every method is awaited.

    Tasks sharing one recorder each wait for their own acknowledgements; calls on one handle are
    serialised by the handle's asyncio lock. A handle is used by one kind of recorder: the
    threaded recorder's lock and this one's do not exclude each other.
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
        store_threads: int = 16,
    ) -> None:
        super().__init__(settings, clock_ns=clock_ns, entropy=entropy, codec=codec, metrics=metrics)
        self._transport = transport
        self._results = results
        self._owned = list(owns)
        self._store_pool = ThreadPoolExecutor(store_threads, thread_name_prefix="opledger-results")

    @classmethod
    def connect(
        cls,
        settings: Settings,
        *,
        with_results: bool = True,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        compression: str = "lz4",
        metrics: Metrics | None = None,
    ) -> Self:
        """A recorder with its own Kafka producer and result store (see the threaded one).

        Nothing here blocks for long: the producer connects in the background and the result
        store's pool opens its connections on demand.
        """
        transport = KafkaTransport(
            settings, delivery_timeout_s=delivery_timeout_s, compression=compression
        )
        results = None
        if with_results:
            results = ResultStore.connect(settings.dsn)
            results.migrate()
        owned: list[Transport | ResultStore] = [transport]
        if results is not None:
            owned.append(results)
        return cls(settings, transport, results=results, metrics=metrics, owns=owned)

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
        """See :meth:`TransitionRecorder.intent`."""
        handle = TrackedOperation.unknown(operation_id or self.new_operation_id())
        request, request_hash = canonical_request(tool_name, arguments)
        event = self._intent_event(
            handle.operation_id,
            tenant_id=tenant_id,
            actor_id=actor_id,
            tool_name=tool_name,
            request_hash=request_hash,
            lease_token=None if self._leases is None else FIRST_TOKEN,
        )
        if self._leases is not None:
            leases = self._leases
            handle.lease = await asyncio.get_running_loop().run_in_executor(
                self._store_pool,
                lambda: leases.create(
                    handle.operation_id,
                    tenant_id,
                    self._lease_ttl if lease_ttl is None else lease_ttl,
                    tool_name=tool_name,
                    request_hash=request_hash,
                    request=request,
                ),
            )
        await self._run([handle], lambda: self._plan_events(handle, [event]))
        return handle

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
            lambda: self._plan_execution(
                handle, ExecutionState.DISPATCHED, actor_id, provider_ref=provider_ref
            ),
        )

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
            lambda: self._plan_execution(
                handle,
                ExecutionState.SUCCEEDED,
                actor_id,
                provider_ref=provider_ref,
                result=result,
                content_type=content_type,
            ),
        )

    async def failed(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.failed`."""
        return await self._run(
            [handle],
            lambda: self._plan_execution(
                handle, ExecutionState.FAILED, actor_id, error=clean_error(error)
            ),
        )

    async def unknown(
        self, handle: TrackedOperation, error: str | BaseException, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.unknown`."""
        return await self._run(
            [handle],
            lambda: self._plan_execution(
                handle, ExecutionState.UNKNOWN, actor_id, error=clean_error(error)
            ),
        )

    async def delivery_pending(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_pending`."""
        return await self._run(
            [handle],
            lambda: self._plan_delivery(
                handle, destination, DeliveryState.PENDING, actor_id, attempt=0
            ),
        )

    async def delivery_sent(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_sent`."""
        return await self._run(
            [handle],
            lambda: self._plan_delivery(handle, destination, DeliveryState.SENT, actor_id),
        )

    async def delivery_acked(
        self, handle: TrackedOperation, destination: str, *, actor_id: str | None = None
    ) -> bool:
        """See :meth:`TransitionRecorder.delivery_acked`."""
        return await self._run(
            [handle],
            lambda: self._plan_delivery(handle, destination, DeliveryState.ACKED, actor_id),
        )

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
            lambda: self._plan_delivery(
                handle,
                destination,
                DeliveryState.PENDING,
                actor_id,
                next_attempt_at=due,
                error=clean_error(error),
            ),
        )

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
            lambda: self._plan_delivery(
                handle, destination, DeliveryState.DEAD_LETTERED, actor_id, error=clean_error(error)
            ),
        )

    async def append(
        self, events: Sequence[OperationEvent], *, known: Iterable[TrackedOperation] = ()
    ) -> dict[str, TrackedOperation]:
        """See :meth:`TransitionRecorder.append`."""
        handles = {h.operation_id: h for h in known}
        touched: dict[str, TrackedOperation] = {}

        def plan() -> Plan | None:
            planned = self._plan_append(events, handles)
            if planned is not None:
                touched.update((p.handle.operation_id, p.handle) for p in planned.parts)
            return planned

        await self._run(handles.values(), plan)
        return touched

    async def resend(self, handle: TrackedOperation) -> bool:
        """See :meth:`TransitionRecorder.resend`."""
        return await self._run([handle], lambda: self._plan_resend(handle))

    async def close(self) -> None:
        """Flush queued records and close what this recorder opened."""
        owned, self._owned = self._owned, []
        loop = asyncio.get_running_loop()
        for item in owned:
            await loop.run_in_executor(self._store_pool, item.close)
        self._store_pool.shutdown(wait=False)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(
        self, handles: Iterable[TrackedOperation], planner: Callable[[], Plan | None]
    ) -> bool:
        async with contextlib.AsyncExitStack() as stack:
            for handle in sorted(handles, key=lambda h: h.operation_id):
                await stack.enter_async_context(handle.async_lock)
            plan = planner()
            if plan is None:
                return False
            loop = asyncio.get_running_loop()
            if plan.payload is not None:
                if self._results is None:
                    raise RecordError(
                        "succeeded(bytes) needs a result store: connect with with_results=True "
                        "or pass results=; nothing was sent"
                    )
                await loop.run_in_executor(self._store_pool, self._results.put, *plan.payload)
                fault_point("producer.after_result_write_before_record")
            records = plan.records
            started = time.monotonic()
            try:
                send_async = getattr(self._transport, "send_async", None)
                if send_async is not None:
                    await send_async(records)
                else:
                    await loop.run_in_executor(self._store_pool, self._transport.send, records)
            except RecordError as exc:
                raise self._doubt(plan, exc) from None
            except Exception as exc:  # the client itself failed: the outcome is unknown
                raise self._doubt(
                    plan, DeliveryError(f"the Kafka client failed while appending: {exc!r}")
                ) from exc
            except BaseException:
                # Interrupted (a cancelled task, Ctrl-C) with records in flight: whether they
                # landed is unknown, so the handles must not be used as if they had not.
                self._doubt(
                    plan, DeliveryError("interrupted while waiting for the acknowledgement")
                )
                raise
            self._settle(plan)
            self._observe(records, time.monotonic() - started)
            return True
