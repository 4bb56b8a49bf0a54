"""``opledger demo``: the whole loop on the local stack, in under a minute.

Runs the reference :class:`producers.executor.Executor` against a fake provider (success,
confirmed failure, response lost after dispatch) and two flaky fake destinations, for three
tenants in a few threads; waits until the projector has folded everything into PostgreSQL; then
prints what the *projections* say next to what the provider itself counted. The line to look for
is the seed's invariant: "max side effects per operation: 1".
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

from ledger.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.console import Console

    from ledger.transport import OutgoingRecord, Transport
    from producers.executor import ExecutionReport
    from producers.provider import FakeDestination, FakeProvider
    from projections.queries import Summary

#: Exit codes: 1 when the run finished but an invariant or a cross-check failed; 2 when it could
#: not run (stack, projector), with a message saying what to do.
EXIT_INVARIANT = 1
EXIT_USAGE = 2

TENANTS = ("acme", "globex", "initech")
#: Per-send failure rates: the CRM webhook is flaky enough that a few deliveries exhaust their
#: three attempts and are dead-lettered; the billing queue mostly works.
DESTINATION_FAILURE = {"webhook:crm": 0.25, "queue:billing": 0.08}
#: Accepted but the acknowledgement is lost: the retry shows consumer-side deduplication.
ACK_LOST_RATE = 0.03
MAX_DELIVERY_ATTEMPTS = 3
#: Share of appends whose broker acknowledgement is lost (the record itself is durable): the
#: executor retries the step, and the projector must count the repeat as a duplicate.
APPEND_ACK_LOST_RATE = 0.02
CATCH_UP_TIMEOUT_S = 90.0
PROJECTOR_STOP_TIMEOUT_S = 20.0


class DemoError(RuntimeError):
    """The demo cannot run; the message says why and what to do."""


def register(commands: Any) -> None:
    """``opledger demo``."""
    parser = commands.add_parser(
        "demo",
        help="run the reference executor against fakes, project, and summarise (the main job)",
    )
    parser.add_argument(
        "--operations", type=_positive, default=300, help="tool calls to run (default 300)"
    )
    parser.add_argument("--workers", type=_positive, default=4, help="executor threads (default 4)")
    parser.add_argument(
        "--seed", type=int, default=7, help="seed of the outcome mix (default 7; ids stay unique)"
    )
    parser.set_defaults(handler="opledger.demo:run")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 100000, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class _Call:
    tenant_id: str
    actor_id: str
    tool_name: str
    arguments: dict[str, Any]


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger demo [--operations N] [--workers W]``."""
    from rich.console import Console  # noqa: PLC0415  # handlers import their heavy modules

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    try:
        return _run(args, settings, console)
    except DemoError as exc:
        console.print(f"[red]opledger demo: {exc}[/]")
        return EXIT_USAGE


def _run(args: argparse.Namespace, settings: Settings, console: Console) -> int:
    import psycopg  # noqa: PLC0415

    from ledger.topics import TopicError, ensure_topics  # noqa: PLC0415
    from opledger import stack  # noqa: PLC0415
    from producers.provider import FakeDestination, FakeProvider  # noqa: PLC0415
    from projections import queries  # noqa: PLC0415

    started_at = datetime.now(UTC)
    console.rule("[bold]opledger demo")
    stack.up(settings, echo=lambda line: console.print(f"[dim]{line}[/]"))
    try:
        ensure_topics(settings)
    except TopicError as exc:
        raise DemoError(str(exc)) from None
    projector = _ensure_projector(settings, console)
    try:
        provider = FakeProvider(failure_rate=0.10, lost_rate=0.08, seed=args.seed)
        destinations = {
            name: FakeDestination(name, rate, ack_lost_rate=ACK_LOST_RATE, seed=args.seed)
            for name, rate in DESTINATION_FAILURE.items()
        }
        began = time.monotonic()
        reports = _run_workload(settings, args, provider, destinations, console)
        ran_s = time.monotonic() - began
        waited_s = _wait_caught_up(settings, projector, console)
        try:
            with psycopg.connect(settings.dsn, connect_timeout=5, autocommit=True) as conn:
                summary = queries.summary(conn, list(TENANTS), since=started_at)
        except psycopg.OperationalError as exc:
            raise DemoError(f"cannot read the projections: {exc}") from None
    finally:
        if projector is not None:
            _stop_projector(projector, console)
    return _report(
        settings,
        console,
        reports=reports,
        summary=summary,
        provider=provider,
        destinations=destinations,
        ran_s=ran_s,
        waited_s=waited_s,
    )


