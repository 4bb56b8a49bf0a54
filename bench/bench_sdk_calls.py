"""One tool call through the SDK, side by side with DBOS 3.4, in one run.

Not a test. Needs the local stack. One *call* is what a worker records around a tool call,
measured along three paths of the public API:

- ``recorder``: ``intent`` -> ``dispatched`` -> ``succeeded`` with a small JSON result on a
  ``TransitionRecorder`` without a lease store; each step returns only after the broker's ack,
  and the result is committed to PostgreSQL before ``succeeded`` is sent;
- ``lease``: the same with ownership as ``execute()`` takes it: the lease (token 1) and the
  request stored in one commit before the intent, and the lease checked in the database just
  before the (here absent) provider call;
- ``execute``: ``recorder.execute()`` with an in-process tool that answers at once: the lease,
  the policy check (a real grant, projected), dispatch, the call, the result, the outcome.

Each path also runs on the ``AsyncTransitionRecorder`` in the asyncio-tasks mode: the same calls
awaited (the lease check run off the loop, as ``execute`` runs it), and ``await
recorder.execute()`` with an asyncio tool (``async def call``) that answers at once.

The baseline is DBOS 3.4 with its defaults: one workflow with one step returning the same
payload per call, on the same PostgreSQL server (its own fresh database). Both are timed by the
same ``callbench`` code in three modes: sequential, N threads sharing one recorder (one DBOS
instance), N asyncio tasks sharing one asyncio recorder. The sequential modes of the paths take
turns, ``--rounds`` times, and report the median round: the load of a shared machine drifts
during a run.

DBOS cannot be installed next to faust (croniter: DBOS needs >=6.2.4, mode-streaming <6), so the
baseline runs in its own virtualenv, ``$OPLEDGER_HOME/bench/venv-dbos-3.4.0``, created on first
use, by ``dbos_calls.py``.

    .venv/bin/python bench/bench_sdk_calls.py [--sequential 300] [--concurrent 3000]
        [--callers 16] [--warmup 100] [--timeout 120] [--rounds 3]
        [--paths recorder,lease,execute] [--skip-dbos] [--skip-linger] [--profile] [--auth]

``--auth`` measures instead what authentication and ACLs cost (``authcost.py``): the recorder
and lease paths on a private plaintext broker without an authorizer, on the stack's SASL/SCRAM
broker as its super user, and as the ``sdk`` principal whose ACLs the broker evaluates, in the
same run, taking turns; ratios against the plaintext broker.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import pstats
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote
from uuid import uuid4

import psycopg
from confluent_kafka import Producer
from psycopg.conninfo import conninfo_to_dict

import producers
from benchenv import create_database, drop_database, isolated
from benchprojection import grant
from callbench import AsyncCall, Call, Summary, mode_names, run_tasks, run_threads, tool_result
from ledger.domain.states import ExecutionState
from ledger.leases import LeaseStore, process_identity
from ledger.pg import open_pool
from ledger.settings import Settings
from ledger.tools import CallOutcome, LookupResult, LookupStatus, ProviderTerms
from producers import KafkaTransport, ResultStore, TransitionRecorder, producer_config
from producers.execution import LEASE_MARGIN

DBOS_VERSION = "3.4.0"
# Same PostgreSQL driver as ours, so the drivers are not what differs.
DBOS_REQUIREMENTS = (f"dbos=={DBOS_VERSION}", "psycopg[binary]==3.3.9")
DBOS_SCRIPT = Path(__file__).resolve().parent / "dbos_calls.py"
TENANT, ACTOR, TOOL = "acme", "agent-7", "send_email"
GOAL_RATIO = 20.0
#: Issue 18: calls/s with 16 callers against the raw protocol floor measured in the same run.
GOAL_FLOOR_RATIO = 0.6
GOAL_SEQUENTIAL_P50_MS = 3.0
GOAL_LEASE_P50_MS = 1.0
TERMS = ProviderTerms(
    call_timeout=timedelta(seconds=5), key_retention=timedelta(days=1), repeat_safe=True
)
#: The lease ``execute`` takes for this tool.
LEASE_TTL = TERMS.call_timeout + LEASE_MARGIN
#: path name -> label, in the order they run and print.
PATHS = {"recorder": "recorder, no lease", "lease": "recorder + lease", "execute": "execute()"}

# Looked up, not imported: an SDK without the asyncio recorder still runs the other rows, and
# its asyncio row says so.
AsyncTransitionRecorder: Any = getattr(producers, "AsyncTransitionRecorder", None)
LINGERS_MS = (5, 0)


# -- opledger ---------------------------------------------------------------------------------


class InstantTool:
    """A ``ledger.tools.Provider`` in this process that succeeds at once: the tool's own time
    is zero, so ``execute`` shows only what the ledger costs."""

    tool_name = TOOL
    terms = TERMS

    def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        result = b'{"status": "sent", "message_id": "%s"}' % idempotency_key.encode()
        return CallOutcome(True, result=result, content_type="application/json")

    def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        return LookupResult(LookupStatus.NOT_FOUND)


class AsyncInstantTool:
    """:class:`InstantTool` as a ``ledger.tools.AsyncProvider``: awaited on the event loop."""

    tool_name = TOOL
    terms = TERMS

    def __init__(self) -> None:
        self._answers = InstantTool()

    async def call(self, request: Any, idempotency_key: str) -> CallOutcome:
        return self._answers.call(request, idempotency_key)

    async def lookup(self, idempotency_key: str, provider_ref: str | None) -> LookupResult:
        return self._answers.lookup(idempotency_key, provider_ref)


def plain_recorder(
    settings: Settings, extra_config: dict[str, Any] | None = None, kind: Any = TransitionRecorder
) -> Any:
    """A recorder (``kind``) with a producer and a result store, and no lease store."""
    transport = KafkaTransport(settings, extra_config=extra_config)
    results = ResultStore.connect(settings.dsn)
    return kind(settings, transport, results=results, owns=[transport, results])


def leased_recorder(settings: Settings, kind: Any = TransitionRecorder) -> tuple[Any, LeaseStore]:
    """A recorder (``kind``) with a result store and a lease store on one pool, as ``connect``
    builds."""
    transport = KafkaTransport(settings)
    pool = open_pool(settings.dsn, name="opledger-sdk")
    leases = LeaseStore(pool, process_identity("bench"))
    recorder = kind(
        settings, transport, results=ResultStore(pool), leases=leases, owns=[transport, pool]
    )
    return recorder, leases


def recorder_call(recorder: TransitionRecorder, numbers: Iterator[int]) -> Call:
    def call() -> None:
        number = next(numbers)
        op = recorder.intent(TENANT, ACTOR, TOOL, {"to": f"user{number}@example.com"})
        recorder.dispatched(op, provider_ref=op.operation_id)
        recorder.succeeded(op, tool_result(number), content_type="application/json")

    return call


def leased_call(recorder: TransitionRecorder, leases: LeaseStore, numbers: Iterator[int]) -> Call:
    """What ``execute`` does around the provider call, without policy and provider."""

    def call() -> None:
        number = next(numbers)
        args = {"to": f"user{number}@example.com"}
        op = recorder.intent(TENANT, ACTOR, TOOL, args, lease_ttl=LEASE_TTL)
        recorder.dispatched(op, provider_ref=op.operation_id)
        if op.lease is None or not leases.holds(op.lease):
            raise RuntimeError(f"{op.operation_id}: lease lost before the call")
        recorder.succeeded(op, tool_result(number), content_type="application/json")

    return call


def execute_call(recorder: TransitionRecorder, numbers: Iterator[int]) -> Call:
    def call() -> None:
        number = next(numbers)
        done = recorder.execute(TENANT, ACTOR, TOOL, {"to": f"user{number}@example.com"})
        if done.state is not ExecutionState.SUCCEEDED:
            raise RuntimeError(f"execute ended {done.state}: {done.error}")

    return call


def async_call(
    recorder: Any, numbers: Iterator[int], leases: LeaseStore | None = None
) -> AsyncCall:
    """The recorder path awaited; with ``leases``, the lease path (its database check before the
    absent provider call runs on a thread, as ``execute`` runs it, never on the loop)."""

    async def call() -> None:
        number = next(numbers)
        args = {"to": f"user{number}@example.com"}
        lease_ttl = None if leases is None else LEASE_TTL
        op = await recorder.intent(TENANT, ACTOR, TOOL, args, lease_ttl=lease_ttl)
        await recorder.dispatched(op, provider_ref=op.operation_id)
        if leases is not None and not (
            op.lease is not None and await asyncio.to_thread(leases.holds, op.lease)
        ):
            raise RuntimeError(f"{op.operation_id}: lease lost before the call")
        await recorder.succeeded(op, tool_result(number), content_type="application/json")

    return call


def async_execute_call(recorder: Any, numbers: Iterator[int]) -> AsyncCall:
    async def call() -> None:
        number = next(numbers)
        done = await recorder.execute(TENANT, ACTOR, TOOL, {"to": f"user{number}@example.com"})
        if done.state is not ExecutionState.SUCCEEDED:
            raise RuntimeError(f"execute ended {done.state}: {done.error}")

    return call


def closing(recorder: Any, mode: str, timed: Callable[[], Summary]) -> Summary:
    try:
        return timed()
    finally:
        try:
            recorder.close()
        except Exception as exc:
            print(f"opledger {mode}: close() raised {type(exc).__name__}: {exc}")


def threaded_path(path: str, settings: Settings, numbers: Iterator[int]) -> tuple[Any, Call]:
    """A fresh threaded recorder for ``path`` and the call that path times."""
    if path == "recorder":
        recorder = plain_recorder(settings)
        return recorder, recorder_call(recorder, numbers)
    if path == "lease":
        recorder, leases = leased_recorder(settings)
        return recorder, leased_call(recorder, leases, numbers)
    recorder = TransitionRecorder.connect(settings, providers=[InstantTool()])
    return recorder, execute_call(recorder, numbers)


def sync_mode(
    path: str,
    settings: Settings,
    numbers: Iterator[int],
    mode: str,
    args: argparse.Namespace,
    *,
    calls: int,
    callers: int,
) -> Summary:
    """One mode of one path on a fresh recorder (a mode that breaks one cannot taint the next)."""
    recorder, call = threaded_path(path, settings, numbers)
    return closing(
        recorder,
        mode,
        lambda: run_threads(
            mode, call, calls=calls, callers=callers, warmup=args.warmup, timeout_s=args.timeout
        ),
    )


async def timed_tasks(
    path: str, settings: Settings, numbers: Iterator[int], mode: str, args: argparse.Namespace
) -> Summary:
    """One path's asyncio-tasks mode on a fresh asyncio recorder."""
    if AsyncTransitionRecorder is None:
        return Summary.unavailable(mode, "not available in this SDK version")
    if path == "recorder":
        recorder = plain_recorder(settings, kind=AsyncTransitionRecorder)
        call = async_call(recorder, numbers)
    elif path == "lease":
        recorder, leases = leased_recorder(settings, kind=AsyncTransitionRecorder)
        call = async_call(recorder, numbers, leases)
    else:
        recorder = AsyncTransitionRecorder.connect(settings, providers=[AsyncInstantTool()])
        call = async_execute_call(recorder, numbers)
    try:
        return await run_tasks(
            mode,
            call,
            calls=args.concurrent,
            callers=args.callers,
            warmup=args.warmup,
            timeout_s=args.timeout,
        )
    finally:
        await recorder.close()


