"""UNKNOWN operations reconciled per second by the recovery worker, against the raw lookups.

Not a test. Needs the local stack. ``-n`` operations are left UNKNOWN (intent, dispatch, then
contact lost) for a tool whose provider, the fake provider as its own process (``opledger
fake-provider run``), did perform the call: each lookup finds it succeeded, so each operation
is reconciled the way of the seed's row 3 (lookup, policy re-check, recovered result stored,
decision and SUCCEEDED appended). The provider answers every lookup after ``--latency-ms``.

Timed: the recovery worker (``processors.recovery.worker.RecoveryWorker``, in this process,
wired as ``opledger recover run`` wires it, with the real HTTP adapter) running passes over all
partitions until every operation is decided. Between passes the projector folds what the
worker appended (in production it runs beside the worker in its own process), untimed.

Baseline, in the same run: the same number of lookups of the same keys, through the same HTTP
adapter, from a thread pool of the worker's size, with nothing else.

    .venv/bin/python bench/bench_reconciler.py [-n 3000] [--latency-ms 1] [--threads 32]
        [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry

from benchenv import isolated
from benchprojection import Projector, grant
from ledger.domain import ids
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.reconcile import LookupStatus
from ledger.domain.states import ExecutionState
from ledger.heap import freeze_startup_heap
from ledger.history import HistoryReader
from ledger.leases import LeaseStore, process_identity
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyStore
from ledger.results import ResultStore
from ledger.settings import Settings
from ledger.tools import LookupResult, ProviderTerms
from opledger.fakes.http_provider import FakeProviderControl, HttpToolProvider
from processors.recovery.worker import BATCH, RecoveryWorker
from producers import KafkaTransport, TransitionRecorder

ROOT = Path(__file__).resolve().parents[1]
TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"
GOAL_PER_S = 1000.0
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=5), key_retention=timedelta(days=1), repeat_safe=True
)
X = ExecutionState


@contextmanager
def fake_provider() -> Iterator[str]:
    """``opledger fake-provider run`` on a free port, as its own process; yields its URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", "fake-provider", "run", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("fake provider listening on "):
            raise SystemExit(f"the fake provider did not start: {line!r}")
        url = line.split()[-1]
        FakeProviderControl(url).wait_ready()
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def leave_unknown(settings: Settings, provider: HttpToolProvider, count: int) -> list[str]:
    """``count`` operations whose call the provider performed and whose answer was lost:
    INTENT_RECORDED, DISPATCHED and UNKNOWN on the topic, no lease (their owner is gone)."""
    recorder = TransitionRecorder.connect(settings, with_results=False)
    numbers = itertools.count()
    op_ids: list[str] = []
    try:
        for chunk in range(0, count, 500):
            size = min(500, count - chunk)
            events: list[ExecutionTransitioned] = []
            calls: list[tuple[dict[str, Any], str]] = []
            for _ in range(size):
                number = next(numbers)
                arguments = {"to": f"user{number}@example.com"}
                op_id = recorder.new_operation_id()
                op_ids.append(op_id)
                calls.append((arguments, op_id))
                events.extend(_unknown_events(op_id, arguments))
            # The provider really saw each call (the response is what got lost).
            with ThreadPoolExecutor(16) as pool:
                outcomes = list(pool.map(lambda c: provider.call(*c), calls))
            if not all(o.succeeded for o in outcomes):
                raise SystemExit("the fake provider refused a seeding call")
            recorder.append(events)
    finally:
        recorder.close()
    return op_ids


