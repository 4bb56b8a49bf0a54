"""Per-call timing shared by ``bench_sdk_calls.py`` and its DBOS baseline (``dbos_calls.py``).

Standard library only: the DBOS side runs it in DBOS's own virtualenv, so both systems are timed
by the same code. A mode runs ``calls`` calls after ``warmup`` untimed ones with the same number
of callers; callers take the next call from a shared counter until ``calls`` are done, so every
mode runs exactly ``calls`` calls whatever the callers' speeds. A call that raises is counted
and the first error kept; the mode goes on, so a broken mode is reported instead of crashing
the run.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

Call = Callable[[], object]
AsyncCall = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class Summary:
    """One mode's figures: latencies of the calls that succeeded, throughput over wall time."""

    mode: str
    calls: int
    ok: int
    failures: int
    first_error: str | None
    p50_ms: float | None
    p99_ms: float | None
    calls_per_s: float | None
    elapsed_s: float
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        return cls(**data)

    @classmethod
    def unavailable(cls, mode: str, note: str) -> Summary:
        return cls(mode, 0, 0, 0, None, None, None, None, 0.0, note)


def mode_names(callers: int) -> tuple[str, str, str]:
    """The three modes' labels, the same on both sides of the comparison."""
    return "sequential", f"{callers} threads", f"{callers} asyncio tasks"


def tool_result(number: int) -> bytes:
    """The small JSON result of call ``number``; distinct per call, as real results are (a
    repeated payload would make opledger's content-addressed insert a no-op)."""
    return b'{"status": "sent", "message_id": "msg-%d"}' % number


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an already sorted, non-empty list."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


class _Tally:
    """Latencies and failures of one timed run; appended from many threads or tasks."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failures = 0
        self.first_error: str | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if self.first_error is None:
                self.first_error = f"{type(exc).__name__}: {exc}"[:400]

    def summary(self, mode: str, calls: int, elapsed: float, note: str | None = None) -> Summary:
        latencies = sorted(self.latencies)
        ok = len(latencies)
        # Calls never started (a hung mode) count as failures too.
        failures = calls - ok
        return Summary(
            mode=mode,
            calls=calls,
            ok=ok,
            failures=failures,
            first_error=self.first_error,
            p50_ms=percentile(latencies, 50) * 1000 if ok else None,
            p99_ms=percentile(latencies, 99) * 1000 if ok else None,
            calls_per_s=ok / elapsed if ok and elapsed > 0 else None,
            elapsed_s=elapsed,
            note=note,
        )


def _timed_loop(call: Call, tally: _Tally, remaining: Callable[[], bool]) -> None:
    clock = time.perf_counter
    record = tally.latencies.append
    while remaining():
        started = clock()
        try:
            call()
        except Exception as exc:
            tally.failed(exc)
            continue
        record(clock() - started)


def run_threads(
    mode: str, call: Call, *, calls: int, callers: int, warmup: int, timeout_s: float
) -> Summary:
    """``calls`` calls from ``callers`` threads (1 = sequential, on the calling thread)."""
    if warmup:
        _run_threads_once(call, warmup, callers, timeout_s)
    gc.collect()
    tally, elapsed, note = _run_threads_once(call, calls, callers, timeout_s)
    return tally.summary(mode, calls, elapsed, note)


def _run_threads_once(
    call: Call, calls: int, callers: int, timeout_s: float
) -> tuple[_Tally, float, str | None]:
    tally = _Tally()
    tickets = itertools.count()  # next() on a count is atomic under the GIL
    stop = threading.Event()

    def remaining() -> bool:
        return not stop.is_set() and next(tickets) < calls

    if callers == 1:
        started = time.perf_counter()
        _timed_loop(call, tally, remaining)
        return tally, time.perf_counter() - started, None
    barrier = threading.Barrier(callers + 1)

    def caller() -> None:
        barrier.wait()
        _timed_loop(call, tally, remaining)

    # Daemons: a caller stuck in a broken client must not keep the benchmark from exiting.
    threads = [threading.Thread(target=caller, daemon=True) for _ in range(callers)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    deadline = started + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    elapsed = time.perf_counter() - started
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        stop.set()
        return tally, elapsed, f"{stuck} callers still inside a call after {timeout_s:.0f}s"
    return tally, elapsed, None


async def run_tasks(
    mode: str, call: AsyncCall, *, calls: int, callers: int, warmup: int, timeout_s: float
) -> Summary:
    """``calls`` calls from ``callers`` asyncio tasks on the running loop."""
    if warmup:
        await _run_tasks_once(call, warmup, callers, timeout_s)
    gc.collect()
    tally, elapsed, note = await _run_tasks_once(call, calls, callers, timeout_s)
    return tally.summary(mode, calls, elapsed, note)


async def _run_tasks_once(
    call: AsyncCall, calls: int, callers: int, timeout_s: float
) -> tuple[_Tally, float, str | None]:
    tally = _Tally()
    tickets = itertools.count()
    clock = time.perf_counter

    async def caller() -> None:
        while next(tickets) < calls:
            began = clock()
            try:
                await call()
            except Exception as exc:
                tally.failed(exc)
                continue
            tally.latencies.append(clock() - began)

    started = clock()
    tasks = [asyncio.create_task(caller()) for _ in range(callers)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    elapsed = clock() - started
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5)
    note = f"{len(pending)} tasks still inside a call after {timeout_s:.0f}s" if pending else None
    return tally, elapsed, note
