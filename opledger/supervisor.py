"""Local process supervision: every worker runs as a child of one supervisor, which restarts it.

``opledger stack up`` starts one supervisor per ``OPLEDGER_HOME`` (detached, in a session of its
own). It starts each worker in :data:`WORKERS` as ``python -m opledger.cli ARGS`` with the same
interpreter and environment, appends its output to ``logs/<name>.log``, and restarts any worker
that exits, whatever the exit code or signal, after an exponential backoff. What it knows about
each worker is written atomically to ``run/supervisor.json`` for ``opledger stack status``.
SIGTERM or SIGINT stops the workers (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`) and then
the supervisor.

Only the standard library and settings are imported here: ``opledger stack status`` reads this
module and must stay fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from ledger.settings import Settings

log = logging.getLogger("opledger.supervisor")

#: First restart delay; it doubles on every exit up to BACKOFF_MAX_S...
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
#: ...and falls back to BACKOFF_INITIAL_S once a worker had stayed up this long before exiting.
STABLE_AFTER_S = 60.0
#: How long a worker may take to stop after SIGTERM before it is SIGKILLed. Every worker must be
#: safe to SIGKILL anyway (the projector commits offsets with its rows); this only buys a tidy exit.
STOP_TIMEOUT_S = 20.0
#: A child's exit is noticed within this; short next to the smallest backoff.
POLL_S = 0.2

EXIT_ALREADY_RUNNING = 1

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One supervised worker: ``python -m opledger.cli *args``, its output in logs/<name>.log."""

    name: str
    args: tuple[str, ...]
    #: A URL answering 200 once the worker serves; ``stack up`` waits for it. None: no wait.
    ready_url: Callable[[Settings], str] | None = None


def projector_healthz(settings: Settings) -> str:
    """The projector's /healthz (the demo probes the same URL before starting its own)."""
    return f"http://127.0.0.1:{settings.projector_web_port}/healthz"


#: Every worker the local stack runs. Adding one is one line; its log, restarts and status line
#: follow. Keep docker-compose.yml in step (a service with a `restart:` policy per worker).
def recovery_healthz(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.recovery_web_port}/healthz"


def delivery_healthz(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.delivery_web_port}/healthz"


def fake_provider_health(settings: Settings) -> str:
    return f"{settings.fake_provider_url.rstrip('/')}/_control/health"


def consumer_healthz(settings: Settings) -> str:
    """The reference consumer's /healthz: 200 once its key view is restored."""
    return f"http://127.0.0.1:{settings.consumer_web_port}/healthz"


#: The local stack's outside world: the demo's tools are served by the fake provider, and the
#: recovery worker calls them unless OPLEDGER_PROVIDERS names real ones.
LOCAL_PROVIDERS = "opledger.fakes.providers:from_settings"
#: The local stack's webhook signing secret for the reference consumer, relative to
#: OPLEDGER_HOME: written once (mode 0600) by `opledger stack up`, read by `consumer run
#: --secrets-file` into its settings, so it is never on a command line, in the environment of
#: `ps`, or in a log.
LOCAL_CONSUMER_SECRET = "secrets/consumer-webhook.whsec"
#: Networks the local stack's delivery worker may send webhooks to although they are refused by
#: default (decision 019): loopback, where its reference consumer (and any receiver a developer
#: runs on this machine) listens. The stack is a single-machine launcher; these are added to
#: whatever OPLEDGER_DELIVERY_ALLOW_NETWORKS says. A deployment runs `opledger deliver run`
#: without them.
LOCAL_ALLOW_NETWORKS = "127.0.0.0/8,::1/128"

WORKERS: tuple[WorkerSpec, ...] = (
    WorkerSpec("projector", ("projector", "run"), ready_url=projector_healthz),
    WorkerSpec(
        "recovery",
        ("recover", "run", "--default-providers", LOCAL_PROVIDERS),
        ready_url=recovery_healthz,
    ),
    WorkerSpec(
        "delivery",
        ("deliver", "run", "--allow-networks", LOCAL_ALLOW_NETWORKS),
        ready_url=delivery_healthz,
    ),
    WorkerSpec("fake-provider", ("fake-provider", "run"), ready_url=fake_provider_health),
    # The reference consumer: POST /events, deduplicated on operation_id, in its own database
    # (created by `stack up`); what a tenant's webhook destination points at on this machine.
    WorkerSpec(
        "consumer",
        ("consumer", "run", "--secrets-file", LOCAL_CONSUMER_SECRET),
        ready_url=consumer_healthz,
    ),
)