def _unknown_events(op_id: str, arguments: dict[str, Any]) -> list[ExecutionTransitioned]:
    request_hash = ids.request_hash(TOOL, arguments)
    common = {
        "operation_id": op_id,
        "tenant_id": TENANT,
        "actor_id": ACTOR,
        "tool_name": TOOL,
        "request_hash": request_hash,
    }
    steps = [
        (X.INTENT_RECORDED, 0, {}),
        (X.DISPATCHED, 1, {"provider_ref": op_id}),
        (X.UNKNOWN, 1, {"error": "contact lost after dispatch: connection reset"}),
    ]
    return [
        ExecutionTransitioned(
            event_id=ids.event_id(time.time_ns() // 1_000_000, os.urandom(10)),
            occurred_at=datetime.now(UTC),
            attempt=attempt,
            state=state,
            **common,
            **extra,
        )
        for state, attempt, extra in steps
    ]


def raw_lookups(provider: HttpToolProvider, keys: Sequence[str], threads: int) -> float:
    """Lookups per second: every key once with ``lookup``, from ``threads`` threads, nothing
    else."""
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        answers = list(pool.map(lambda key: provider.lookup(key, key), keys))
        elapsed = time.perf_counter() - started
    _all_found("raw lookups", answers, len(keys))
    return len(keys) / elapsed


def raw_lookup_many(provider: HttpToolProvider, keys: Sequence[str]) -> float:
    """Lookups per second: every key once, all in one ``lookup_many`` (the worker's way),
    nothing else."""
    started = time.perf_counter()
    answers = [answer for _, answer in provider.lookup_many([(key, key) for key in keys])]
    elapsed = time.perf_counter() - started
    _all_found("raw lookup_many", answers, len(keys))
    return len(keys) / elapsed


def _all_found(what: str, answers: Sequence[LookupResult], expected: int) -> None:
    found = sum(a.status is LookupStatus.FOUND_SUCCEEDED for a in answers)
    if found != expected:
        raise SystemExit(f"{what}: {found} of {expected} keys found")


@dataclass
class Worker:
    worker: RecoveryWorker
    owned: list[Any]

    def close(self) -> None:
        self.worker.close()
        for item in self.owned:
            item.close()


def build_worker(settings: Settings, provider: HttpToolProvider, threads: int) -> Worker:
    """The worker as ``opledger.recover.build`` wires it (pool of 40, no policy cache)."""
    pool = open_pool(settings.dsn, name="opledger-recovery", max_size=40)
    transport = KafkaTransport(settings)
    history = HistoryReader(settings, pool, client_id="opledger-recovery-history")
    worker = RecoveryWorker(
        settings,
        pool=pool,
        transport=transport,
        leases=LeaseStore(pool, process_identity("recover")),
        history=history,
        results=ResultStore(pool),
        policy=PolicyStore(pool, settings).evaluate_many,
        providers=[provider],
        metrics=Metrics.create(CollectorRegistry()),
        threads=threads,
    )
    return Worker(worker, [history, transport, pool])


class ThreadProfiles:
    """cProfile in every pool thread while it works on an operation (a lookup, a call); cProfile
    sees one thread only."""

    #: the worker's passes and their methods the pool's threads run, one operation each
    THREADED = (("lookups", "look_up"), ("lookups", "look_up_many"), ("calls", "call_stored"))

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.profiles: list[cProfile.Profile] = []

    def wrap(self, worker: RecoveryWorker) -> None:
        for pass_name, name in self.THREADED:
            worker_pass = getattr(worker, pass_name)
            setattr(worker_pass, name, self._profiled(getattr(worker_pass, name)))

    def _profiled(self, work: Callable[..., Any]) -> Callable[..., Any]:
        def profiled(*args: Any) -> Any:
            profile = getattr(self._local, "profile", None)
            if profile is None:
                profile = self._local.profile = cProfile.Profile()
                with self._lock:
                    self.profiles.append(profile)
            profile.enable()
            try:
                return work(*args)
            finally:
                profile.disable()

        return profiled


@dataclass(frozen=True, slots=True)
class Drain:
    decided: int
    passes: int
    worker_s: float
    wall_s: float
    #: CPU of this whole process (every thread) inside the passes
    worker_cpu_s: float


def drain(
    worker: RecoveryWorker,
    projector: Projector,
    settings: Settings,
    count: int,
    main_profile: cProfile.Profile | None = None,
) -> Drain:
    """Worker passes over every partition until ``count`` operations are decided; the
    projector catches up between passes (untimed)."""
    partitions = range(settings.partitions)
    decided = passes = 0
    worker_s = worker_cpu_s = 0.0
    started = time.perf_counter()
    deadline = time.monotonic() + 600
    while decided < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {decided} of {count} decided in 600 s")
        began, began_cpu = time.perf_counter(), time.process_time()
        if main_profile is not None:
            main_profile.enable()
        handled = worker.run_once(partitions)
        if main_profile is not None:
            main_profile.disable()
        worker_s += time.perf_counter() - began
        worker_cpu_s += time.process_time() - began_cpu
        decided += handled
        passes += 1
        projector.catch_up()
    return Drain(decided, passes, worker_s, time.perf_counter() - started, worker_cpu_s)


def check(settings: Settings, op_ids: Sequence[str], control: FakeProviderControl) -> None:
    """Every operation SUCCEEDED by reconciliation, with a stored result; no new call made."""
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            "SELECT count(*) FILTER (WHERE o.execution_state = 'SUCCEEDED' "
            "AND o.decision = 'MARK_SUCCEEDED' AND r.result_ref IS NOT NULL), count(*) "
            "FROM agent_operations o LEFT JOIN results r "
            "ON r.tenant_id = o.tenant_id AND r.result_ref = o.result_ref "
            "WHERE o.operation_id = ANY(%s)",
            (list(op_ids),),
        ).fetchone()
    assert rows is not None
    succeeded, total = rows
    stats = control.stats().tools[TOOL]
    if succeeded != len(op_ids) or total != len(op_ids) or stats.calls != len(op_ids):
        raise SystemExit(
            f"check failed: {succeeded} of {total} projected operations reconciled to "
            f"SUCCEEDED with a stored result (expected {len(op_ids)}); provider calls "
            f"{stats.calls} (expected {len(op_ids)}, one per operation: no new call)"
        )


