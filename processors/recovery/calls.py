"""The calls a pass's decisions permit (a resumed intent, a new attempt), each made once through
the call rule (``ledger.call_rule.perform_call``), as every path that calls a tool makes it: the
decision and the dispatch sent and acknowledged together before the call, the lease checked, the
call waited for at most its tool's call timeout, the answer judged by the rule and its outcome
queued for the pass's one send (its result stored first)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import timedelta
from typing import Any

from ledger.call_rule import immediately, perform_call, run_now
from ledger.domain.call import Judged
from ledger.domain.events import ReconciliationDecided
from ledger.domain.reconcile import Decision
from ledger.domain.states import ExecutionState
from ledger.leases import LeaseStore
from ledger.metrics import Metrics
from ledger.results import ResultStore
from ledger.tools import CallOutcome, ContactLost, Provider
from processors.recovery.detector import LEASE_MARGIN
from processors.recovery.records import Operation, Records, guarded
from processors.recovery.texts import recordable

#: Readies one operation's call once its stored request is read (or parks it).
Prepare = Callable[[Operation], None]


class Caller:
    """Makes the calls of a pass, many at a time, each on a call thread of its own."""

    def __init__(
        self,
        *,
        leases: LeaseStore,
        records: Records,
        results: ResultStore,
        metrics: Metrics,
        threads: int,
    ) -> None:
        self._leases = leases
        self._records = records
        self._results = results
        self._metrics = metrics
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-recover")
        # Calls have threads of their own: a call is waited for at most its tool's call timeout,
        # so one that never returns holds its thread, never the pass (every other operation
        # waits on it).
        self._call_threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-call")
        self._thread_count = threads

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._call_threads.shutdown(wait=False, cancel_futures=True)

    def with_requests(self, operations: Sequence[Operation], prepare: Prepare) -> list[Operation]:
        """The operations whose decision permits a call, with their stored requests (read in
        one statement) and ``prepare``d; one whose request was never stored is parked instead."""
        calling = [s for s in operations if s.failure is None and s.wants_call is not None]
        if not calling:
            return []
        try:
            stored = self._leases.requests(
                [(s.execution.operation_id, s.execution.tenant_id) for s in calling]
            )
        except Exception as exc:
            for state in calling:
                state.failure = exc
            return []
        ready = []
        for state in calling:
            state.stored_request = stored.get(state.execution.operation_id)
            guarded(state, prepare)
            if state.failure is None and state.decided is not None:
                ready.append(state)
        return ready

    def call_all(self, operations: Sequence[Operation]) -> None:
        """:meth:`call_stored` for each of ``operations`` (those not failed yet) on the thread
        pool. Each thread takes the next operation itself: one hand-off per thread, not per
        operation."""
        todo = deque(s for s in operations if s.failure is None)
        if not todo:
            return

        def drain() -> None:
            while True:
                try:
                    state = todo.popleft()
                except IndexError:
                    return
                guarded(state, self.call_stored)

        for job in [self._threads.submit(drain) for _ in range(min(self._thread_count, len(todo)))]:
            job.result()

    def call_stored(self, operation: Operation) -> None:
        """Record the decision and the dispatch it permits, then call the provider once with
        the stored request: the call rule (``ledger.call_rule``)."""
        decided = operation.decided
        assert decided is not None
        provider = operation.provider
        port = _CallPort(
            operation,
            decided,
            records=self._records,
            leases=self._leases,
            results=self._results,
            call=lambda key: self._bounded_call(provider, operation.request, key),
            ttl=provider.terms.call_timeout + LEASE_MARGIN,
        )
        judged = run_now(perform_call(port, operation.execution.operation_id, stage="recover"))
        outcome = judged.state.value.lower()
        self._metrics.provider_calls.labels(provider.tool_name, outcome).inc()
        if operation.wants_call is Decision.RESUME:
            operation.counted.append(self._metrics.resumed.labels(outcome))

    def _bounded_call(self, provider: Provider, request: Any, key: str) -> CallOutcome:
        """``provider.call`` on a call thread, waited for at most the tool's call timeout: past
        it the outcome is unknown (:class:`ContactLost`). A call still queued then, every call
        thread held by calls that never returned, is never made: a confirmed failure, as the
        SDK records it."""
        seconds = provider.terms.call_timeout.total_seconds()
        queued = self._call_threads.submit(provider.call, request, key)
        try:
            return queued.result(timeout=seconds)
        except FutureTimeoutError:
            if queued.cancel():
                return CallOutcome(
                    False,
                    error=f"{provider.tool_name}: not called: all {self._thread_count} call "
                    f"threads stayed busy for the call timeout ({seconds:g}s)",
                )
            raise ContactLost(f"{provider.tool_name}: no answer within {seconds:g}s") from None


class _CallPort:
    """The call rule's steps as the worker performs them for one operation of its pass: the
    decision and the dispatch sent and acknowledged together before the call, the outcome
    queued for the pass's one send (its result stored first)."""

    __slots__ = ("_call", "_decided", "_leases", "_operation", "_records", "_results", "_ttl")

    def __init__(
        self,
        operation: Operation,
        decided: ReconciliationDecided,
        *,
        records: Records,
        leases: LeaseStore,
        results: ResultStore,
        call: Callable[[str], CallOutcome],
        ttl: timedelta,
    ) -> None:
        self._operation = operation
        self._decided = decided
        self._records = records
        self._leases = leases
        self._results = results
        self._call = call
        self._ttl = ttl

    @immediately
    def keep_lease(self, *, now: bool) -> None:
        operation, leases = self._operation, self._leases
        if now and leases.holds(operation.lease):
            return
        if now or operation.lease.remaining() < self._ttl.total_seconds() / 2:
            # Reclaimed only if nobody took the operation over (else LeaseLostError: the
            # operation is left for a later pass, uncalled).
            operation.lease = leases.reclaim(operation.lease, self._ttl)

    @immediately
    def record_dispatch(self, provider_ref: str) -> None:
        operation = self._operation
        dispatch = self._records.transition(
            operation, ExecutionState.DISPATCHED, provider_ref=provider_ref, decided=self._decided
        )
        # Durable before the call (with whatever this operation queued before it), as always.
        self._records.append(operation, [self._decided, dispatch], now=True)

    @immediately
    def call(self, key: str) -> object:
        return self._call(key)

    @immediately
    def record_outcome(self, judged: Judged) -> None:
        operation, records = self._operation, self._records
        if judged.state is ExecutionState.SUCCEEDED:
            assert judged.result is not None
            result_ref = self._results.put(
                operation.execution.tenant_id, judged.result, judged.content_type
            )
            event = records.transition(
                operation,
                ExecutionState.SUCCEEDED,
                result_ref=result_ref,
                provider_ref=judged.provider_ref,
            )
        else:
            event = records.transition(
                operation, judged.state, error=recordable(judged.error or "")
            )
        records.append(operation, [event])
