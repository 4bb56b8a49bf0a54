"""The worker supervisor as ``opledger stack up`` runs it, on an isolated configuration: its own
OPLEDGER_HOME under tmp_path, its own topics, database and projector web port, so the shared
stack's own supervisor and projector are never touched. Processes are checked in /proc."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ledger.settings import Settings
from opledger import stack, supervisor
from opledger.stack.workers import workers_changed
from opledger.workload import Workload
from tests.demo_support import private_demo_settings
from tests.support import env_for, produce, wait_caught_up

#: A worker whose command line the CLI rejects at once (argparse exits 2).
BROKEN_SUPERVISOR = (
    "import sys; from opledger.supervisor import WorkerSpec, main; "
    "sys.exit(main([WorkerSpec('broken', ('no-such-command',))]))"
)


def _own_home(isolated: Settings, tmp_path: Path) -> Settings:
    """A home and ports of its own: the shared stack's workers use the default ones. The
    reference consumer keeps its tables in the test's database and its secret in this home."""
    settings = private_demo_settings(isolated, tmp_path).with_(
        delivery_allow_networks=isolated.delivery_allow_networks
    )
    stack.ensure_consumer_secret(settings)
    return settings


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.1)


def _worker(settings: Settings, name: str) -> dict[str, Any]:
    worker: dict[str, Any] = supervisor.read_status(settings).get("workers", {}).get(name, {})
    return worker


