"""The lookup pass: what became of each UNKNOWN attempt, asked of its provider by idempotency key
(decision 018), and the operations decided a group at a time as the answers come back.

A provider with :class:`BatchLookup` is asked a pass's keys at once from one thread; the others
one key per lookup thread. A provider that stops answering stalls only its own operations: once no
answer has come for the longest call timeout plus ``LOOKUP_GRACE``, the lookups still out are left
for a later pass (backed off, :class:`Backoff`), and an operation is not asked about again until
its unanswered lookup has returned. An answer nobody can read is "I cannot tell"
(``UNAVAILABLE``), never a reason to call.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol, runtime_checkable

from ledger.domain import ids
from ledger.domain.reconcile import LookupStatus
from ledger.domain.states import ExecutionState
from ledger.metrics import Metrics
from ledger.tools import LookupResult, Provider
from processors.recovery.records import Operation, guarded
from processors.recovery.texts import said

log = logging.getLogger("opledger.recovery")

#: Operations decided together as their lookups come back: policy is read once per subject for
#: each group, right before its decisions.
DECIDE_GROUP = 64
#: Backoff of a lookup the provider could not answer: doubles from the first to the last.
LOOKUP_BACKOFF = (timedelta(seconds=1), timedelta(seconds=60))
#: A pass waits for lookup answers at most this long past the longest call timeout without any
#: answer coming; the lookups still out are then left for a later pass.
LOOKUP_GRACE = timedelta(seconds=2)


@runtime_checkable
class BatchLookup(Protocol):
    """A provider that can be asked about many idempotency keys at once: the worker then asks
    a pass's keys through it from one thread, instead of one pool thread per lookup."""

    tool_name: str

    def lookup_many(
        self, requests: Sequence[tuple[str, str | None]]
    ) -> Iterator[tuple[int, LookupResult]]:
        """``Provider.lookup`` for each ``(idempotency_key, provider_ref)``: yields ``(index
        in requests, answer)`` as the answers come, one per request; "I cannot tell" is
        ``UNAVAILABLE``, never an exception."""
        ...


class Backoff:
    """A short in-memory backoff per operation whose provider could not answer: the only state
    the worker keeps of its own."""

    def __init__(self) -> None:
        #: operation id -> (monotonic time before which it is not looked at again, next delay)
        self._until: dict[str, tuple[float, timedelta]] = {}

    def waiting(self, operation_id: str, monotonic: float) -> bool:
        """Whether ``operation_id`` is not to be looked at yet, at monotonic time ``monotonic``."""
        backoff = self._until.get(operation_id)
        return backoff is not None and monotonic < backoff[0]

    def back_off(self, operation_id: str) -> None:
        """Put ``operation_id`` off for the next delay (doubled from the last one)."""
        first, last = LOOKUP_BACKOFF
        previous = self._until.get(operation_id)
        delay = first if previous is None else min(previous[1] * 2, last)
        self._until[operation_id] = (time.monotonic() + delay.total_seconds(), delay)

    def clear(self, operation_id: str) -> None:
        """``operation_id`` was answered: its next backoff starts from the first delay."""
        self._until.pop(operation_id, None)


#: Policy read and decisions made for a group of operations whose answers came back.
Decide = Callable[[Sequence[Operation]], None]