def linger_mode(
    settings: Settings, numbers: Iterator[int], linger_ms: int, args: argparse.Namespace
) -> Summary:
    """The recorder path's sequential mode with the producer's ``linger.ms`` set explicitly."""
    recorder = plain_recorder(settings, {"linger.ms": linger_ms})
    mode = f"sequential, linger.ms={linger_ms}"
    call = recorder_call(recorder, numbers)
    return closing(
        recorder,
        mode,
        lambda: run_threads(
            mode, call, calls=args.sequential, callers=1, warmup=args.warmup, timeout_s=args.timeout
        ),
    )


@dataclass(frozen=True, slots=True)
class OpledgerRun:
    #: path -> its summaries in mode_names order (sequential, threads, asyncio tasks)
    paths: dict[str, list[Summary]]
    by_linger: list[tuple[int, Summary]]  # recorder path, sequential, per explicit linger.ms
    floors: tuple[Summary, Summary]  # raw produce -> ack, raw PostgreSQL commit
    #: the call's protocol with no opledger code, by the concurrent callers (issue 18's floor)
    protocol: Summary


def combined(rounds: list[Summary]) -> Summary:
    """One sequential row from several rounds: the median round's p50 and p99, calls/s over
    the rounds' summed time, failures summed."""
    if len(rounds) == 1:
        return rounds[0]
    p50s = [s.p50_ms for s in rounds if s.p50_ms is not None]
    p99s = [s.p99_ms for s in rounds if s.p99_ms is not None]
    first = rounds[0]
    ok = sum(s.ok for s in rounds)
    elapsed = sum(s.elapsed_s for s in rounds)
    errors = [s.first_error for s in rounds if s.first_error]
    return Summary(
        mode=first.mode,
        calls=sum(s.calls for s in rounds),
        ok=ok,
        failures=sum(s.failures for s in rounds),
        first_error=errors[0] if errors else None,
        p50_ms=statistics.median(p50s) if p50s else None,
        p99_ms=statistics.median(p99s) if p99s else None,
        calls_per_s=ok / elapsed if ok and elapsed > 0 else None,
        elapsed_s=elapsed,
        note=f"median of {len(rounds)} rounds: p50 " + ", ".join(f"{v:.2f}" for v in p50s),
    )