# -- projector ------------------------------------------------------------------------------------


def _projector_serving(settings: Settings) -> bool:
    url = f"http://127.0.0.1:{settings.projector_web_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # a fixed local URL
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _ensure_projector(settings: Settings, console: Console) -> subprocess.Popen[bytes] | None:
    """Start ``opledger projector run`` unless one already serves on the configured port."""
    if _projector_serving(settings):
        console.print(
            f"projector: already serving on 127.0.0.1:{settings.projector_web_port}; using it"
        )
        return None
    log_path = settings.home / "logs" / "demo-projector.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = log_path.open("ab")
    try:
        # Same interpreter and the inherited environment, so it reads the same OPLEDGER_* settings.
        process = subprocess.Popen(  # our interpreter and module; no shell
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()  # the child holds its own descriptor
    console.print(f"projector: started (pid {process.pid}), log {log_path}")
    return process


def _stop_projector(process: subprocess.Popen[bytes], console: Console) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: faust stops the worker cleanly
        try:
            process.wait(timeout=PROJECTOR_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # Safe: offsets commit with the rows, so a kill loses no projected work.
            process.kill()
            process.wait()
    console.print(f"projector: stopped (pid {process.pid}, exit {process.returncode})")


def _log_tail(settings: Settings, lines: int = 25) -> str:
    path = settings.home / "logs" / "demo-projector.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_caught_up(
    settings: Settings, process: subprocess.Popen[bytes] | None, console: Console
) -> float:
    """Wait until the projector's stored offsets reach the topics' ends; seconds waited."""
    from ledger.topics import end_offsets  # noqa: PLC0415
    from projections.progress import records_behind, stored_offsets  # noqa: PLC0415

    started = time.monotonic()
    # Everything was acknowledged before this, so nothing is in flight past these ends.
    ends = end_offsets(settings, (settings.execution_topic, settings.delivery_topic))
    with console.status("waiting for the projector to catch up..."):
        while True:
            stored = stored_offsets(settings.dsn, settings.projector_group)
            if records_behind(ends, stored) == 0:
                return time.monotonic() - started
            if process is not None and process.poll() is not None:
                raise DemoError(
                    f"the projector exited with {process.returncode}; last log lines:\n"
                    f"{_log_tail(settings)}"
                )
            if time.monotonic() - started > CATCH_UP_TIMEOUT_S:
                behind = records_behind(ends, stored)
                raise DemoError(
                    f"the projector is still {behind} records behind after "
                    f"{CATCH_UP_TIMEOUT_S:.0f}s. If one was already serving on port "
                    f"{settings.projector_web_port}, is it using the same OPLEDGER_TOPIC_PREFIX "
                    f"and database? Projector log:\n{_log_tail(settings)}"
                )
            time.sleep(0.2)


# -- workload -------------------------------------------------------------------------------------


def _plan(count: int, seed: int) -> list[_Call]:
    from opledger.workload import TOOLS  # noqa: PLC0415

    rng = random.Random(seed)
    # A per-run nonce in the arguments keeps request hashes of different runs apart, as real
    # requests would be; operation ids are fresh ULIDs anyway.
    run_nonce = random.SystemRandom().getrandbits(32)
    return [
        _Call(
            tenant_id=rng.choice(TENANTS),
            actor_id=f"agent-{rng.randint(1, 12)}",
            tool_name=rng.choice(TOOLS),
            arguments={
                "to": f"user{rng.randint(1, 999)}@example.com",
                "amount_cents": rng.randint(100, 100_000),
                "run": run_nonce,
                "n": index,
            },
        )
        for index in range(count)
    ]


def _run_workload(
    settings: Settings,
    args: argparse.Namespace,
    provider: FakeProvider,
    destinations: dict[str, FakeDestination],
    console: Console,
) -> list[ExecutionReport]:
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from producers.executor import Executor  # noqa: PLC0415
    from producers.recorder import TransitionRecorder  # noqa: PLC0415

    calls = _plan(args.operations, args.seed)
    workers = min(args.workers, len(calls))
    reports: list[ExecutionReport] = []
    lock = threading.Lock()

    def work(index: int, share: list[_Call], progress: Progress, task: Any) -> None:
        def lose_some_acks(inner: Transport) -> Transport:
            return _LostAcks(inner, APPEND_ACK_LOST_RATE, random.Random(args.seed * 1000 + index))

        # One recorder per thread: its result store's connection runs one transaction at a
        # time, and a producer per thread keeps their acknowledgement waits independent.
        with TransitionRecorder.connect(settings, wrap_transport=lose_some_acks) as recorder:
            executor = Executor(
                recorder,
                provider,
                destinations,
                max_delivery_attempts=MAX_DELIVERY_ATTEMPTS,
                # Retry deliveries at once so the demo stays short; the recorded
                # next_attempt_at still says when a real worker would have retried.
                sleep=lambda _seconds: None,
            )
            for call in share:
                report = executor.execute(
                    call.tenant_id,
                    call.actor_id,
                    call.tool_name,
                    call.arguments,
                    list(destinations),
                )
                with lock:
                    reports.append(report)
                progress.advance(task)

    columns = (
        TextColumn("[bold]executing"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("executing", total=len(calls))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="executor") as pool:
            futures = [
                pool.submit(work, index, calls[index::workers], progress, task)
                for index in range(workers)
            ]
            for future in futures:
                future.result()  # re-raises a worker's RecordError here
    return reports


class _LostAcks:
    """A transport that loses the acknowledgement (never the record) of a share of sends, as a
    network blip between broker and service would: the send is durable, the caller hears a
    timeout, and retries."""

    def __init__(self, inner: Transport, rate: float, rng: random.Random) -> None:
        self._inner = inner
        self._rate = rate
        self._rng = rng

    def send(self, records: Sequence[OutgoingRecord]) -> None:
        from ledger.errors import DeliveryTimeoutError  # noqa: PLC0415

        self._inner.send(records)
        if self._rng.random() < self._rate:
            raise DeliveryTimeoutError("acknowledgement lost after a durable send (demo)")

    def close(self) -> None:
        self._inner.close()


# -- report ---------------------------------------------------------------------------------------


def _report(
    settings: Settings,
    console: Console,
    *,
    reports: list[ExecutionReport],
    summary: Summary,
    provider: FakeProvider,
    destinations: dict[str, FakeDestination],
    ran_s: float,
    waited_s: float,
) -> int:
    from rich.table import Table  # noqa: PLC0415

    from ledger.domain.states import DeliveryState, ExecutionState  # noqa: PLC0415
    from opledger.ops import format_age  # noqa: PLC0415

    console.print()
    console.print(
        f"[bold]Read from the projections[/] (PostgreSQL {_safe_dsn(settings)}, "
        f"operations of this run only)"
    )
    executions = Table(title="executions by state", title_justify="left")
    executions.add_column("tenant")
    for state in ExecutionState:
        executions.add_column(state.value, justify="right")
    executions.add_column("total", justify="right")
    executions.add_column("oldest UNKNOWN", justify="right")
    for tenant in TENANTS:
        counts = summary.executions.get(tenant, {})
        oldest = summary.oldest_unknown.get(tenant)
        executions.add_row(
            tenant,
            *(str(counts.get(state, 0)) for state in ExecutionState),
            str(summary.executions_total(tenant)),
            "-" if oldest is None else format_age(oldest),
        )
    console.print(executions)

    deliveries = Table(title="deliveries by destination x state", title_justify="left")
    deliveries.add_column("tenant")
    deliveries.add_column("destination")
    for dstate in DeliveryState:
        deliveries.add_column(dstate.value, justify="right")
    deliveries.add_column("sends", justify="right")
    deliveries.add_column("most sends", justify="right")
    for tenant in TENANTS:
        by_key = summary.deliveries.get(tenant, {})
        for destination in sorted({d for d, _ in by_key}):
            cells = [by_key.get((destination, s), (0, 0, 0)) for s in DeliveryState]
            deliveries.add_row(
                tenant,
                destination,
                *(str(c[0]) for c in cells),
                str(sum(c[1] for c in cells)),
                str(max(c[2] for c in cells)),
            )
    console.print(deliveries)

    checks = Table(title="duplicates and anomalies", title_justify="left")
    for column in ("tenant", "duplicate appends", "anomalies"):
        checks.add_column(column, justify="left" if column == "tenant" else "right")
    for tenant in TENANTS:
        checks.add_row(
            tenant,
            str(sum(summary.duplicates.get(tenant, {}).values())),
            str(sum(summary.anomalies.get(tenant, {}).values())),
        )
    console.print(checks)

    side_effects = provider.side_effects()
    max_effects = provider.max_side_effects_per_key()
    received = provider.received_keys
    console.print()
    console.print("[bold]Counted by the fake provider and destinations themselves[/]")
    own = Table(show_header=False)
    own.add_column("what")
    own.add_column("count", justify="right")
    own.add_row("provider calls received", str(len(received)))
    own.add_row("distinct idempotency keys", str(len(set(received))))
    own.add_row("duplicate keys seen by the provider", str(provider.duplicate_keys_seen))
    own.add_row("operations with a side effect", str(len(side_effects)))
    for name, dest in destinations.items():
        own.add_row(
            f"{name}: sends / accepted / duplicates deduplicated",
            f"{dest.attempts} / {len(dest.accepted)} / {dest.duplicates_seen}",
        )
    console.print(own)

    by_state = Counter(r.state for r in reports)
    projected = Counter[ExecutionState]()
    for tenant in TENANTS:
        projected.update(summary.executions.get(tenant, {}))
    unknown = [r for r in reports if r.state is ExecutionState.UNKNOWN]
    took_effect = sum(
        1 for r in unknown if (found := provider.lookup(r.operation_id)) and found.succeeded
    )
    dead = sum(
        1 for r in reports for s in r.deliveries.values() if s is DeliveryState.DEAD_LETTERED
    )
    console.print()
    console.print(
        f"operations executed: {len(reports)} (succeeded {by_state[ExecutionState.SUCCEEDED]}, "
        f"failed {by_state[ExecutionState.FAILED]}, unknown {by_state[ExecutionState.UNKNOWN]}) "
        f"in {ran_s:.1f}s; projector caught up {waited_s:.1f}s later"
    )
    console.print(f"dead-lettered deliveries: {dead}")
    console.print(f"[bold]max side effects per operation: {max_effects}[/]")
    console.print(
        f"awaiting reconciliation (UNKNOWN): {len(unknown)} - none retried; a provider lookup by "
        f"idempotency key shows {took_effect} of them did take effect"
    )
    failures: list[str] = []
    if max_effects > 1:
        failures.append(f"an operation caused {max_effects} side effects (the limit is 1)")
    if len(received) != len(reports) or len(set(received)) != len(reports):
        failures.append("the provider saw other calls than one per operation")
    if projected != by_state:
        failures.append(
            f"projections {dict(projected)} differ from the executor's reports {dict(by_state)}"
        )
    if failures:
        for failure in failures:
            console.print(f"[bold red]INVARIANT VIOLATED: {failure}[/]")
        return EXIT_INVARIANT
    console.print("projections agree with the executor's own reports: yes")

    example = next((r for r in unknown if r.tenant_id == "acme"), unknown[0] if unknown else None)
    console.print()
    console.print("[bold]Explore further[/]")
    console.print("  opledger ops list --tenant acme --state UNKNOWN")
    if example is not None:
        console.print(f"  opledger ops show {example.operation_id} --tenant {example.tenant_id}")
    console.print("  opledger ops list --tenant globex --older-than 1m --limit 20")
    console.print(
        f"  psql '{_safe_dsn(settings)}' -c \"SELECT execution_state, count(*) "
        f"FROM agent_operations WHERE tenant_id = 'acme' GROUP BY 1\""
    )
    return 0


def _safe_dsn(settings: Settings) -> str:
    from ledger.domain.redact import redact  # noqa: PLC0415

    return redact(settings.dsn)