def print_profiles(main: cProfile.Profile, threads: ThreadProfiles, top: int = 30) -> None:
    for label, stats in (
        (
            "the pass (main thread: find, take over, load, policy, decide, record)",
            pstats.Stats(main),
        ),
        ("lookups and calls (pool threads, merged)", _merged(threads.profiles)),
    ):
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            stats.stream = out  # type: ignore[attr-defined]
            stats.sort_stats(order).print_stats(top)
            print(f"\n== {label}, by {order} ==")
            print(out.getvalue())


def _merged(profiles: Sequence[cProfile.Profile]) -> pstats.Stats:
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=3000, help="UNKNOWN operations to reconcile")
    parser.add_argument("--latency-ms", type=float, default=1.0, help="provider answer delay")
    parser.add_argument("--threads", type=int, default=32, help="the worker's thread pool")
    parser.add_argument(
        "--profile", action="store_true", help="profile the worker (slower; rate not comparable)"
    )
    args = parser.parse_args()

    base = Settings.from_env()
    with isolated(base, "reconcile") as env, fake_provider() as url:
        settings = env.settings
        control = FakeProviderControl(url)
        provider = HttpToolProvider(url, TOOL, TERMS)
        print(
            f"topics {settings.topic_prefix}.*  provider {url}  {args.n} UNKNOWN operations, "
            f"lookups answered after {args.latency_ms:g} ms, {args.threads} worker threads, "
            f"{BATCH} operations per pass",
            flush=True,
        )
        grant(settings, TENANT, ACTOR, TOOL, repeat_safe=True)
        op_ids = leave_unknown(settings, provider, args.n)
        control.configure(TOOL, latency_ms=args.latency_ms)
        projector = Projector(settings)
        try:
            projector.catch_up()
            load_before = os.getloadavg()[0]
            raw_per_s = raw_lookups(provider, op_ids, args.threads)
            raw_many_per_s = raw_lookup_many(provider, op_ids)
            built = build_worker(settings, provider, args.threads)
            freeze_startup_heap()  # as the worker host does once started (processors/host.py)
            main_profile = cProfile.Profile() if args.profile else None
            thread_profiles = ThreadProfiles()
            if args.profile:
                thread_profiles.wrap(built.worker)
            try:
                result = drain(built.worker, projector, settings, args.n, main_profile)
            finally:
                built.close()
        finally:
            projector.close()
        check(settings, op_ids, control)
    rate = result.decided / result.worker_s
    print()
    print(f"{'raw lookups (same HTTP adapter, same threads)':<48} {raw_per_s:>9,.0f}/s")
    print(f"{'raw lookups, lookup_many (the worker uses it)':<48} {raw_many_per_s:>9,.0f}/s")
    print(
        f"{'recovery worker, reconciled':<48} {rate:>9,.0f}/s  "
        f"({result.decided:,} in {result.passes} passes, {result.worker_s:.2f} s inside passes)"
    )
    print(
        f"{'  with the projector catching up between passes':<48} "
        f"{result.decided / result.wall_s:>9,.0f}/s  ({result.wall_s:.2f} s)"
    )
    print(
        f"{'  CPU of this process inside the passes':<48} "
        f"{result.worker_cpu_s / result.decided * 1000:>9.3f} ms per operation"
    )
    print(f"{'ratio reconciled / raw lookup_many':<48} {rate / raw_many_per_s:>9.2f}")
    load_after = os.getloadavg()[0]
    print(f"load average (1 min) before the timed part {load_before:.1f}, after {load_after:.1f}")
    verdict = "met" if rate >= GOAL_PER_S else "missed"
    print(f"goal >= {GOAL_PER_S:,.0f} reconciled/s: {rate:,.0f}/s ({verdict})")
    if args.profile and main_profile is not None:
        print_profiles(main_profile, thread_profiles)


if __name__ == "__main__":
    main()