def run_opledger(settings: Settings, args: argparse.Namespace) -> OpledgerRun:
    """The grant ``execute`` needs, the raw floors, then each path's three modes, then the
    recorder path's sequential mode once per ``linger.ms`` of ``LINGERS_MS``."""
    if "execute" in args.paths:
        # First: the projector that folds it must not meet the floors' probe records.
        grant(settings, TENANT, ACTOR, TOOL, repeat_safe=False)
    floors = measure_floors(settings, args)
    protocol = measure_protocol_floor(settings, args)
    numbers = itertools.count()  # one sequence for the run: every result payload differs
    sequential, threaded, tasks = mode_names(args.callers)
    # The sequential modes take turns, path after path, --rounds times: on a shared machine
    # the load drifts, and "what the lease adds" is a difference of two sequential medians.
    rounds: dict[str, list[Summary]] = {path: [] for path in args.paths}
    for number in range(args.rounds):
        print(f"opledger sequential, round {number + 1} of {args.rounds}...", flush=True)
        for path in args.paths:
            rounds[path].append(
                sync_mode(
                    path, settings, numbers, sequential, args, calls=args.sequential, callers=1
                )
            )
    paths: dict[str, list[Summary]] = {}
    for path in args.paths:
        print(f"opledger {PATHS[path]}, {threaded}...", flush=True)
        modes = [
            combined(rounds[path]),
            sync_mode(
                path,
                settings,
                numbers,
                threaded,
                args,
                calls=args.concurrent,
                callers=args.callers,
            ),
        ]
        print(f"opledger {PATHS[path]}, {tasks}...", flush=True)
        modes.append(asyncio.run(timed_tasks(path, settings, numbers, tasks, args)))
        paths[path] = modes
    by_linger = []
    if not args.skip_linger:
        for linger_ms in LINGERS_MS:
            by_linger.append((linger_ms, linger_mode(settings, numbers, linger_ms, args)))
    return OpledgerRun(paths, by_linger, floors, protocol)