# ---------------------------------------------------------------------------------------------
# files under OPLEDGER_HOME


def run_dir(settings: Settings) -> Path:
    return settings.home / "run"


def pid_file(settings: Settings) -> Path:
    return run_dir(settings) / "supervisor.pid"


def status_file(settings: Settings) -> Path:
    return run_dir(settings) / "supervisor.json"


def _lock_file(settings: Settings) -> Path:
    return run_dir(settings) / "supervisor.lock"


def supervisor_log(settings: Settings) -> Path:
    return settings.home / "logs" / "supervisor.log"


def worker_log(settings: Settings, name: str) -> Path:
    return settings.home / "logs" / f"{name}.log"


def write_atomically(path: Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` by rename, so a reader sees the old or the new content, never a mix,
    optionally owned by ``owner`` (uid, gid).

    The partial file is new (O_EXCL never follows a link) and renamed over the name, which
    replaces a symlink planted there rather than writing or chowning through it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as out:
            if owner is not None:
                os.fchown(out.fileno(), *owner)
            out.write(text)
        partial.replace(path)
    except BaseException:
        # A full disk fails the write: leave no partial file to fill it further.
        partial.unlink(missing_ok=True)
        raise


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it still answers kill(0), /proc tells)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def read_pid(path: Path) -> int | None:
    """The number on the first line of a pid file; None when missing or not a pid."""
    try:
        pid = int(path.read_text(errors="replace").split("\n", 1)[0].strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def argv_of(pid: int) -> list[bytes] | None:
    """The command line of a live (non-zombie) process; None when it is gone or hidden."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").split(b"\0") if raw and alive(pid) else None


def runs_in(pid: int, directory: Path) -> bool | None:
    """Whether the process works in ``directory``; None when it may not be inspected."""
    try:
        cwd = os.stat(f"/proc/{pid}/cwd")
        here = os.stat(directory)
    except PermissionError:
        return None
    except OSError:
        return False
    return (cwd.st_dev, cwd.st_ino) == (here.st_dev, here.st_ino)


def owned(pid: int, marker: bytes, directory: Path) -> bool:
    """Whether ``pid`` is a process of ours: ``marker`` in its command line and ``directory``
    as its working directory.

    A pid file alone proves nothing: after a crash or a reboot its number may belong to any
    process, and a home copied with its run/ (or a stale file) can name another home's live
    supervisor or broker, which carry the same command line. The working directory tells
    them apart: the supervisor moves into its home, the broker is started in it.
    """
    argv = argv_of(pid)
    return argv is not None and marker in b" ".join(argv) and runs_in(pid, directory) is True


def find_owned(marker: bytes, directory: Path, hint: int | None = None) -> int | None:
    """The pid of our process marked ``marker`` in ``directory``: ``hint`` (a pid file's)
    when it is that process, else the first found in /proc (a start interrupted between
    spawning the process and writing its pid file leaves it running, untracked)."""
    if hint is not None and owned(hint, marker, directory):
        return hint
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and owned(int(entry.name), marker, directory):
            return int(entry.name)
    return None


def supervisor_pid(settings: Settings) -> int | None:
    """Pid of the supervisor serving ``settings.home``, if it is alive."""
    return find_owned(b"opledger.supervisor", settings.home, read_pid(pid_file(settings)))


def worker_pid(settings: Settings, name: str, parent: int) -> int | None:
    """The pid ``run/supervisor.json`` gives for worker ``name`` if that process is one the
    supervisor ``parent`` started (a status file may be stale, copied or hand-edited)."""
    worker = read_status(settings).get("workers", {}).get(name, {})
    pid = worker.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    argv = argv_of(pid)
    if argv is None or b"opledger.cli" not in argv:
        return None
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pid if ppid == parent else None


def read_status(settings: Settings) -> dict[str, Any]:
    """The last status the supervisor wrote, in its shape; empty when there is none or it is
    unreadable, and without the parts that are not what a supervisor writes (a truncated or
    hand-edited file must not crash ``status``, ``up`` or ``restart``)."""
    try:
        data = json.loads(status_file(settings).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    own = data.get("supervisor")
    workers = data.get("workers")
    return {
        "supervisor": own if isinstance(own, dict) else {},
        "workers": {
            str(name): worker
            for name, worker in (workers.items() if isinstance(workers, dict) else ())
            if isinstance(worker, dict)
        },
    }


# ---------------------------------------------------------------------------------------------
# pure decisions


def next_backoff(previous_s: float | None, uptime_s: float) -> float:
    """Delay before restarting a worker that exited after ``uptime_s`` seconds.

    ``previous_s`` is the delay used before its last start (None: it never exited before).
    """
    if previous_s is None or uptime_s >= STABLE_AFTER_S:
        return BACKOFF_INITIAL_S
    return min(previous_s * 2, BACKOFF_MAX_S)


def describe_exit(returncode: int) -> str:
    """``exit code 2`` or ``killed by SIGKILL``, from a Popen return code."""
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    return f"exit code {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------------------------------------
# the supervisor


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook making the child receive SIGKILL when the supervisor dies.

    Why PR_SET_PDEATHSIG rather than each worker watching its parent: the kernel delivers it even
    when the supervisor is SIGKILLed and even when the worker is hung, and the workers (faust, and
    whatever comes next) need no code of their own for it. SIGKILL rather than SIGTERM, so a worker
    stuck in shutdown cannot live on; every worker must be crash-safe anyway (the projector commits
    offsets with its rows; the chaos tests SIGKILL it). Linux only: elsewhere the hook is None and
    ``stack down`` still stops the workers through the supervisor or its process group.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Resolved here, in the parent: the child must not load libraries between fork and exec.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            # The supervisor died between fork and prctl, so no signal will ever come.
            os._exit(1)

    return hook


@dataclass(slots=True)
class _Worker:
    spec: WorkerSpec
    process: subprocess.Popen[bytes] | None = None
    started_monotonic: float = 0.0
    started_at: str | None = None
    restarts: int = 0
    backoff_s: float | None = None
    next_start_monotonic: float = 0.0
    last_exit_code: int | None = None
    last_exit_signal: str | None = None
    last_exit_at: str | None = None

    def record_exit(self, returncode: int) -> None:
        self.process = None
        self.last_exit_code = returncode if returncode >= 0 else None
        self.last_exit_signal = _signal_name(-returncode) if returncode < 0 else None
        self.last_exit_at = _now_iso()

    def as_json(self, stopping: bool) -> dict[str, Any]:
        idle = "stopped" if stopping else "restarting"
        state = "running" if self.process is not None else idle
        next_start_at = None
        if state == "restarting":
            wait_s = max(0.0, self.next_start_monotonic - time.monotonic())
            next_start_at = datetime.fromtimestamp(time.time() + wait_s, UTC).isoformat(
                timespec="milliseconds"
            )
        return {
            "state": state,
            "pid": self.process.pid if self.process is not None else None,
            "argv_suffix": list(self.spec.args),
            "restarts": self.restarts,
            "started_at": self.started_at,
            "last_exit_code": self.last_exit_code,
            "last_exit_signal": self.last_exit_signal,
            "last_exit_at": self.last_exit_at,
            "backoff_s": self.backoff_s,
            "next_start_at": next_start_at,
        }


class Supervisor:
    """Runs ``specs`` as children until SIGTERM/SIGINT, restarting each one that exits.

    Single-threaded on purpose: PR_SET_PDEATHSIG fires when the *thread* that forked the child
    exits, and Popen's pre-exec hook is only safe without other threads.
    """

    def __init__(self, settings: Settings, specs: Sequence[WorkerSpec] = WORKERS) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique: {names}")
        self._settings = settings
        self._workers = [_Worker(spec) for spec in specs]
        self._stop_signal: int | None = None
        self._started_at = _now_iso()
        self._pre_exec = _die_with_parent()
        self._status_identity: tuple[int, int, int] | None = None

    def run(self) -> int:
        """Supervise until asked to stop; 0 then, EXIT_ALREADY_RUNNING if another one runs."""
        run_dir(self._settings).mkdir(parents=True, exist_ok=True)
        (self._settings.home / "logs").mkdir(parents=True, exist_ok=True)
        # Its working directory is how `stack` recognises it (supervisor_pid): a recycled pid
        # or another home's supervisor never works in this home.
        os.chdir(self._settings.home)
        # Held for the supervisor's life and released by the kernel however it dies: one
        # supervisor per home, even if two are started at once. Not inherited by the workers
        # (Python opens it close-on-exec), so a surviving worker cannot hold it.
        with _lock_file(self._settings).open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.error(
                    "another supervisor (pid %s) already runs for %s",
                    supervisor_pid(self._settings) or "?",
                    self._settings.home,
                )
                return EXIT_ALREADY_RUNNING
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_stop_signal)
            write_atomically(pid_file(self._settings), f"{os.getpid()}\n")
            log.info(
                "supervisor %d started for %s: %s",
                os.getpid(),
                self._settings.home,
                ", ".join(w.spec.name for w in self._workers),
            )
            try:
                while self._stop_signal is None:
                    self._step()
                    time.sleep(POLL_S)
                log.info("%s received: stopping the workers", _signal_name(self._stop_signal))
            finally:
                self._stop_workers()
                with contextlib.suppress(OSError):
                    pid_file(self._settings).unlink()
        log.info("supervisor %d stopped", os.getpid())
        return 0

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def _step(self) -> None:
        # Nothing a worker does may end the supervisor: any error here is logged and the loop
        # goes on, retrying at the next step.
        try:
            changed = False
            now = time.monotonic()
            for worker in self._workers:
                if worker.process is not None:
                    returncode = worker.process.poll()
                    if returncode is None:
                        continue
                    self._on_exit(worker, returncode, now)
                    changed = True
                if now >= worker.next_start_monotonic and self._stop_signal is None:
                    self._start(worker)
                    changed = True
            if changed or self._status_replaced():
                self._write_status()
        except Exception:
            log.exception("supervisor step failed; retrying")

    def _on_exit(self, worker: _Worker, returncode: int, now: float) -> None:
        uptime_s = now - worker.started_monotonic
        worker.record_exit(returncode)
        worker.backoff_s = next_backoff(worker.backoff_s, uptime_s)
        worker.next_start_monotonic = now + worker.backoff_s
        log.warning(
            "%s exited (%s) after %.1fs; restart %d in %.0fs",
            worker.spec.name,
            describe_exit(returncode),
            uptime_s,
            worker.restarts + 1,
            worker.backoff_s,
        )

    def _start(self, worker: _Worker) -> None:
        argv = [sys.executable, "-m", "opledger.cli", *worker.spec.args]
        path = worker_log(self._settings, worker.spec.name)
        first = worker.started_at is None
        try:
            with path.open("ab") as out:
                out.write(f"--- {_now_iso()} supervisor starts: {' '.join(argv)}\n".encode())
                out.flush()
                # The child keeps its own copy of the log descriptor; ours closes here.
                process = subprocess.Popen(  # our interpreter and our CLI; no shell
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    # Workers write relative paths (faust's data dir) under home, not wherever
                    # `stack up` happened to run.
                    cwd=self._settings.home,
                    preexec_fn=self._pre_exec,  # noqa: PLW1509  # single-threaded (class docstring)
                )
        except OSError as exc:
            # Counted like an exit, so a persistent cause (fd limit, bad log path) backs off too.
            now = time.monotonic()
            worker.started_monotonic = now
            worker.last_exit_code, worker.last_exit_signal = None, None
            worker.last_exit_at = _now_iso()
            worker.backoff_s = next_backoff(worker.backoff_s, 0.0)
            worker.next_start_monotonic = now + worker.backoff_s
            log.error(
                "cannot start %s: %s; retry in %.0fs", worker.spec.name, exc, worker.backoff_s
            )
            return
        if not first:
            worker.restarts += 1
        worker.process = process
        worker.started_monotonic = time.monotonic()
        worker.started_at = _now_iso()
        log.info(
            "%s %s (pid %d), log %s",
            worker.spec.name,
            "started" if first else f"restarted (restart {worker.restarts})",
            process.pid,
            path,
        )

    def _stop_workers(self) -> None:
        live = [w for w in self._workers if w.process is not None]
        for worker in live:
            assert worker.process is not None
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in live:
            process = worker.process
            assert process is not None
            try:
                returncode = process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s (pid %d) still running %.0fs after SIGTERM: SIGKILL",
                    worker.spec.name,
                    process.pid,
                    STOP_TIMEOUT_S,
                )
                process.kill()
                returncode = process.wait()
            worker.record_exit(returncode)
            log.info(
                "%s (pid %d) stopped: %s", worker.spec.name, process.pid, describe_exit(returncode)
            )
        try:
            self._write_status(stopping=True)
        except OSError:
            log.exception("could not write the final status")

    def _status_replaced(self) -> bool:
        # Written only on changes, so a file truncated, edited or removed by someone else
        # would otherwise misreport every worker until one exits.
        try:
            found = os.stat(status_file(self._settings))
        except OSError:
            found = None
        identity = None if found is None else (found.st_ino, found.st_mtime_ns, found.st_size)
        if identity == self._status_identity:
            return False
        log.warning(
            "%s was changed or removed by someone else: rewriting it", status_file(self._settings)
        )
        return True

    def _write_status(self, stopping: bool = False) -> None:
        status = {
            "supervisor": {
                "pid": os.getpid(),
                "started_at": self._started_at,
                "state": "stopped" if stopping else "running",
            },
            "workers": {w.spec.name: w.as_json(stopping) for w in self._workers},
        }
        path = status_file(self._settings)
        write_atomically(path, json.dumps(status, indent=2) + "\n")
        found = os.stat(path)
        self._status_identity = (found.st_ino, found.st_mtime_ns, found.st_size)


# ---------------------------------------------------------------------------------------------
# what `stack status` prints


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _since(iso: str | None) -> float:
    if not iso:
        return 0.0
    try:
        return time.time() - datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return 0.0


def _last_exit(worker: dict[str, Any]) -> str:
    if worker.get("last_exit_signal"):
        return f"killed by {worker['last_exit_signal']}"
    if worker.get("last_exit_code") is not None:
        return f"exit code {worker['last_exit_code']}"
    return "-"


def status_lines(settings: Settings, specs: Sequence[WorkerSpec] = WORKERS) -> list[str]:
    """One line for the supervisor and one per worker, aligned with the servers' lines."""
    pid = supervisor_pid(settings)
    if pid is None:
        lines = [
            "supervisor stopped  pid -       workers not running: `opledger stack up` starts them"
        ]
        return lines + [f"{spec.name:<9} {'stopped':<9} pid -" for spec in specs]
    lines = [f"supervisor running  {f'pid {pid}':<11} log {supervisor_log(settings)}"]
    workers: dict[str, Any] = read_status(settings).get("workers", {})
    names = list(workers) + [s.name for s in specs if s.name not in workers]
    for name in names:
        worker = workers.get(name)
        if not isinstance(worker, dict):
            lines.append(f"{name:<9} {'stopped':<9} pid -       not supervised yet")
            continue
        state = str(worker.get("state", "?"))
        pid_text = f"pid {worker['pid']}" if worker.get("pid") else "pid -"
        if state == "running":
            timing = f"up {_duration(_since(worker.get('started_at')))}"
        elif state == "restarting":
            timing = f"next start in {_duration(-_since(worker.get('next_start_at')))}"
        else:
            timing = "-"
        lines.append(
            f"{name:<9} {state:<9} {pid_text:<11} restarts {worker.get('restarts', 0):<4} "
            f"{timing:<20} last exit {_last_exit(worker)}"
        )
    return lines


def main(specs: Sequence[WorkerSpec] = WORKERS) -> int:
    """``python -m opledger.supervisor``: supervise ``specs`` for the configured home."""
    settings = Settings.from_env()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    return Supervisor(settings, specs).run()


if __name__ == "__main__":
    sys.exit(main())
