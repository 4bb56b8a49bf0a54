"""``opledger demo``: stack, setup, run, wait, report (see :mod:`opledger.demo`)."""

from __future__ import annotations

import argparse
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from ledger.settings import Settings
from opledger.demo import EXIT_USAGE, DemoError
from opledger.demo.plan import QUEUE, QUEUE_CONSUMER, TENANTS, WEBHOOK, make_plan

if TYPE_CHECKING:
    from rich.console import Console

    from opledger.demo.observe import Observed
    from opledger.demo.run import Announced, Runner
    from opledger.fakes.http_provider import FakeProviderControl
    from opledger.fakes.model import KeyStats, Stats

Echo = Callable[[str], None]
WORKERS_READY_S = 90.0
QUEUE_CONSUMER_STOP_S = 20.0
SETTLE_POLL_S = 1.0
PROGRESS_EVERY_S = 3.0


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger demo [--operations N] [--seed S] [--timeout T]``."""
    from rich.console import Console  # noqa: PLC0415  # handlers import their heavy modules

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(width=150, highlight=False)  # piped: never wrap ids
    try:
        return _run(args, settings, console)
    except DemoError as exc:
        console.print(f"[red]opledger demo: {exc}[/]")
        return EXIT_USAGE


def _run(args: argparse.Namespace, settings: Settings, console: Console) -> int:
    from ledger.errors import RecordError  # noqa: PLC0415
    from opledger.demo import report, setup  # noqa: PLC0415
    from opledger.demo.observe import failures  # noqa: PLC0415
    from opledger.demo.run import Runner  # noqa: PLC0415
    from opledger.fakes.http_provider import FakeProviderControl  # noqa: PLC0415
    from opledger.fakes.model import FakeProviderError  # noqa: PLC0415
    from opledger.terminal import shown  # noqa: PLC0415

    def say(line: str) -> None:
        console.print(shown(line))

    def quiet(line: str) -> None:
        console.print(f"[dim]{shown(line)}[/]")

    console.rule("[bold]opledger demo")
    _stack(settings, quiet)
    deadline = time.monotonic() + args.timeout
    log_dir = settings.home / "logs" / "demo"
    log_dir.mkdir(parents=True, exist_ok=True)
    control = FakeProviderControl.of(settings)
    consumer_url = f"http://127.0.0.1:{settings.consumer_web_port}/events"
    try:
        setup.configure_provider(control, args.seed)
        topic = setup.ensure_queue_topic(settings)
        setup.add_destinations(
            settings, consumer_url=consumer_url, secret=_consumer_secret(settings), topic=topic
        )
        grants = setup.grants(setup.now())
        waited = setup.write_policy(settings, grants)
    except (setup.SetupError, FakeProviderError, RecordError, psycopg.Error, OSError) as exc:
        raise DemoError(f"the setup did not take: {exc}") from None
    say(
        f"setup: the fake provider's mix per tool; destinations {WEBHOOK} (webhook to the "
        f"reference consumer at {consumer_url}), {QUEUE} (queue {topic}) and initech's "
        f"unpermitted archive; {len(grants)} grants, in effect after "
        f"{waited:.2f}s"
    )
    before = control.stats()
    duplicates_before = _consumer_duplicates(settings)
    fetched_before = _consumer_fetched(settings.consumer_web_port)
    queue_metrics = _free_port()
    queue = _start_queue_consumer(settings, topic, log_dir, queue_metrics)
    plan = make_plan(args.operations, args.seed, secrets.randbits(32))
    try:
        console.print(
            f"[bold]run[/]: {plan.operations} tool calls for {len(TENANTS)} tenants by "
            f"{len(plan.services)} service processes; each is SIGKILLed once, the delivery "
            "worker once "
            f"(service logs in {log_dir})"
        )
        with tempfile.TemporaryDirectory(prefix="opledger-demo-") as work:
            runner = Runner(settings, plan, Path(work), log_dir, say)
            ran = runner.run(deadline)
        say(
            f"the services are done: {len(ran.announced)} operations in {ran.seconds:.1f}s "
            f"({ran.processes} service processes)"
        )
        console.print("[bold]wait[/]: until everything is final, delivered and projected")
        observed, settled_s = _settle(
            settings,
            ran.announced,
            runner=runner,
            control=control,
            queue=queue,
            deadline=deadline,
            echo=say,
        )
        # The queue consumer's counter lives in its process: read before it stops.
        queue_fetched = _consumer_fetched(queue_metrics)
    finally:
        _stop(queue)
    fetched = _consumer_fetched(settings.consumer_web_port) - fetched_before + queue_fetched
    return report.render(
        console,
        settings,
        observed,
        ran,
        before=before,
        after=control.stats(),
        duplicates=max(0.0, _consumer_duplicates(settings) - duplicates_before),
        settled_s=settled_s,
        failed=failures(observed, fetched=fetched),
    )


# -- the stack ----------------------------------------------------------------------------------


def _stack(settings: Settings, echo: Echo) -> None:
    """Bring the local stack up (idempotent) unless another home's servers are in use, then
    wait until every supervised worker serves."""
    from ledger.topics import TopicError, ensure_topics  # noqa: PLC0415
    from opledger import stack, supervisor  # noqa: PLC0415

    # A supervisor for this home without servers of its own: the servers belong to another
    # home (a test's private workers on the shared broker and database); leave them be.
    if stack.kafka_pid(settings) is not None or supervisor.supervisor_pid(settings) is None:
        stack.up(settings, echo=echo)
    try:
        ensure_topics(settings)
    except TopicError as exc:
        raise DemoError(str(exc)) from None
    if not stack.wait_workers_ready(settings, echo, timeout=WORKERS_READY_S):
        raise DemoError(
            "not every worker serves (see above); `opledger stack status` shows them and "
            f"their logs are in {settings.home / 'logs'}"
        )


def _consumer_secret(settings: Settings) -> str:
    """The local reference consumer's signing secret (written once by `stack up`)."""
    from opledger import stack  # noqa: PLC0415

    path = stack.ensure_consumer_secret(settings)
    found = path.read_text(encoding="utf-8").split()
    if not found:
        raise DemoError(f"{path} holds no secret; delete it and run `opledger stack up`")
    return found[0]


