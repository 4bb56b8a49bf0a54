"""The worker supervisor (``opledger/supervisor.py``) seen from the launcher: started detached,
waited on until its workers serve, stopped with them, and one worker restarted on request."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from ledger.settings import Settings
from opledger import supervisor
from opledger.stack.errors import StackError
from opledger.stack.home import (
    locked,
    prepare_home,
)
from opledger.stack.processes import Echo, port_open, tail

SUPERVISOR_START_TIMEOUT = 15.0


#: The supervisor gives its workers STOP_TIMEOUT_S after SIGTERM; this adds its own exit.
SUPERVISOR_STOP_TIMEOUT = supervisor.STOP_TIMEOUT_S + 10.0


#: How long `up` waits for a worker's ready URL (the projector needs a few seconds to serve).
WORKERS_READY_TIMEOUT = 60.0


def start_supervisor(
    settings: Settings, echo: Echo = print, env: Mapping[str, str] | None = None
) -> int:
    """Start the supervisor detached, unless one runs for this home; return its pid.

    ``env`` replaces the inherited environment (tests pass their isolated settings' variables);
    the supervisor and its workers read their settings from it.
    """
    running = supervisor.supervisor_pid(settings)
    if running is not None:
        return running
    prepare_home(settings)
    log = supervisor.supervisor_log(settings)
    with log.open("ab") as out:
        # A session of its own, like the broker: it must outlive this command and ignore the
        # terminal's Ctrl-C; its workers join that session, so `down` can find all of them.
        process = subprocess.Popen(  # our interpreter and module; no shell
            [sys.executable, "-m", "opledger.supervisor"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=settings.home,
            env=None if env is None else dict(env),
        )
    deadline = time.monotonic() + SUPERVISOR_START_TIMEOUT
    # Its pid file, written once it holds the home's supervisor lock: found in /proc alone,
    # it may still be about to lose that lock to another supervisor and exit.
    while supervisor.read_pid(supervisor.pid_file(settings)) != process.pid:
        if process.poll() is not None or time.monotonic() > deadline:
            raise StackError(
                f"the worker supervisor did not start (exit {process.poll()}); last log lines:\n"
                + tail(log, 15)
            )
        time.sleep(0.1)
    names = ", ".join(spec.name for spec in supervisor.WORKERS)
    echo(f"supervisor: started (pid {process.pid}) running {names}; log {log}")
    return process.pid


def wait_workers_ready(
    settings: Settings, echo: Echo = print, timeout: float = WORKERS_READY_TIMEOUT
) -> bool:
    """Wait until every worker with a ready URL answers 200; False (and say so) on timeout.

    Not an error: the supervisor keeps restarting a worker that fails, and ``status`` shows it.
    Waiting matters because ``opledger demo`` starts a projector of its own unless one serves.
    """
    deadline = time.monotonic() + timeout
    ready = True
    for spec in supervisor.WORKERS:
        if spec.ready_url is None:
            continue
        url = spec.ready_url(settings)
        while not _answers(url):
            if time.monotonic() > deadline:
                echo(
                    f"{spec.name}: not serving {url} after {timeout:.0f}s; the supervisor keeps "
                    f"restarting it: see `opledger stack status` and "
                    f"{supervisor.worker_log(settings, spec.name)}"
                )
                ready = False
                break
            time.sleep(0.3)
        else:
            echo(f"{spec.name}: serving {url}")
    return ready


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # a fixed local URL
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_supervisor(settings: Settings, echo: Echo = print) -> None:
    """SIGTERM the supervisor, which stops its workers first; SIGKILL its session if it hangs."""
    pid = supervisor.supervisor_pid(settings)
    if pid is None:
        echo("supervisor: not running")
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + SUPERVISOR_STOP_TIMEOUT
    while time.monotonic() < deadline and supervisor.alive(pid):
        time.sleep(0.1)
    if supervisor.alive(pid):
        echo(f"supervisor: no exit {SUPERVISOR_STOP_TIMEOUT:.0f}s after SIGTERM, sending SIGKILL")
        # Its workers die with it (PR_SET_PDEATHSIG); the process group catches any left over,
        # but only when it is the supervisor's own group (started by `up`), never a shell's.
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        while supervisor.alive(pid):
            time.sleep(0.1)
    echo(f"supervisor: stopped (pid {pid}) with its workers")


def worker_ports(settings: Settings) -> list[tuple[int, str]]:
    """The loopback ports the workers listen on, with the variable that moves each."""
    ports = [
        (settings.projector_web_port, "OPLEDGER_PROJECTOR_WEB_PORT"),
        (settings.recovery_web_port, "OPLEDGER_RECOVERY_WEB_PORT"),
        (settings.delivery_web_port, "OPLEDGER_DELIVERY_WEB_PORT"),
        (settings.consumer_web_port, "OPLEDGER_CONSUMER_WEB_PORT"),
    ]
    provider = urllib.parse.urlsplit(settings.fake_provider_url)
    if provider.hostname in ("127.0.0.1", "localhost") and provider.port:
        ports.append((provider.port, "OPLEDGER_FAKE_PROVIDER_URL"))
    return ports


def check_worker_ports(settings: Settings) -> None:
    """Refuse to start workers whose ports another process listens on: they would only
    crash-loop, and `up` would take that process's /healthz (another stack's projector,
    say) for theirs."""
    for port, variable in worker_ports(settings):
        if port_open(port):
            raise StackError(
                f"127.0.0.1:{port} is in use by a process this stack's supervisor did not "
                f"start (`ss -ltnp 'sport = :{port}'` names it): stop it or choose another "
                f"port with {variable}"
            )


def workers_changed(settings: Settings) -> str:
    """How the running supervisor's workers differ from WORKERS ("" when they do not, or when
    it has not written its status yet)."""
    status = supervisor.read_status(settings)
    running = supervisor.supervisor_pid(settings)
    if running is None or status.get("supervisor", {}).get("pid") != running:
        return ""  # a status written by an earlier supervisor, or none yet: nothing to compare
    supervised = {
        name: tuple(map(str, suffix))
        if isinstance(suffix := worker.get("argv_suffix"), list)
        else ()
        for name, worker in status.get("workers", {}).items()
    }
    wanted = {spec.name: spec.args for spec in supervisor.WORKERS}
    differences = [f"+{name}" for name in wanted if name not in supervised]
    differences += [f"-{name}" for name in supervised if name not in wanted]
    differences += [
        f"~{name}" for name in wanted if name in supervised and supervised[name] != wanted[name]
    ]
    return ", ".join(differences)


def restart_worker(
    settings: Settings, name: str, echo: Echo = print, *, kill: bool = False, wait: bool = True
) -> int:
    """Stop one supervised worker (SIGTERM, or SIGKILL with ``kill``) and let the supervisor
    start it again, as it does after any crash; returns the pid that was stopped. ``wait``:
    until the new process serves its ready URL."""
    names = [spec.name for spec in supervisor.WORKERS]
    if name not in names:
        raise StackError(f"no worker named {name!r}: the workers are {', '.join(names)}")
    # Under the stack lock: two restarts of one worker would both stop the same process (one
    # restart for two requests), and a `down` meanwhile would leave this one waiting in vain.
    with locked(settings, f"restart {name}", echo):
        parent = supervisor.supervisor_pid(settings)
        if parent is None:
            raise StackError("the supervisor is not running: start it with `opledger stack up`")
        # Only a child of our supervisor: run/supervisor.json may name a recycled pid or, if
        # copied from another home, another stack's worker.
        pid = supervisor.worker_pid(settings, name, parent)
        if pid is None:
            raise StackError(
                f"{name} is not running now (the supervisor is restarting it?): "
                "see `opledger stack status`"
            )
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile: restarted anyway
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
        echo(f"{name}: {'killed' if kill else 'stopped'} (pid {pid}); the supervisor restarts it")
        if wait:
            _wait_restarted(settings, name, pid, echo)
    return pid


def _wait_restarted(settings: Settings, name: str, old_pid: int, echo: Echo) -> None:
    spec = next(spec for spec in supervisor.WORKERS if spec.name == name)
    deadline = time.monotonic() + supervisor.BACKOFF_MAX_S + WORKERS_READY_TIMEOUT
    while True:
        worker = supervisor.read_status(settings).get("workers", {}).get(name, {})
        pid = worker.get("pid")
        if (
            worker.get("state") == "running"
            and pid not in (None, old_pid)
            and (spec.ready_url is None or _answers(spec.ready_url(settings)))
        ):
            echo(f"{name}: running again (pid {pid})")
            return
        if time.monotonic() > deadline:
            raise StackError(
                f"{name} is not serving again; see `opledger stack status` and "
                f"{supervisor.worker_log(settings, name)}"
            )
        time.sleep(0.2)