def profile_paths(settings: Settings, args: argparse.Namespace, top: int = 25) -> None:
    """Each path's sequential mode once more under cProfile; the top functions by internal and
    by cumulative time (the figures include cProfile's own overhead)."""
    numbers = itertools.count(10_000_000)
    for path in args.paths:
        recorder, call = threaded_path(path, settings, numbers)
        try:
            for _ in range(args.warmup):
                call()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.sequential):
                call()
            profiler.disable()
        finally:
            recorder.close()
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
            print(f"\n== {PATHS[path]}, sequential, {args.sequential} calls, by {order} ==")
            print(out.getvalue())


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


def measure_protocol_floor(settings: Settings, args: argparse.Namespace) -> Summary:
    """The physical floor of one call's protocol, with no opledger code, by ``--callers``
    threads: three records produced with acks=all (the SDK's producer config), each awaited
    before the next, and one PostgreSQL commit (a small row) after the second, as a call
    stores its result before recording SUCCEEDED. One producer shared by every thread, its
    reports served by a thread of its own; one connection per thread."""
    numbers = itertools.count(50_000_000)
    producer = Producer(producer_config(settings, client_id="bench-protocol-floor"))
    stopping = threading.Event()

    def serve_reports() -> None:
        while not stopping.is_set():
            producer.poll(0.05)

    poller = threading.Thread(target=serve_reports, daemon=True)
    poller.start()
    local = threading.local()
    connections: list[psycopg.Connection[Any]] = []
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE protocol_floor (id bigint PRIMARY KEY, payload bytea NOT NULL)")

    def append(number: int, step: int) -> None:
        done = threading.Event()
        failed: list[object] = []

        def report(err: object, _msg: object) -> None:
            if err is not None:
                failed.append(err)
            done.set()

        producer.produce(
            settings.execution_topic,
            tool_result(number),
            b"floor-%d" % number,
            headers=[("step", str(step).encode())],
            on_delivery=report,
        )
        if not done.wait(10) or failed:
            raise RuntimeError(f"record not acknowledged: {failed}")

    def call() -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = psycopg.connect(settings.dsn, autocommit=True)
            connections.append(conn)
        number = next(numbers)
        append(number, 0)
        append(number, 1)
        conn.execute("INSERT INTO protocol_floor VALUES (%s, %s)", (number, tool_result(number)))
        append(number, 2)

    try:
        return run_threads(
            f"protocol floor, {args.callers} threads",
            call,
            calls=args.concurrent,
            callers=args.callers,
            warmup=args.warmup,
            timeout_s=args.timeout,
        )
    finally:
        stopping.set()
        poller.join(timeout=5)
        for conn in connections:
            conn.close()


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
    if not password and params.get("passfile"):  # the local stack's: the last field of its line
        password = Path(str(params["passfile"])).read_text().strip().rsplit(":", 1)[1]
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
    rows = [(PATHS[p], s) for p, modes in ours.paths.items() for s in modes]
    width = max(len(label) + 2 + len(s.mode) for label, s in rows)
    print()
    print(f"{'':<{width}} | {'opledger SDK':<26} | {dbos_label:<26} | ratio")
    header = f"{'p50 ms':>7} {'p99 ms':>8} {'calls/s':>9}"
    print(f"{'path, mode':<{width}} | {header} | {header} | opledger/DBOS calls/s")
    print("-" * (width + 82))
    for path, modes in ours.paths.items():
        for index, mine in enumerate(modes):
            other = theirs[index] if theirs else None
            ratio = _ratio(mine, other)
            shown = f"{ratio:.2f}" if ratio is not None else "-"
            name = f"{PATHS[path]}, {mine.mode}"
            print(f"{name:<{width}} | {_figures(mine)} | {_figures(other)} | {shown}")
    extra = [s for _, s in ours.by_linger] + list(ours.floors)
    mine_all = [s for modes in ours.paths.values() for s in modes]
    for side, summaries in (("opledger", mine_all + extra), ("DBOS", theirs or [])):
        for s in summaries:
            if s.failures:
                print(
                    f"  {side} {s.mode}: {s.failures:,} of {s.calls:,} calls failed"
                    f"{'; ' + s.note if s.note else ''}; first error: {s.first_error}"
                )
    for path, modes in ours.paths.items():
        if modes[0].ok and modes[0].note:
            print(f"  {PATHS[path]}, {modes[0].mode}: {modes[0].note}")
    print()
    plain, leased = ours.paths.get("recorder"), ours.paths.get("lease")
    if plain and leased:
        added = []
        for a, b in zip(plain[:2], leased[:2], strict=True):
            if a.p50_ms is None or b.p50_ms is None:
                added.append(f"{a.mode}: not measured")
            else:
                added.append(f"{a.mode} {b.p50_ms - a.p50_ms:+.2f} ms")
        seq_a, seq_b = plain[0].p50_ms, leased[0].p50_ms
        verdict = ""
        if seq_a is not None and seq_b is not None:
            met = seq_b - seq_a <= GOAL_LEASE_P50_MS
            verdict = (
                f" (goal <= {GOAL_LEASE_P50_MS:g} ms, sequential: {'met' if met else 'missed'})"
            )
        print(
            f"what the lease adds per call at p50 (lease - recorder): {'; '.join(added)}{verdict}"
        )
    for path, modes in ours.paths.items():
        verdicts = []
        for index, mine in enumerate(modes[1:], start=1):
            ratio = _ratio(mine, theirs[index] if theirs else None)
            if ratio is None:
                verdicts.append(f"{mine.mode}: not measured")
            else:
                met = ratio >= GOAL_RATIO and not mine.failures
                verdicts.append(f"{mine.mode}: {ratio:.2f}x ({'met' if met else 'missed'})")
        print(
            f"goal >= {GOAL_RATIO:g}x DBOS calls/s with {callers} callers, {PATHS[path]}: "
            f"{'; '.join(verdicts)}"
        )
    for path, modes in ours.paths.items():
        sequential = modes[0]
        verdict = "not measured"
        if sequential.p50_ms is not None:
            met = sequential.p50_ms <= GOAL_SEQUENTIAL_P50_MS and not sequential.failures
            verdict = f"{sequential.p50_ms:.2f} ms ({'met' if met else 'missed'})"
        print(f"goal sequential p50 <= {GOAL_SEQUENTIAL_P50_MS:g} ms, {PATHS[path]}: {verdict}")
    floor = ours.protocol
    print(
        f"protocol floor ({floor.mode}: 3 records acks=all each awaited + 1 commit per call, "
        f"no opledger code): {_figures(floor)}"
    )
    for path, modes in ours.paths.items():
        threaded = modes[1]
        if threaded.calls_per_s and floor.calls_per_s:
            ratio = threaded.calls_per_s / floor.calls_per_s
            met = ratio >= GOAL_FLOOR_RATIO and not threaded.failures
            print(
                f"goal >= {GOAL_FLOOR_RATIO:g}x the protocol floor's calls/s, {PATHS[path]}, "
                f"{threaded.mode}: {ratio:.2f}x ({'met' if met else 'missed'})"
            )
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
        print(f"recorder sequential by producer linger.ms (SDK default {default:g}): {figures}")


