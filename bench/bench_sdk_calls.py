"""One tool call through the SDK, side by side with DBOS 3.4, in one run.

Not a test. Needs the local stack. One *call* is what a worker records around a tool call:
``intent`` -> ``dispatched`` -> ``succeeded`` with a small JSON result, through the public
``TransitionRecorder`` API; each step returns only after the broker's ack, and the result is
committed to PostgreSQL before ``succeeded`` is sent. The baseline is DBOS 3.4 with its defaults:
one workflow with one step returning the same payload per call, on the same PostgreSQL server
(its own fresh database). Both are timed by the same ``callbench`` code in three modes:
sequential, N threads sharing one recorder (one DBOS instance), N asyncio tasks.

DBOS cannot be installed next to faust (croniter: DBOS needs >=6.2.4, mode-streaming <6), so the
baseline runs in its own virtualenv, ``$OPLEDGER_HOME/bench/venv-dbos-3.4.0``, created on first
use, by ``dbos_calls.py``.

    .venv/bin/python bench/bench_sdk_calls.py [--sequential 300] [--concurrent 3000]
        [--callers 16] [--warmup 100] [--timeout 120] [--skip-dbos] [--skip-linger]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote
from uuid import uuid4

import psycopg
from confluent_kafka import Producer
from psycopg.conninfo import conninfo_to_dict

import producers
from benchenv import create_database, drop_database, isolated
from callbench import AsyncCall, Call, Summary, mode_names, run_tasks, run_threads, tool_result
from ledger.settings import Settings
from producers import KafkaTransport, ResultStore, TransitionRecorder, producer_config

DBOS_VERSION = "3.4.0"
# Same PostgreSQL driver as ours, so the drivers are not what differs.
DBOS_REQUIREMENTS = (f"dbos=={DBOS_VERSION}", "psycopg[binary]==3.3.9")
DBOS_SCRIPT = Path(__file__).resolve().parent / "dbos_calls.py"
TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"
GOAL_RATIO = 20.0
GOAL_SEQUENTIAL_P50_MS = 3.0

# Looked up, not imported: an SDK without the asyncio recorder still runs the other rows, and
# its asyncio row says so.
AsyncTransitionRecorder: Any = getattr(producers, "AsyncTransitionRecorder", None)
LINGERS_MS = (5, 0)


# -- opledger ---------------------------------------------------------------------------------


def sync_call(recorder: TransitionRecorder, numbers: Iterator[int]) -> Call:
    def call() -> None:
        number = next(numbers)
        op = recorder.intent(TENANT, ACTOR, TOOL, {"to": f"user{number}@example.com"})
        recorder.dispatched(op, provider_ref=op.operation_id)
        recorder.succeeded(op, tool_result(number), content_type="application/json")

    return call


def async_call(recorder: Any, numbers: Iterator[int]) -> AsyncCall:
    async def call() -> None:
        number = next(numbers)
        op = await recorder.intent(TENANT, ACTOR, TOOL, {"to": f"user{number}@example.com"})
        await recorder.dispatched(op, provider_ref=op.operation_id)
        await recorder.succeeded(op, tool_result(number), content_type="application/json")

    return call


def recorder_with_linger(settings: Settings, linger_ms: int) -> TransitionRecorder:
    """What ``connect`` builds, with the producer's ``linger.ms`` overridden."""
    transport = KafkaTransport(settings, extra_config={"linger.ms": linger_ms})
    results = ResultStore.connect(settings.dsn)
    return TransitionRecorder(settings, transport, results=results, owns=[transport, results])


def timed_threads(
    recorder: TransitionRecorder,
    numbers: Iterator[int],
    mode: str,
    args: argparse.Namespace,
    *,
    calls: int,
    callers: int,
) -> Summary:
    try:
        summary = run_threads(
            mode,
            sync_call(recorder, numbers),
            calls=calls,
            callers=callers,
            warmup=args.warmup,
            timeout_s=args.timeout,
        )
    finally:
        try:
            recorder.close()
        except Exception as exc:
            print(f"opledger {mode}: close() raised {type(exc).__name__}: {exc}")
    return summary


async def timed_tasks(
    settings: Settings, numbers: Iterator[int], mode: str, args: argparse.Namespace
) -> Summary:
    if AsyncTransitionRecorder is None:
        return Summary.unavailable(mode, "not available in this SDK version")
    recorder = AsyncTransitionRecorder.connect(settings)
    if inspect.isawaitable(recorder):  # connect() was planned as a coroutine
        recorder = await recorder
    try:
        return await run_tasks(
            mode,
            async_call(recorder, numbers),
            calls=args.concurrent,
            callers=args.callers,
            warmup=args.warmup,
            timeout_s=args.timeout,
        )
    finally:
        await recorder.close()


@dataclass(frozen=True, slots=True)
class OpledgerRun:
    modes: list[Summary]  # sequential, threads, asyncio tasks (mode_names order)
    by_linger: list[tuple[int, Summary]]  # sequential, per explicit linger.ms
    floors: tuple[Summary, Summary]  # raw produce -> ack, raw PostgreSQL commit