def _serving(settings: Settings) -> bool:
    url = supervisor.projector_healthz(settings)
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _session_members(session: int) -> set[int]:
    """Every live (non-zombie) process of a session: the supervisor and all it started."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state != "Z":
            members.add(int(entry.name))
    return members


@contextlib.contextmanager
def _supervisor(
    settings: Settings, tmp_path: Path, code: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A supervisor in a session of its own (as `stack up` starts it); never outlives the test."""
    argv = [sys.executable, *(("-c", code) if code else ("-m", "opledger.supervisor"))]
    with (tmp_path / "supervisor.out").open("ab") as out:
        process = subprocess.Popen(
            argv,
            env=env_for(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        # SIGKILL the whole session: quick, and a clean stop is not what these tests check (the
        # SIGTERM test below does). Every worker is crash-safe, the projector included.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _supervisor_log(tmp_path: Path) -> str:
    return (tmp_path / "supervisor.out").read_text(errors="replace")


def test_sigkilled_projector_is_restarted_and_serves_again(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = _own_home(isolated, tmp_path)
    with _supervisor(settings, tmp_path) as process:
        _wait(lambda: _serving(settings), 60, "projector serving /healthz")
        first = _worker(settings, "projector")
        assert (first["state"], first["restarts"]) == ("running", 0), first

        os.kill(first["pid"], signal.SIGKILL)

        def restarted() -> bool:
            now = _worker(settings, "projector")
            return now.get("restarts") == 1 and now.get("state") == "running"

        _wait(restarted, 15, "projector restarted after SIGKILL")
        second = _worker(settings, "projector")
        assert second["pid"] != first["pid"]
        assert not _alive(first["pid"])
        assert (second["last_exit_signal"], second["last_exit_code"]) == ("SIGKILL", None)
        # The old process is gone, so whatever answers now is the restarted one.
        _wait(lambda: _serving(settings), 60, "restarted projector serving /healthz")
        assert process.poll() is None, "the supervisor survives its child's death"
        log = _supervisor_log(tmp_path)
        assert re.search(r"projector exited \(killed by SIGKILL\) after [\d.]+s; restart 1", log)
        assert f"projector restarted (restart 1) (pid {second['pid']})" in log


def test_worker_that_exits_at_once_is_restarted_with_backoff(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = _own_home(isolated, tmp_path)
    with _supervisor(settings, tmp_path, code=BROKEN_SUPERVISOR) as process:
        # (when this test saw it, restarts): polled far faster than the smallest backoff.
        seen: list[tuple[float, int]] = []
        deadline = time.monotonic() + 25
        while not seen or seen[-1][1] < 3:
            assert time.monotonic() < deadline, f"restarts seen: {seen}"
            restarts = _worker(settings, "broken").get("restarts")
            if restarts is not None and (not seen or seen[-1][1] != restarts):
                seen.append((time.monotonic(), restarts))
            time.sleep(0.05)
        final = _worker(settings, "broken")
        assert process.poll() is None, "the supervisor survives a worker that keeps failing"
    assert [restarts for _, restarts in seen] == [0, 1, 2, 3]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(seen)]
    # Start to start = the child's run time + the backoff after its exit: 1 s, 2 s, 4 s.
    # A hot loop would restart every ~0.6 s (the interpreter's start-up) instead.
    for gap, backoff in zip(gaps, (1.0, 2.0, 4.0), strict=True):
        assert gap >= backoff, f"gaps {gaps}"
    assert final["last_exit_code"] == 2
    log = _supervisor_log(tmp_path)
    assert log.count("broken exited (exit code 2)") >= 3, log[-2000:]
    for restart, delay in ((1, 1), (2, 2), (3, 4)):
        assert re.search(rf"; restart {restart} in {delay}s", log), log[-2000:]
    assert "usage: opledger" in supervisor.worker_log(settings, "broken").read_text()


def test_stack_starts_one_supervisor_and_sigterm_stops_every_worker(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = _own_home(isolated, tmp_path)
    env = env_for(settings)
    lines: list[str] = []
    pid = stack.start_supervisor(settings, lines.append, env=env)
    try:
        assert stack.start_supervisor(settings, lines.append, env=env) == pid, "idempotent"
        assert stack.wait_workers_ready(settings, lines.append, timeout=60)
        assert lines[0].startswith(f"supervisor: started (pid {pid}) running projector")
        assert lines[1:] == [
            f"projector: serving {supervisor.projector_healthz(settings)}",
            f"recovery: serving {supervisor.recovery_healthz(settings)}",
            f"delivery: serving {supervisor.delivery_healthz(settings)}",
            f"fake-provider: serving {supervisor.fake_provider_health(settings)}",
            f"consumer: serving {supervisor.consumer_healthz(settings)}",
        ]
        status = supervisor.status_lines(settings)
        assert status[0].startswith(f"supervisor running  pid {pid} ")
        assert re.match(r"projector running +pid \d+ +restarts 0 +up \d+s +last exit -", status[1])
        child = _worker(settings, "projector")["pid"]
        assert {pid, child} <= _session_members(pid)
        # Stopped while projecting, not while faust is still starting its services (a SIGTERM
        # then can leave the projector hanging until the SIGKILL fallback: not what this tests).
        produce(settings, [e for op in Workload(seed=5).operations(20) for e in op])
        wait_caught_up(settings, timeout=60)
        started = time.monotonic()
        stack.stop_supervisor(settings, lines.append)
        took = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert lines[-1] == f"supervisor: stopped (pid {pid}) with its workers"
    assert took < supervisor.STOP_TIMEOUT_S, "stopped by SIGTERM, not by the SIGKILL fallback"
    assert _session_members(pid) == set(), "a process of the supervisor's session is left"
    final = _worker(settings, "projector")
    assert (final["state"], final["last_exit_code"]) == ("stopped", 0), "a clean SIGTERM exit"
    assert supervisor.status_lines(settings)[:2] == [
        "supervisor stopped  pid -       workers not running: `opledger stack up` starts them",
        "projector stopped   pid -",
    ]


def test_workers_die_with_a_sigkilled_supervisor(isolated: Settings, tmp_path: Path) -> None:
    settings = _own_home(isolated, tmp_path)
    with _supervisor(settings, tmp_path) as process:
        _wait(lambda: _worker(settings, "projector").get("state") == "running", 15, "started")
        child = _worker(settings, "projector")["pid"]
        assert _alive(child)
        process.send_signal(signal.SIGKILL)
        process.wait()
        # PR_SET_PDEATHSIG: the kernel kills the orphans; nothing else is left to do it. Each
        # worker gets its SIGKILL at once but takes its own time to tear down (unmapping a large
        # heap), so the whole session is waited for, not sampled once the projector is gone.
        _wait(lambda: not _alive(child), 10, "projector gone after its supervisor's SIGKILL")
        _wait(
            lambda: not _session_members(process.pid),
            10,
            "every worker gone after its supervisor's SIGKILL",
        )


#: A supervisor from an older opledger: it runs the projector only.
PROJECTOR_ONLY_SUPERVISOR = (
    "import sys; from opledger.supervisor import WorkerSpec, main, projector_healthz; "
    "sys.exit(main([WorkerSpec('projector', ('projector', 'run'), ready_url=projector_healthz)]))"
)


def test_up_sees_an_outdated_worker_list_and_restart_kills_one_worker(
    isolated: Settings, tmp_path: Path
) -> None:
    settings = _own_home(isolated, tmp_path)
    with _supervisor(settings, tmp_path, code=PROJECTOR_ONLY_SUPERVISOR):
        _wait(lambda: _serving(settings), 60, "projector serving /healthz")
        _wait(lambda: _worker(settings, "projector").get("pid"), 15, "status written")
        # What `stack up` restarts the supervisor for.
        assert workers_changed(settings) == "+recovery, +delivery, +fake-provider, +consumer"
        first = _worker(settings, "projector")["pid"]
        lines: list[str] = []
        assert stack.restart_worker(settings, "projector", lines.append, kill=True) == first
        second = _worker(settings, "projector")
        assert second["pid"] != first and second["last_exit_signal"] == "SIGKILL", second
        assert _serving(settings)
        assert lines[0] == f"projector: killed (pid {first}); the supervisor restarts it"
        assert lines[-1] == f"projector: running again (pid {second['pid']})"