def _auth_path(path: str, settings: Settings) -> tuple[Any, Call]:
    return threaded_path(path, settings, AUTH_NUMBERS)


AUTH_NUMBERS = itertools.count()


def print_auth_report(results: dict[tuple[str, str], dict[str, list[Summary]]]) -> None:
    """One row per (path, access): each mode's median round, with its ratio against the
    plaintext broker's."""
    print()
    print(
        f"{'path, access':<44} | {'seq p50 ms':>10} {'p99 ms':>8} | {'threads calls/s':>15}"
        f" | {'p50 / plain':>11} {'calls/s / plain':>15}"
    )
    print("-" * 115)
    paths = sorted({path for _access, path in results}, key=list(PATHS).index)
    for path in paths:
        rows = {access: runs for (access, p), runs in results.items() if p == path}
        plain_seq, plain_thr = (combined(r) for r in rows["plaintext, no authorizer"].values())
        for access, runs in rows.items():
            seq, thr = (combined(r) for r in runs.values())
            p50_ratio = (
                f"{seq.p50_ms / plain_seq.p50_ms:.2f}x" if seq.p50_ms and plain_seq.p50_ms else "-"
            )
            cps_ratio = (
                f"{thr.calls_per_s / plain_thr.calls_per_s:.2f}x"
                if thr.calls_per_s and plain_thr.calls_per_s
                else "-"
            )
            print(
                f"{PATHS[path] + ', ' + access:<44} | {_ms(seq.p50_ms):>10} {_ms(seq.p99_ms):>8}"
                f" | {thr.calls_per_s or 0:>15,.0f} | {p50_ratio:>11} {cps_ratio:>15}"
            )
            for summary in (seq, thr):
                if summary.failures:
                    print(
                        f"  {summary.mode}: {summary.failures} failed; first: {summary.first_error}"
                    )
    print(
        "(each figure: the median of the rounds' p50 and p99, calls/s over the rounds' summed "
        "time; ratios < 1 for p50 and > 1 for calls/s are faster than plaintext)"
    )