def run_opledger(settings: Settings, args: argparse.Namespace) -> OpledgerRun:
    """The raw floors, the three modes, each on a fresh recorder (a mode that breaks one cannot
    taint the next), then the sequential mode once per ``linger.ms`` of ``LINGERS_MS``."""
    floors = measure_floors(settings, args)
    numbers = itertools.count()  # one sequence for the run: every result payload differs
    sequential, threaded, tasks = mode_names(args.callers)
    modes = [
        timed_threads(
            TransitionRecorder.connect(settings),
            numbers,
            sequential,
            args,
            calls=args.sequential,
            callers=1,
        ),
        timed_threads(
            TransitionRecorder.connect(settings),
            numbers,
            threaded,
            args,
            calls=args.concurrent,
            callers=args.callers,
        ),
        asyncio.run(timed_tasks(settings, numbers, tasks, args)),
    ]
    by_linger = []
    if not args.skip_linger:
        for linger_ms in LINGERS_MS:
            summary = timed_threads(
                recorder_with_linger(settings, linger_ms),
                numbers,
                f"sequential, linger.ms={linger_ms}",
                args,
                calls=args.sequential,
                callers=1,
            )
            by_linger.append((linger_ms, summary))
    return OpledgerRun(modes, by_linger, floors)


def measure_floors(settings: Settings, args: argparse.Namespace) -> tuple[Summary, Summary]:
    """Sequential raw steps a call is made of: one record produced and flushed (acked) with
    the SDK's producer config (a call waits for three), and one small row committed (a call
    makes one). Probe records go to the private execution topic, deleted with it."""
    numbers = itertools.count()
    producer = Producer(producer_config(settings))

    def produce_and_wait() -> None:
        number = next(numbers)
        producer.produce(settings.execution_topic, tool_result(number), b"probe-%d" % number)
        if producer.flush(10):
            raise RuntimeError("record not acknowledged within 10 s")

    sizes = {"calls": args.sequential, "callers": 1, "warmup": args.warmup}
    ack = run_threads("raw produce -> ack", produce_and_wait, timeout_s=args.timeout, **sizes)
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE floor_probe (id bigint PRIMARY KEY, payload bytea NOT NULL)")

        def insert() -> None:
            number = next(numbers)
            conn.execute("INSERT INTO floor_probe VALUES (%s, %s)", (number, tool_result(number)))

        commit = run_threads("raw PostgreSQL commit", insert, timeout_s=args.timeout, **sizes)
    return ack, commit


# -- DBOS -------------------------------------------------------------------------------------


def dbos_python(settings: Settings) -> Path:
    """The Python of a virtualenv with DBOS, created under OPLEDGER_HOME on first use."""
    venv = settings.home / "bench" / f"venv-dbos-{DBOS_VERSION}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('dbos'))"]
    if python.exists():
        found = subprocess.run(probe, capture_output=True, text=True, check=False)
        if found.returncode == 0 and found.stdout.strip() == DBOS_VERSION:
            return python
    print(f"installing {' '.join(DBOS_REQUIREMENTS)} into {venv} (once)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *DBOS_REQUIREMENTS,
        ],
        check=True,
    )
    return python


def sqlalchemy_url(dsn: str, dbname: str) -> str:
    """``dsn``'s server and user as a URL (what DBOS takes), naming database ``dbname``."""
    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "")), safe="")
    password = params.get("password")
    credentials = f"{user}:{quote(str(password), safe='')}" if password else user
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    return f"postgresql://{credentials}@{host}:{port}/{dbname}"


def run_dbos(base: Settings, args: argparse.Namespace) -> tuple[dict[str, str], list[Summary], str]:
    """DBOS's three modes in a subprocess, on a fresh system database dropped afterwards."""
    names = mode_names(args.callers)
    python = Path(args.dbos_python) if args.dbos_python else dbos_python(base)
    database = f"opledger_bench_dbos_{uuid4().hex[:8]}"
    create_database(base, database)
    try:
        command = [
            str(python),
            str(DBOS_SCRIPT),
            "--url",
            sqlalchemy_url(base.dsn, database),
            "--sequential",
            str(args.sequential),
            "--concurrent",
            str(args.concurrent),
            "--callers",
            str(args.callers),
            "--warmup",
            str(args.warmup),
            "--timeout",
            str(args.timeout),
        ]
        done = subprocess.run(
            command, stdout=subprocess.PIPE, text=True, check=False, timeout=args.timeout * 4
        )
    finally:
        drop_database(base, database)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        note = f"DBOS run failed (exit {done.returncode}; its stderr is above)"
        return {}, [Summary.unavailable(name, note) for name in names], database
    report = json.loads(lines[-1])
    return report["versions"], [Summary.from_json(m) for m in report["modes"]], database


# -- report -----------------------------------------------------------------------------------