def _consumer_duplicates(settings: Settings) -> float:
    """Repeats the reference consumer recognised and did not apply (its own counter)."""
    return _consumer_counter(
        settings.consumer_web_port, "opledger_consumer_duplicate_keys_total", ""
    )


def _consumer_fetched(port: int) -> int:
    """Results delivered by reference that the consumer serving /metrics on ``port`` fetched
    and checked."""
    fetched = _consumer_counter(port, "opledger_consumer_result_fetches_total", "fetched")
    return int(fetched)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _consumer_counter(port: int, name: str, outcome: str) -> float:
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:  # a fixed local URL
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return 0.0
    pattern = re.compile(rf"^{name}(?:\{{(.*)\}})? (\S+)$")
    return sum(
        float(m.group(2))
        for line in text.splitlines()
        if (m := pattern.match(line))
        and (not outcome or f'outcome="{outcome}"' in (m.group(1) or ""))
    )


def _start_queue_consumer(
    settings: Settings, topic: str, log_dir: Path, metrics_port: int
) -> subprocess.Popen[bytes]:
    """``opledger consumer queue`` for the queue destination; the demo's own process (its topic
    is the demo's), stopped at the end and resumed by the next run from its group's offsets.
    It signs its fetches of large results with the destination's fetch secret (decision 016),
    the same file the local receiver reads."""
    from opledger.supervisor import LOCAL_CONSUMER_SECRET  # noqa: PLC0415

    log = log_dir / "queue-consumer.log"
    with log.open("ab") as out:
        return subprocess.Popen(  # our interpreter and CLI; no shell
            [
                sys.executable,
                "-m",
                "opledger.cli",
                "consumer",
                "queue",
                "--topic",
                topic,
                "--name",
                QUEUE_CONSUMER,
                "--secrets-file",
                LOCAL_CONSUMER_SECRET,
                "--metrics-port",
                str(metrics_port),
                *(arg for tenant in TENANTS for arg in ("--tenant", tenant)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=QUEUE_CONSUMER_STOP_S)
        except subprocess.TimeoutExpired:
            # Safe: the inbox commits with the change; Kafka redelivers what was not committed.
            process.kill()
            process.wait()


# -- waiting ------------------------------------------------------------------------------------


def _settle(
    settings: Settings,
    announced: Mapping[str, Announced],
    *,
    runner: Runner,
    control: FakeProviderControl,
    queue: subprocess.Popen[bytes],
    deadline: float,
    echo: Echo,
) -> tuple[Observed, float]:
    """Read until nothing is unsettled or the deadline passes; the last reading and the
    seconds it took."""
    import psycopg  # noqa: PLC0415

    from opledger.demo.observe import unsettled  # noqa: PLC0415

    started = last = time.monotonic()
    unreachable = ""
    while True:
        runner.watch_delivery()
        try:
            observed = _observe(settings, announced, control)
        except psycopg.OperationalError as exc:
            # A database restarting (or crashed and recovering) is waited for, as the
            # workers wait for it, until the deadline.
            if time.monotonic() > deadline:
                raise DemoError(f"PostgreSQL did not come back in time: {exc}") from None
            if not unreachable:
                echo("  PostgreSQL does not answer: waiting for it, as the workers do")
            unreachable = str(exc)
            time.sleep(SETTLE_POLL_S)
            continue
        if unreachable:
            echo("  PostgreSQL answers again")
            unreachable = ""
        waiting = unsettled(observed)
        elapsed = time.monotonic() - started
        if not waiting:
            echo(f"everything final {elapsed:.1f}s after the services finished")
            return observed, elapsed
        if queue.poll() is not None:
            raise DemoError(
                f"the queue consumer exited ({queue.returncode}); see "
                f"{settings.home / 'logs' / 'demo' / 'queue-consumer.log'}"
            )
        if time.monotonic() > deadline:
            echo(f"not final within the timeout: {'; '.join(waiting)}")
            return observed, elapsed
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            echo(f"  {elapsed:5.1f}s  waiting for: {'; '.join(waiting)}")
        time.sleep(SETTLE_POLL_S)


def _observe(
    settings: Settings, announced: Mapping[str, Announced], control: FakeProviderControl
) -> Observed:
    from ledger.log import end_offsets  # noqa: PLC0415
    from opledger.demo.observe import read  # noqa: PLC0415
    from projections.progress import records_behind, stored_offsets  # noqa: PLC0415

    calls = {op: a.call for op, a in announced.items()}
    topics = (settings.execution_topic, settings.delivery_topic, settings.policy_topic)
    behind = records_behind(
        end_offsets(settings, topics), stored_offsets(settings.dsn, settings.projector_group)
    )
    return read(
        settings,
        calls,
        consumers={WEBHOOK: settings.consumer_name, QUEUE: QUEUE_CONSUMER},
        provider=per_key(control.stats()),
        behind=behind,
    )


def per_key(stats: Stats) -> dict[str, KeyStats]:
    """The provider's counts by idempotency key, whatever the tool (a key is one operation)."""
    return {key: counts for tool in stats.tools.values() for key, counts in tool.keys.items()}