def _paths(raw: str) -> list[str]:
    chosen = [p.strip() for p in raw.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PATHS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"paths are a comma list of {', '.join(PATHS)}")
    return [p for p in PATHS if p in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=300, help="calls in sequential mode")
    parser.add_argument("--concurrent", type=int, default=3000, help="calls in concurrent modes")
    parser.add_argument("--callers", type=int, default=16, help="threads / asyncio tasks")
    parser.add_argument("--warmup", type=int, default=100, help="untimed calls before each mode")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per mode")
    parser.add_argument(
        "--rounds", type=int, default=3, help="sequential runs per path, taking turns"
    )
    parser.add_argument(
        "--paths", type=_paths, default=list(PATHS), help="comma list: recorder,lease,execute"
    )
    parser.add_argument("--skip-dbos", action="store_true", help="opledger side only")
    parser.add_argument("--skip-linger", action="store_true", help="no linger.ms comparison")
    parser.add_argument(
        "--profile", action="store_true", help="then each path's sequential mode under cProfile"
    )
    parser.add_argument("--dbos-python", help="a Python with dbos installed (default: own venv)")
    parser.add_argument(
        "--auth", action="store_true", help="what SASL/SCRAM and ACLs cost (authcost.py)"
    )
    args = parser.parse_args()

    base = Settings.from_env()
    if args.auth:
        import authcost  # noqa: PLC0415

        with isolated(base, "auth") as env:
            results = authcost.measure(
                env.settings, args, _auth_path, lambda recorder: recorder.close()
            )
        print_auth_report(results)
        return
    with isolated(base, "calls") as env:
        print(
            f"topics {env.settings.topic_prefix}.*  calls: {args.sequential} sequential, "
            f"{args.concurrent} per concurrent mode, {args.callers} callers, "
            f"{args.warmup} warm-up calls per mode; paths {', '.join(args.paths)}",
            flush=True,
        )
        ours = run_opledger(env.settings, args)
        if args.profile:
            profile_paths(env.settings, args)
    theirs = None
    dbos_label = "DBOS (skipped)"
    if not args.skip_dbos:
        versions, theirs, database = run_dbos(base, args)
        dbos_label = f"DBOS {versions.get('dbos', DBOS_VERSION)}"
        print(f"DBOS system database {database} (dropped); versions {versions}")
    print_report(ours, theirs, dbos_label, args.callers)


if __name__ == "__main__":
    main()