def _figures(s: Summary | None) -> str:
    if s is None:
        return f"{'skipped':<26}"
    if s.note and not s.ok:
        return f"{s.note:<26}"
    p50 = f"{s.p50_ms:.2f}" if s.p50_ms is not None else "-"
    p99 = f"{s.p99_ms:.2f}" if s.p99_ms is not None else "-"
    rate = f"{s.calls_per_s:,.0f}" if s.calls_per_s is not None else "-"
    return f"{p50:>7} {p99:>8} {rate:>9}"


def _ms(value: float | None) -> str:
    return f"{value:.2f} ms" if value is not None else "not measured"


def _ratio(ours: Summary, theirs: Summary | None) -> float | None:
    if theirs is None or not ours.calls_per_s or not theirs.calls_per_s:
        return None
    return ours.calls_per_s / theirs.calls_per_s


def print_report(
    ours: OpledgerRun, theirs: list[Summary] | None, dbos_label: str, callers: int
) -> None:
    mine_modes = ours.modes
    width = max(len(s.mode) for s in mine_modes)
    print()
    print(f"{'':<{width}} | {'opledger SDK':<26} | {dbos_label:<26} | ratio")
    header = f"{'p50 ms':>7} {'p99 ms':>8} {'calls/s':>9}"
    print(f"{'mode':<{width}} | {header} | {header} | opledger/DBOS calls/s")
    print("-" * (width + 82))
    for index, mine in enumerate(mine_modes):
        other = theirs[index] if theirs else None
        ratio = _ratio(mine, other)
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"{mine.mode:<{width}} | {_figures(mine)} | {_figures(other)} | {shown}")
    extra = [s for _, s in ours.by_linger] + list(ours.floors)
    for side, summaries in (("opledger", mine_modes + extra), ("DBOS", theirs or [])):
        for s in summaries:
            if s.failures:
                print(
                    f"  {side} {s.mode}: {s.failures:,} of {s.calls:,} calls failed"
                    f"{'; ' + s.note if s.note else ''}; first error: {s.first_error}"
                )
    print()
    verdicts = []
    for index, mine in enumerate(mine_modes[1:], start=1):
        ratio = _ratio(mine, theirs[index] if theirs else None)
        if ratio is None:
            verdicts.append(f"{mine.mode}: not measured")
        else:
            met = ratio >= GOAL_RATIO and not mine.failures
            verdicts.append(f"{mine.mode}: {ratio:.2f}x ({'met' if met else 'missed'})")
    print(f"goal >= {GOAL_RATIO:g}x DBOS calls/s with {callers} callers: {'; '.join(verdicts)}")
    sequential = mine_modes[0]
    verdict = "not measured"
    if sequential.p50_ms is not None:
        met = sequential.p50_ms <= GOAL_SEQUENTIAL_P50_MS and not sequential.failures
        verdict = f"{sequential.p50_ms:.2f} ms ({'met' if met else 'missed'})"
    print(f"goal sequential p50 <= {GOAL_SEQUENTIAL_P50_MS:g} ms: {verdict}")
    ack, commit = ours.floors
    if ack.p50_ms is not None and commit.p50_ms is not None:
        print(
            f"raw floors, sequential p50: produce -> ack {ack.p50_ms:.2f} ms (a call waits for 3), "
            f"PostgreSQL commit {commit.p50_ms:.2f} ms (a call makes 1): "
            f"3 x {ack.p50_ms:.2f} + {commit.p50_ms:.2f} = {3 * ack.p50_ms + commit.p50_ms:.2f} ms"
        )
    if ours.by_linger:
        default = producer_config(Settings.from_env())["linger.ms"]
        figures = ", ".join(
            f"linger.ms={ms}: p50 {_ms(s.p50_ms)} / p99 {_ms(s.p99_ms)}" for ms, s in ours.by_linger
        )
        print(f"sequential by producer linger.ms (SDK default {default:g}): {figures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=300, help="calls in sequential mode")
    parser.add_argument("--concurrent", type=int, default=3000, help="calls in concurrent modes")
    parser.add_argument("--callers", type=int, default=16, help="threads / asyncio tasks")
    parser.add_argument("--warmup", type=int, default=100, help="untimed calls before each mode")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per mode")
    parser.add_argument("--skip-dbos", action="store_true", help="opledger side only")
    parser.add_argument("--skip-linger", action="store_true", help="no linger.ms comparison")
    parser.add_argument("--dbos-python", help="a Python with dbos installed (default: own venv)")
    args = parser.parse_args()

    base = Settings.from_env()
    with isolated(base, "calls") as env:
        print(
            f"topics {env.settings.topic_prefix}.*  calls: {args.sequential} sequential, "
            f"{args.concurrent} per concurrent mode, {args.callers} callers, "
            f"{args.warmup} warm-up calls per mode",
            flush=True,
        )
        ours = run_opledger(env.settings, args)
    theirs = None
    dbos_label = "DBOS (skipped)"
    if not args.skip_dbos:
        versions, theirs, database = run_dbos(base, args)
        dbos_label = f"DBOS {versions.get('dbos', DBOS_VERSION)}"
        print(f"DBOS system database {database} (dropped); versions {versions}")
    print_report(ours, theirs, dbos_label, args.callers)


if __name__ == "__main__":
    main()