class Lookups:
    """Asks the providers about a pass's UNKNOWN attempts, on threads of its own."""

    def __init__(
        self,
        providers: Mapping[str, Provider],
        *,
        metrics: Metrics,
        backoff: Backoff,
        threads: int,
    ) -> None:
        self._providers = providers
        self._batch_lookups = {name for name, p in providers.items() if isinstance(p, BatchLookup)}
        self._metrics = metrics
        self._backoff = backoff
        # Lookups have threads of their own: one a provider never answers holds its thread,
        # never one the pass needs for its calls.
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="opledger-lookup")
        self._thread_count = threads
        #: operations whose lookup has not returned yet (perhaps from an earlier pass): not
        #: looked at again until it has, so a provider that hangs holds one thread per operation
        self._in_lookup: set[str] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def under_way(self, operation_id: str) -> bool:
        """Whether a lookup of ``operation_id`` has not returned yet."""
        with self._lock:
            return operation_id in self._in_lookup

    def look_up_and_decide(self, operations: Sequence[Operation], decide: Decide) -> None:
        """Ask the providers about every UNKNOWN attempt on the lookup threads and ``decide``
        the operations here as the answers come back, a group at a time: policy is read once
        per subject for a group, right before its decisions (current policy, seed rule 3;
        nothing is kept from one group to the next), while the threads ask about the rest.
        The intents (nothing to look up) are the first group."""
        live = [s for s in operations if s.failure is None]
        group = [s for s in live if s.execution.state is ExecutionState.INTENT_RECORDED]
        by_batch: dict[str, list[Operation]] = {}
        one_by_one: deque[Operation] = deque()
        for state in live:
            if state.execution.state is ExecutionState.UNKNOWN:
                if state.provider.tool_name in self._batch_lookups:
                    by_batch.setdefault(state.provider.tool_name, []).append(state)
                else:
                    one_by_one.append(state)
        answered: queue.SimpleQueue[Operation] = queue.SimpleQueue()
        outstanding = {id(s): s for s in one_by_one}
        outstanding.update((id(s), s) for batch in by_batch.values() for s in batch)
        with self._lock:
            self._in_lookup.update(s.execution.operation_id for s in outstanding.values())

        def drain() -> None:
            while True:
                try:
                    state = one_by_one.popleft()
                except IndexError:
                    return
                try:
                    guarded(state, self.look_up)
                finally:
                    self._looked_up([state])
                    answered.put(state)

        jobs = [self._threads.submit(self.look_up_many, b, answered) for b in by_batch.values()]
        threads = min(self._thread_count - len(jobs), len(one_by_one))
        jobs += [self._threads.submit(drain) for _ in range(max(threads, 1 if one_by_one else 0))]
        while True:
            if group:
                decide(group)
            if not outstanding:
                break
            group = self._answers(answered, min(DECIDE_GROUP, len(outstanding)), jobs)
            if not group:
                self._give_up(list(outstanding.values()), one_by_one)
                return
            for state in group:
                outstanding.pop(id(state), None)
        for job in jobs:  # a job still running after its last answer is not waited for
            if job.done() and job.exception() is not None:
                raise RuntimeError("a lookup thread died") from job.exception()

    def look_up(self, operation: Operation) -> None:
        """Ask the provider what became of an UNKNOWN attempt (a lookup never raises here)."""
        if operation.execution.state is not ExecutionState.UNKNOWN:
            return
        provider = operation.provider
        key = ids.idempotency_key(operation.execution.operation_id)
        try:
            lookup = provider.lookup(key, operation.execution.provider_ref)
        except Exception as exc:  # a lookup never decides anything by raising
            log.warning("lookup of %s raised: %s", key, said(exc))
            self._answer(operation, None)
        else:
            self._answer(operation, lookup)

    def look_up_many(
        self, operations: Sequence[Operation], answered: queue.SimpleQueue[Operation]
    ) -> None:
        """Ask one provider about ``operations`` at once (``BatchLookup``); each is put in
        ``answered`` once, with its answer or, if the provider broke off, its failure."""
        provider = operations[0].provider
        assert isinstance(provider, BatchLookup)
        unanswered = dict(enumerate(operations))
        try:
            for index, lookup in provider.lookup_many(
                [
                    (ids.idempotency_key(s.execution.operation_id), s.execution.provider_ref)
                    for s in operations
                ]
            ):
                if not isinstance(index, int):
                    continue  # not an index into the requests: never anyone's answer
                state = unanswered.pop(index, None)
                if state is None:  # a second answer to one request is ignored
                    continue
                try:
                    self._answer(state, lookup)
                except Exception as exc:  # pragma: no cover - _answer reads defensively
                    state.failure = exc
                finally:
                    self._looked_up([state])
                    answered.put(state)
        except Exception as exc:  # left for a later pass; never decided by raising
            log.warning("lookups of %s broke off: %s", provider.tool_name, said(exc))
            failure: Exception = exc
        else:
            failure = RuntimeError(f"{provider.tool_name}: lookup_many left requests unanswered")
        self._looked_up(unanswered.values())
        for state in unanswered.values():
            state.failure = failure
            answered.put(state)

    def _give_up(self, unanswered: Sequence[Operation], not_started: deque[Operation]) -> None:
        """No lookup answered for the patience: leave the operations still waiting for a later
        pass. Those whose lookup is under way stay marked as being looked up until it returns
        (whatever it says then is dropped); those not started yet are not started at all."""
        never: list[Operation] = []
        with contextlib.suppress(IndexError):
            while True:
                never.append(not_started.popleft())
        self._looked_up(never)
        patience = self._patience().total_seconds()
        tools = sorted({s.provider.tool_name for s in unanswered})
        log.warning(
            "%d lookups (%s) unanswered after %.1fs without any answer; left for a later pass",
            len(unanswered),
            ", ".join(tools),
            patience,
        )
        for state in unanswered:
            state.failure = TimeoutError(
                f"{state.provider.tool_name}: no lookup answer within {patience:.1f}s"
            )
            self._backoff.back_off(state.execution.operation_id)

    def _looked_up(self, operations: Iterable[Operation]) -> None:
        with self._lock:
            self._in_lookup.difference_update(s.execution.operation_id for s in operations)

    def _patience(self) -> timedelta:
        """How long a pass waits without any lookup answering before it gives up on the rest."""
        longest = max(p.terms.call_timeout for p in self._providers.values())
        return longest + LOOKUP_GRACE

    def _answer(self, operation: Operation, found: object) -> None:
        """Record the provider's answer; one nobody can read (not a ``LookupResult``, a status
        that is not a ``LookupStatus``, a result that is not bytes) is "I cannot tell":
        ``UNAVAILABLE``, retried later, never a reason to call."""
        if _readable(found):
            assert isinstance(found, LookupResult)
            status, lookup = found.status, found
        else:
            if found is not None:
                log.warning(
                    "%s: the lookup of %s answered %s, not a LookupResult with a LookupStatus "
                    "and bytes: taken as UNAVAILABLE",
                    operation.provider.tool_name,
                    ids.idempotency_key(operation.execution.operation_id),
                    type(found).__name__,
                )
            status, lookup = LookupStatus.UNAVAILABLE, None
        operation.lookup, operation.found = status, lookup
        self._metrics.provider_lookups.labels(operation.provider.tool_name, status.value).inc()

    def _answers(
        self,
        answered: queue.SimpleQueue[Operation],
        at_least: int,
        jobs: Sequence[Future[None]],
    ) -> list[Operation]:
        """At least ``at_least`` answered operations (more if they are there already); fewer,
        possibly none, once no answer has come for the lookup patience."""
        patience = self._patience().total_seconds()
        group: list[Operation] = []
        silent_since = time.monotonic()
        while len(group) < at_least:
            try:
                group.append(answered.get(timeout=min(1.0, patience)))
                silent_since = time.monotonic()
            except queue.Empty:
                for job in jobs:
                    if job.done() and job.exception() is not None:
                        raise RuntimeError("a lookup thread died") from job.exception()
                if time.monotonic() - silent_since >= patience:
                    break
        with contextlib.suppress(queue.Empty):
            while True:
                group.append(answered.get_nowait())
        return group


def _readable(found: object) -> bool:
    """Whether a lookup's answer can be acted on: a LookupResult whose status is a
    LookupStatus and whose result, if any, is bytes."""
    return (
        isinstance(found, LookupResult)
        and isinstance(found.status, LookupStatus)
        and (found.result is None or isinstance(found.result, bytes))
    )
