"""The run: the demo's services as real processes, each SIGKILLed once at its fault point and
replaced by a new process that carries on with the rest of its calls (what a service's own
supervisor would do); the grant of one victim revoked right after its death (seed row 6); the
delivery worker SIGKILLed once, mid-run, and restarted by the stack's supervisor."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ledger.settings import Settings
from opledger import stack, supervisor
from opledger.demo import DemoError
from opledger.demo.plan import Call, Crash, Plan, crash_of
from opledger.demo.service import write_plan
from opledger.demo.setup import SetupError, now, revocation, write_policy

Echo = Callable[[str], None]

#: The delivery worker is SIGKILLed once this share of the calls has been answered.
DELIVERY_KILL_AT = 0.4
PROGRESS_EVERY_S = 3.0


@dataclass(frozen=True, slots=True)
class Announced:
    service: int  # 1-based, as the logs name it
    index: int
    call: Call


@dataclass(slots=True)
class Crashed:
    crash: Crash
    operation_id: str
    call: Call
    at_s: float
    #: the policy version of the revocation, when the crash asked for one
    revoked: str | None = None


@dataclass(slots=True)
class WorkerKill:
    name: str
    pid: int
    at_s: float
    back_after_s: float | None = None
    new_pid: int | None = None
    #: why it was not killed (the worker was not running under a supervisor)
    skipped: str | None = None


@dataclass(slots=True)
class RunReport:
    announced: dict[str, Announced] = field(default_factory=dict)
    #: operation id -> what its service was told: an execution state, or "error"
    answers: dict[str, str] = field(default_factory=dict)
    crashes: list[Crashed] = field(default_factory=list)
    delivery_kill: WorkerKill | None = None
    processes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Service:
    number: int
    process: subprocess.Popen[bytes]
    crash: Crash | None
    log: Path
    pending: bytes = b""
    eof: bool = False
    in_flight: tuple[int, str] | None = None
    answered: int = 0


class Runner:
    """Starts and watches the services; see the module docstring."""

    def __init__(
        self, settings: Settings, plan: Plan, work_dir: Path, log_dir: Path, echo: Echo
    ) -> None:
        self._settings = settings
        self._plan = plan
        self._work_dir = work_dir
        self._log_dir = log_dir
        self._echo = echo
        self._selector = selectors.DefaultSelector()
        self._live: list[_Service] = []
        self._report = RunReport()
        self._started = time.monotonic()
        self._total = plan.operations
        self._answered = 0
        self._last_progress = 0.0

    # -- the run -------------------------------------------------------------------------------

    def run(self, deadline: float) -> RunReport:
        self._started = time.monotonic()
        for number, calls in enumerate(self._plan.services, start=1):
            write_plan(self._plan_path(number), calls)
            self._start(number, 0, crash_of(self._plan, number - 1))
        try:
            while self._live:
                self._step()
                if time.monotonic() > deadline:
                    raise DemoError(
                        f"the services did not finish in time ({self._answered}/{self._total} "
                        f"calls answered); their logs are in {self._log_dir}"
                    )
        finally:
            self.stop()
        self._report.seconds = time.monotonic() - self._started
        return self._report

    def watch_delivery(self) -> None:
        """Say when the supervisor has the killed delivery worker serving again."""
        kill = self._report.delivery_kill
        if kill is None or kill.skipped is not None or kill.back_after_s is not None:
            return
        worker = supervisor.read_status(self._settings).get("workers", {}).get("delivery", {})
        pid = worker.get("pid")
        if worker.get("state") != "running" or pid in (None, kill.pid):
            return
        if not _answers(supervisor.delivery_healthz(self._settings)):
            return
        kill.new_pid = pid
        kill.back_after_s = self._elapsed() - kill.at_s
        self._echo(
            f"delivery worker: restarted by the supervisor (pid {pid}), serving again "
            f"{kill.back_after_s:.1f}s after the kill"
        )

    def stop(self) -> None:
        """SIGKILL whatever service still runs (the demo was interrupted or failed)."""
        for service in self._live:
            if service.process.poll() is None:
                service.process.kill()
                service.process.wait()
        self._live.clear()
        self._selector.close()

    # -- internals -----------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def _plan_path(self, number: int) -> Path:
        return self._work_dir / f"service-{number}.jsonl"

    def _start(self, number: int, start: int, crash: Crash | None) -> None:
        argv = [
            sys.executable, "-m", "opledger.cli", "demo", "service",
            "--plan", str(self._plan_path(number)),
            "--start", str(start),
            "--name", f"demo-service-{number}",
        ]  # fmt: skip
        if crash is not None:
            argv += ["--fault", crash.fault]
        log = self._log_dir / f"service-{number}.log"
        stderr: IO[bytes]
        with log.open("ab" if start else "wb") as stderr:
            # Same interpreter and environment: the service reads the same OPLEDGER_* settings.
            process = subprocess.Popen(  # our interpreter and CLI; no shell
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr
            )
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        service = _Service(number, process, crash, log)
        self._selector.register(process.stdout, selectors.EVENT_READ, service)
        self._live.append(service)
        self._report.processes += 1

    def _step(self) -> None:
        for key, _events in self._selector.select(timeout=0.2):
            service: _Service = key.data
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                service.eof = True
                self._selector.unregister(key.fileobj)
                continue
            service.pending += chunk
            *lines, service.pending = service.pending.split(b"\n")
            for line in lines:
                self._line(service, line.decode("utf-8", "replace"))
        for service in list(self._live):
            if service.eof and service.process.poll() is not None:
                self._live.remove(service)
                assert service.process.stdout is not None
                service.process.stdout.close()
                self._exited(service)
        self._maybe_kill_delivery()
        self.watch_delivery()
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = time.monotonic()
            self._echo(
                f"  {self._elapsed():5.1f}s  calls answered {self._answered}/{self._total}, "
                f"services running {len(self._live)}, crashes {len(self._report.crashes)}"
                f"/{len(self._plan.crashes)}"
            )

    def _line(self, service: _Service, line: str) -> None:
        parts = line.split()
        if len(parts) < 3 or parts[0] not in ("op", "done", "error"):
            return
        index, op_id = int(parts[1]), parts[2]
        if parts[0] == "op":
            call = self._plan.services[service.number - 1][index]
            self._report.announced[op_id] = Announced(service.number, index, call)
            service.in_flight = (index, op_id)
            return
        self._report.answers[op_id] = parts[3] if parts[0] == "done" else "error"
        service.in_flight = None
        service.answered += 1
        self._answered += 1

    def _exited(self, service: _Service) -> None:
        code = service.process.returncode
        crash = service.crash
        if code == 0:
            return
        if code != -signal.SIGKILL or crash is None:
            raise DemoError(
                f"service-{service.number} exited with {supervisor.describe_exit(code)}; "
                f"last lines of {service.log}:\n{_tail(service.log)}"
            )
        if service.in_flight is None:
            raise DemoError(
                f"service-{service.number} was killed with no call in flight; see {service.log}"
            )
        index, op_id = service.in_flight
        call = self._plan.services[service.number - 1][index]
        crashed = Crashed(crash, op_id, call, self._elapsed())
        self._report.crashes.append(crashed)
        self._echo(
            f"service-{service.number}: SIGKILLed at {crash.point} (the {_ordinal(crash.nth)} "
            f"time it got there) while {op_id} was in flight "
            f"({call.tenant_id} {call.actor_id} {call.tool_name})"
        )
        if crash.revoke:
            change = revocation(call.subject, now())
            try:
                waited = write_policy(self._settings, [change])
            except SetupError as exc:
                raise DemoError(str(exc)) from None
            crashed.revoked = change.event_id
            self._echo(
                f"policy: revoked {call.tenant_id} {call.actor_id} {call.tool_name} "
                f"(version {change.event_id}), in effect {waited:.2f}s later, before anyone "
                f"reconciles {op_id}"
            )
        if index + 1 < len(self._plan.services[service.number - 1]):
            self._echo(f"service-{service.number}: a new process carries on from call {index + 1}")
            self._start(service.number, index + 1, None)

    def _maybe_kill_delivery(self) -> None:
        if (
            self._report.delivery_kill is not None
            or self._answered < DELIVERY_KILL_AT * self._total
        ):
            return
        try:
            pid = stack.restart_worker(
                self._settings, "delivery", lambda _line: None, kill=True, wait=False
            )
        except stack.StackError as exc:
            self._echo(f"delivery worker: not killed: {exc}")
            self._report.delivery_kill = WorkerKill(
                "delivery", 0, self._elapsed(), skipped=str(exc)
            )
            return
        self._report.delivery_kill = WorkerKill("delivery", pid, self._elapsed())
        self._echo(
            f"delivery worker: SIGKILLed (pid {pid}) mid-run; the supervisor restarts it. Its "
            "deliveries wait (none is lost) until its consumer group gives the dead member's "
            "partitions away: up to the group's session timeout"
        )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # a fixed local URL
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
