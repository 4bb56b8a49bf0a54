"""Where the CPU of one SDK call goes with 16 threads, and what the result store's shared
commits change. Not a test. Needs the local stack.

One call is ``bench_sdk_calls.py``'s recorder path (``intent`` -> ``dispatched`` ->
``succeeded`` with a small JSON result, each step acknowledged, the result committed before
``succeeded`` is sent), made by ``--callers`` threads sharing one recorder. Two stores take
turns, ``--rounds`` times:

- *one commit per put* (the baseline): ``ResultStore.put`` as it was before shared commits, one
  ``INSERT`` and one commit per call;
- *shared commits*: today's ``ResultStore.put``, where puts made at the same time share one.

For each, the CPU seconds used during the timed calls are read from ``/proc`` and divided by
the calls: the caller threads, librdkafka's threads and the rest of this process, the Kafka
broker, and PostgreSQL (the postmaster and its backends). Their sum is what one call costs the
machine; ``cores / that`` is the most calls per second this machine could make with every core
busy, the ceiling any change of concurrency alone stays under.

Then one caller's puts, one at a time: the CPU per put of this process with a lone row sent as
plain parameters (what ``put`` does) and as four one-element arrays (the first version of shared
commits), taking turns ``--rounds`` times.

    PYTHONPATH=. .venv/bin/python bench/bench_sdk_cpu.py [-n 10000] [--callers 16] [--rounds 2]
        [--lone-puts 1000]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench_sdk_calls import recorder_call
from benchenv import (
    isolated,
    machine_seconds,
    stack_cpu_seconds,
    thread_cpu_seconds,
)
from ledger.results import ResultStore
from ledger.settings import Settings
from producers import KafkaTransport, TransitionRecorder

CORES = os.cpu_count() or 1


class OneCommitPerPut(ResultStore):
    """``ResultStore.put`` before shared commits: its own ``INSERT`` and commit per call (a
    ``put_many`` of one row is that statement)."""

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        result = self.prepare(tenant_id, payload, content_type)
        self.put_many([result])
        return result.result_ref


@dataclass
class Round:
    mode: str
    calls: int
    seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    machine_busy: float = 0.0

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def per_call_us(self, part: str) -> float:
        return 1e6 * self.cpu[part] / self.calls


PARTS = ("callers", "librdkafka", "rest of process", "broker", "postgres")


def timed(
    settings: Settings, store: ResultStore, mode: str, *, calls: int, callers: int, warmup: int
) -> Round:
    transport = KafkaTransport(settings)
    recorder = TransitionRecorder(settings, transport, results=store, owns=[transport, store])
    try:
        call = recorder_call(recorder, itertools.count())
        for _ in range(warmup):
            call()
        left = itertools.count()
        caller_ids: set[int] = set()
        finished = threading.Barrier(callers + 1)
        measured = threading.Event()

        def caller() -> None:
            caller_ids.add(threading.get_native_id())
            while next(left) < calls:
                call()
            finished.wait()
            measured.wait()  # alive until their CPU is read

        before_threads = thread_cpu_seconds()
        before = stack_cpu_seconds(settings)
        process_before = sum(os.times()[:2])
        all_before, idle_before = machine_seconds()
        started = time.perf_counter()
        threads = [threading.Thread(target=caller) for _ in range(callers)]
        for thread in threads:
            thread.start()
        finished.wait()
        seconds = time.perf_counter() - started
        process = sum(os.times()[:2]) - process_before
        all_after, idle_after = machine_seconds()
        after_threads = thread_cpu_seconds()
        done = Round(mode, calls, seconds)
        for part, used in stack_cpu_seconds(settings).items():
            done.cpu[part] = used - before[part]
        measured.set()
        for thread in threads:
            thread.join()
        used: dict[str, float] = {"callers": 0.0, "librdkafka": 0.0}
        for tid, (name, cpu) in after_threads.items():
            delta = cpu - before_threads.get(tid, (name, 0.0))[1]
            if tid in caller_ids:
                used["callers"] += delta
            elif name.startswith("rdk:"):
                used["librdkafka"] += delta
        done.cpu.update(used)
        done.cpu["rest of process"] = max(0.0, process - used["callers"] - used["librdkafka"])
        total = all_after - all_before
        done.machine_busy = (total - (idle_after - idle_before)) / total if total else 0.0
        return done
    finally:
        recorder.close()


def report(rounds: list[Round]) -> None:
    modes = list(dict.fromkeys(r.mode for r in rounds))
    print()
    header = f"{'mode':<22}{'calls/s':>9}" + "".join(f"{p:>17}" for p in PARTS)
    print("CPU per call, us (median of rounds)")
    print(header + f"{'all':>8}{'ceiling/s':>11}{'busy':>7}")
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [r for r in rounds if r.mode == mode]
        row = {p: statistics.median(r.per_call_us(p) for r in mine) for p in PARTS}
        row["rate"] = statistics.median(r.rate for r in mine)
        row["all"] = sum(row[p] for p in PARTS)
        row["busy"] = statistics.median(r.machine_busy for r in mine)
        medians[mode] = row
        print(
            f"{mode:<22}{row['rate']:9.0f}"
            + "".join(f"{row[p]:17.0f}" for p in PARTS)
            + f"{row['all']:8.0f}{CORES * 1e6 / row['all']:11.0f}{100 * row['busy']:6.0f}%"
        )
    print("rounds, calls/s: " + "; ".join(f"{r.mode} {r.rate:.0f}" for r in rounds))
    base, shared = medians.get(BASELINE), medians.get(SHARED)
    if base and shared:
        print(
            f"shared / one commit per put: calls/s {shared['rate'] / base['rate']:.2f}x, "
            f"PostgreSQL CPU per call {shared['postgres'] / base['postgres']:.2f}x, "
            f"all CPU per call {shared['all'] / base['all']:.2f}x"
        )
    print(
        f"ceiling = {CORES} cores / all CPU per call: the calls/s this machine allows with every "
        "core busy and nothing else running"
    )


BASELINE, SHARED = "one commit per put", "shared commits"
STORES: dict[str, Callable[[str], ResultStore]] = {
    BASELINE: OneCommitPerPut.connect,
    SHARED: ResultStore.connect,
}


class OneRowAsArrays(ResultStore):
    """Every put through the many-rows statement, a lone row as four one-element arrays: how
    the first version of shared commits stored a group of one."""

    def put(
        self, tenant_id: str, payload: bytes, content_type: str = "application/octet-stream"
    ) -> str:
        result = self.prepare(tenant_id, payload, content_type)

        def insert(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                """INSERT INTO results (result_ref, tenant_id, content_type, payload, size_bytes)
                   SELECT r, t, c, p, length(p)
                     FROM unnest(%s::text[], %s::text[], %s::text[], %s::bytea[]) AS x(r, t, c, p)
                   ON CONFLICT (tenant_id, result_ref) DO NOTHING""",
                ([result.result_ref], [result.tenant_id], [result.content_type], [result.payload]),
            )

        self._retrying(f"store result {result.result_ref}", insert)
        return result.result_ref


def lone_puts(settings: Settings, puts: int, rounds: int) -> None:
    """One caller's puts, one at a time: this process's CPU per put with a lone row as plain
    parameters (today's ``put``) and as one-element arrays, taking turns."""
    stores = {"plain parameters": ResultStore, "one-element arrays": OneRowAsArrays}
    numbers = itertools.count()
    used: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(rounds):
        for name, kind in stores.items():
            with kind.connect(settings.dsn) as store:
                for _ in range(100):  # the pool's connection and the prepared statement
                    store.put("acme", b"warm-up %d" % next(numbers))
                started = time.process_time()
                for _ in range(puts):
                    store.put("acme", b'{"message_id": %d}' % next(numbers))
                used[name].append(1e6 * (time.process_time() - started) / puts)
    print()
    print(f"one caller, {puts} puts per round, {rounds} rounds: this process's CPU per put, us")
    for name, values in used.items():
        print(
            f"  {name:<20} median {statistics.median(values):5.0f}  rounds "
            + ", ".join(f"{v:.0f}" for v in values)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10000, help="calls per round and mode")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--lone-puts", type=int, default=1000, help="puts per round, one caller")
    args = parser.parse_args()
    base = Settings.from_env()
    rounds: list[Round] = []
    with isolated(base, "cpu") as env:
        ResultStore.connect(env.settings.dsn).migrate()
        print(
            f"{args.n} calls per round and mode, {args.callers} threads, {args.rounds} rounds, "
            f"{CORES} cores; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        for number in range(args.rounds):
            for mode, connect in STORES.items():
                print(f"round {number + 1}: {mode}...", flush=True)
                rounds.append(
                    timed(
                        env.settings,
                        connect(env.settings.dsn),
                        mode,
                        calls=args.n,
                        callers=args.callers,
                        warmup=args.warmup,
                    )
                )
        report(rounds)
        lone_puts(env.settings, args.lone_puts, args.rounds)


if __name__ == "__main__":
    main()
