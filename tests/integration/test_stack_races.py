"""The stack launcher and the supervisor against what a shared machine does to them: pid files
naming other processes (recycled pids, another home's stack), two commands at once, a command
stopped by SIGTERM mid-start, ports taken by someone else, a home that cannot be written.

Nothing here touches the shared stack. Tests that need no servers use a home and ports of their
own with no broker or database behind them; the others share one private stack (its own home,
broker and PostgreSQL on free ports), which they stop and start as they please.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from ledger.settings import Settings
from opledger import stack, supervisor
from opledger.stack import workers
from tests.support import env_for, free_port, private_stack_settings

#: The shared stack's ports: a test that would use one of them must not run.
SHARED_PORTS = {19092, 19093, 15432, 16066, 16067, 16068, 16069, 16077}

#: A supervisor of the fake provider alone: a real worker that needs no broker or database.
FAKE_PROVIDER_SUPERVISOR = (
    "import sys; from opledger.supervisor import WorkerSpec, main, fake_provider_health; "
    "sys.exit(main([WorkerSpec('fake-provider', ('fake-provider', 'run'), "
    "ready_url=fake_provider_health)]))"
)


def _own_settings(home: Path) -> Settings:
    settings = private_stack_settings(Settings.from_env(), home).with_(
        topic_prefix=f"r{uuid4().hex[:10]}",
        projector_web_port=free_port(),
        recovery_web_port=free_port(),
        delivery_web_port=free_port(),
        consumer_web_port=free_port(),
        fake_provider_url=f"http://127.0.0.1:{free_port()}",
    )
    used = {
        settings.kafka_port,
        settings.kafka_controller_port,
        settings.pg_port,
        settings.projector_web_port,
        settings.recovery_web_port,
        settings.delivery_web_port,
        settings.consumer_web_port,
    }
    assert not used & SHARED_PORTS and home != Settings.from_env().home
    return settings


def _cli_env(settings: Settings) -> dict[str, str]:
    """The environment of an `opledger stack` command for these settings: env_for's, plus the
    servers' own ports (env_for gives clients an address, not a server its port)."""
    return env_for(
        settings,
        OPLEDGER_KAFKA_PORT=str(settings.kafka_port),
        OPLEDGER_KAFKA_CONTROLLER_PORT=str(settings.kafka_controller_port),
        OPLEDGER_PG_PORT=str(settings.pg_port),
        PYTHONUNBUFFERED="1",
    )


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def _bystander(argv: list[str], user: str | None = None) -> Iterator[int]:
    """An unrelated process (what a recycled pid belongs to); never outlives the test."""
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, user=user)
    try:
        _wait(lambda: Path(f"/proc/{process.pid}/cmdline").read_bytes(), 5, "bystander execs")
        yield process.pid
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def _fake_provider_supervisor(settings: Settings, log: Path) -> Iterator[int]:
    """A real supervisor for ``settings.home`` running the fake provider; never outlives the
    test (its whole session is SIGKILLed)."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", FAKE_PROVIDER_SUPERVISOR],
            env=env_for(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait(lambda: _worker(settings).get("state") == "running", 30, "fake provider started")
        _wait(lambda: workers._answers(supervisor.fake_provider_health(settings)), 30, "serving")
        yield process.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _worker(settings: Settings, name: str = "fake-provider") -> dict[str, Any]:
    worker: dict[str, Any] = supervisor.read_status(settings).get("workers", {}).get(name, {})
    return worker


# ---------------------------------------------------------------------------------------------
# no servers needed


def test_pid_files_naming_unrelated_processes_are_not_ours(tmp_path: Path) -> None:
    """A recycled pid in each pid file, belonging to a process whose command line even looks
    like ours: `status` reports nothing as ours and `down` signals none of them."""
    settings = _own_settings(tmp_path / "home")
    run = supervisor.run_dir(settings)
    (settings.home / "postgres").mkdir(parents=True)
    run.mkdir(parents=True)
    with (
        _bystander(["bash", "-c", "exec -a opledger.supervisor sleep 1000"]) as fake_supervisor,
        _bystander(
            [sys.executable, "-c", "import time; time.sleep(1000)", "kafka.Kafka"]
        ) as fake_kafka,
        _bystander(["sleep", "1000"]) as fake_postmaster,
    ):
        supervisor.pid_file(settings).write_text(f"{fake_supervisor}\n")
        (run / "kafka.pid").write_text(f"{fake_kafka}\n")
        (settings.home / "postgres" / "postmaster.pid").write_text(
            f"{fake_postmaster}\n{settings.home / 'postgres'}\n"
        )
        lines: list[str] = []
        assert not stack.status(settings, echo=lines.append)
        assert lines[0].startswith("kafka     stopped   pid -"), lines
        assert lines[1].startswith("postgres  stopped   pid -"), lines
        assert lines[2].startswith("supervisor stopped  pid -"), lines
        down: list[str] = []
        stack.down(settings, echo=down.append)
        assert down == ["supervisor: not running", "kafka: not running", "postgres: not running"]
        for pid in (fake_supervisor, fake_kafka, fake_postmaster):
            assert supervisor.alive(pid), f"pid {pid} was signalled"


def test_another_homes_supervisor_and_workers_are_not_ours(tmp_path: Path) -> None:
    """A home whose run/ was copied from a running one (or whose stale files name another
    stack's live supervisor): `restart` and `down` there leave the other stack alone."""
    mine = _own_settings(tmp_path / "mine")
    theirs = _own_settings(tmp_path / "theirs")
    with _fake_provider_supervisor(theirs, tmp_path / "theirs.out") as their_supervisor:
        their_worker = _worker(theirs)["pid"]
        supervisor.run_dir(mine).mkdir(parents=True)
        for source in (supervisor.pid_file(theirs), supervisor.status_file(theirs)):
            shutil.copy2(source, supervisor.run_dir(mine) / source.name)

        assert supervisor.supervisor_pid(mine) is None
        assert supervisor.status_lines(mine)[0].startswith("supervisor stopped")
        with pytest.raises(stack.StackError, match="the supervisor is not running"):
            stack.restart_worker(mine, "fake-provider", echo=lambda _line: None, wait=False)
        stack.down(mine, echo=lambda _line: None)

        assert supervisor.alive(their_supervisor) and supervisor.alive(their_worker)
        assert supervisor.supervisor_pid(theirs) == their_supervisor
        assert (_worker(theirs)["pid"], _worker(theirs)["restarts"]) == (their_worker, 0)


def test_a_worker_pid_in_the_status_file_must_be_a_child_of_our_supervisor(
    tmp_path: Path,
) -> None:
    """A status file may name any process running `opledger.cli` (another home's worker):
    only a child of our supervisor is our worker. This test's own child stands in for one."""
    settings = _own_settings(tmp_path / "home")
    supervisor.run_dir(settings).mkdir(parents=True)
    with _bystander([sys.executable, "-c", "import time; time.sleep(1000)", "opledger.cli"]) as pid:
        status = {"supervisor": {"pid": 1}, "workers": {"projector": {"pid": pid}}}
        supervisor.status_file(settings).write_text(json.dumps(status))
        assert supervisor.worker_pid(settings, "projector", parent=os.getpid()) == pid
        assert supervisor.worker_pid(settings, "projector", parent=1) is None


def test_a_hand_edited_status_file_is_rewritten_by_the_supervisor(tmp_path: Path) -> None:
    settings = _own_settings(tmp_path / "home")
    with _fake_provider_supervisor(settings, tmp_path / "supervisor.out"):
        worker = _worker(settings)["pid"]
        supervisor.status_file(settings).write_text('{"supervisor": 1, "workers": [')
        _wait(lambda: _worker(settings).get("pid") == worker, 10, "status file rewritten")
        assert supervisor.status_lines(settings)[1].startswith(
            f"fake-provider running   pid {worker}"
        )
        supervisor.status_file(settings).unlink()
        _wait(lambda: _worker(settings).get("pid") == worker, 10, "status file rewritten")


def test_two_restarts_of_one_worker_at_once_are_two_restarts(tmp_path: Path) -> None:
    """Before they were serialised both stopped the same process: one restart for two asked."""
    settings = _own_settings(tmp_path / "home")
    with _fake_provider_supervisor(settings, tmp_path / "supervisor.out"):
        barrier = threading.Barrier(2)
        stopped: list[int] = []
        said: list[str] = []
        errors: list[BaseException] = []

        def restart() -> None:
            barrier.wait()
            try:
                stopped.append(stack.restart_worker(settings, "fake-provider", echo=said.append))
            except BaseException as exc:  # reported below, with the other thread's outcome
                errors.append(exc)

        threads = [threading.Thread(target=restart) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert errors == []
        assert len(set(stopped)) == 2, f"both restarts stopped pid {stopped}"
        assert _worker(settings)["restarts"] == 2
        # Both threads are this process: the one that waited names it as the holder.
        waiting = f"waiting for `opledger stack` (pid {os.getpid()}: "
        assert [line for line in said if line.startswith(waiting)], said
        assert any(line.endswith(" before `stack restart fake-provider`") for line in said)


def test_a_home_under_a_regular_file_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    settings = _own_settings(tmp_path / "file" / "home")
    done = subprocess.run(
        [sys.executable, "-m", "opledger.cli", "stack", "up", "--no-workers"],
        env=_cli_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"opledger: cannot write {settings.home} (Not a directory): ")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------
# on a private stack


@pytest.fixture(scope="module")
def own_stack() -> Iterator[Settings]:
    """A broker and a PostgreSQL of this module's own, without workers; the tests may stop
    them, and each leaves them running for the next. One at a time on this machine (a broker
    and a database cost a core while starting): an xdist worker waits for the other's."""
    with Path(tempfile.gettempdir(), "opledger-test-stack-races.lock").open("w") as one_at_a_time:
        fcntl.flock(one_at_a_time, fcntl.LOCK_EX)
        # Not under pytest's tmp_path: that is root's 0700 directory, and as root the
        # PostgreSQL server runs as an unprivileged user who must reach its data directory.
        base = Path(tempfile.mkdtemp(prefix="opledger-races-"))
        settings = _own_settings(base / "home")
        try:
            base.chmod(0o755)
            # The jars Maven resolved for the shared stack are read, never changed.
            version = f"kafka-{settings.kafka_version}"
            shared = Settings.from_env().home / version
            if not (shared / "jars.complete").is_file():
                pytest.skip(f"no Kafka jars in {shared}: run `opledger stack up` once")
            (settings.home / version).mkdir(parents=True)
            (settings.home / version / "libs").symlink_to(shared / "libs")
            shutil.copy2(shared / "jars.complete", settings.home / version / "jars.complete")
            stack.up(settings, echo=lambda _line: None, workers=False)
            yield settings
        finally:
            stack.down(settings, echo=lambda _line: None)
            shutil.rmtree(base, ignore_errors=True)


def _brokers(settings: Settings) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and supervisor.owned(int(entry.name), b"kafka.Kafka", settings.home)
    ]


def test_up_after_a_sigterm_mid_start_adopts_the_broker_it_was_starting(
    own_stack: Settings,
) -> None:
    stack.down(own_stack, echo=lambda _line: None)
    first = subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", "stack", "up", "--no-workers"],
        env=_cli_env(own_stack),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert first.stdout is not None
    for line in first.stdout:
        if line.startswith("kafka: starting (pid "):
            broker = int(line.split("pid ")[1].split(")")[0])
            break
    else:
        pytest.fail(f"`stack up` never started the broker: {first.communicate()}")
    first.send_signal(signal.SIGTERM)
    _out, err = first.communicate(timeout=30)
    assert first.returncode == 128 + 15, err
    assert "stack up stopped by SIGTERM; what it started keeps running" in err

    lines: list[str] = []
    stack.up(own_stack, echo=lines.append, workers=False)
    assert f"kafka: waiting for the broker already starting (pid {broker})" in lines, lines
    assert _brokers(own_stack) == [broker]
    assert stack.kafka_pid(own_stack) == broker


def test_a_postmaster_pid_naming_another_process_does_not_stop_up(own_stack: Settings) -> None:
    """After a crash and a reboot, postmaster.pid can name any process: `status` must not call
    it ours, `down` must not signal it (pg_ctl would), and PostgreSQL refuses to start beside
    it when it is of the server's own user, as this one is."""
    stack.down(own_stack, echo=lambda _line: None)
    postmaster = own_stack.home / "postgres" / "postmaster.pid"
    server_user = stack.PG_USER if os.geteuid() == 0 else None
    with _bystander(["sleep", "1000"], user=server_user) as bystander:
        postmaster.write_text(f"{bystander}\n{own_stack.home / 'postgres'}\n")
        lines: list[str] = []
        stack.status(own_stack, echo=lines.append)
        assert lines[1].startswith("postgres  stopped   pid -"), lines
        stack.down(own_stack, echo=lambda _line: None)
        assert supervisor.alive(bystander), "`down` signalled it"
        started = time.monotonic()
        up: list[str] = []
        stack.up(own_stack, echo=up.append, workers=False)
        assert time.monotonic() - started < stack.PG_START_TIMEOUT
        assert (
            f"postgres: removed a stale postmaster.pid naming pid {bystander}, now another process"
            in up
        )
        assert supervisor.alive(bystander)
        assert stack.postgres_pid(own_stack) not in (None, bystander)


def test_a_worker_port_taken_by_someone_else_is_refused_before_any_worker_starts(
    own_stack: Settings,
) -> None:
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", own_stack.projector_web_port))
        foreign.listen()
        done = subprocess.run(
            [sys.executable, "-m", "opledger.cli", "stack", "up"],
            env=_cli_env(own_stack),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    try:
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert done.stderr == (
            f"opledger: 127.0.0.1:{own_stack.projector_web_port} is in use by a process this "
            "stack's supervisor did not start (`ss -ltnp 'sport = :"
            f"{own_stack.projector_web_port}'` names it): stop it or choose another port with "
            "OPLEDGER_PROJECTOR_WEB_PORT\n"
        )
        assert supervisor.supervisor_pid(own_stack) is None
    finally:
        stack.stop_supervisor(own_stack, echo=lambda _line: None)


@pytest.mark.skipif(os.geteuid() != 0, reason="the data directory changes owner only as root")
def test_a_symlink_planted_in_the_data_directory_is_not_written_through(
    own_stack: Settings, tmp_path: Path
) -> None:
    """As root, the data directory belongs to the unprivileged PostgreSQL user: a link it plants
    there must not make `up` write (and chown to it) a file of root's."""
    stack.down(own_stack, echo=lambda _line: None)
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    conf = own_stack.home / "postgres" / "opledger.conf"
    conf.unlink()
    conf.symlink_to(victim)
    stack.up(own_stack, echo=lambda _line: None, workers=False)
    assert victim.read_text() == "root's\n"
    assert (victim.stat().st_uid, victim.stat().st_mode & 0o777) == (0, 0o600)
    assert not conf.is_symlink() and f"port = {own_stack.pg_port}" in conf.read_text()
