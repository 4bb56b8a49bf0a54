"""The local stack: one KRaft Kafka broker and one PostgreSQL server, on 127.0.0.1 only, and
the supervisor that keeps the workers (the projector) running on them.

Everything lives under ``settings.home`` (outside the git tree): the broker's jars (resolved
once by Maven), its data, PostgreSQL's cluster, pid files and logs. ``up`` is idempotent and
cheap when the stack already runs, so tests and ``make`` targets call it freely.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ledger import pg
from ledger.display import displayable
from ledger.log import new_admin, new_producer
from ledger.secrets import scrub
from ledger.settings import Settings
from ledger.topics import TopicError, ensure_topics, min_insync_replicas
from opledger import db, supervisor

Echo = Callable[[str], None]

PG_USER = "opledger"
PG_DATABASE = "opledger"
KAFKA_HEAP = "-Xmx1g"
KAFKA_START_TIMEOUT = 120.0
KAFKA_STOP_TIMEOUT = 30.0
PG_START_TIMEOUT = 60
SUPERVISOR_START_TIMEOUT = 15.0
#: The supervisor gives its workers STOP_TIMEOUT_S after SIGTERM; this adds its own exit.
SUPERVISOR_STOP_TIMEOUT = supervisor.STOP_TIMEOUT_S + 10.0
#: How long `up` waits for a worker's ready URL (the projector needs a few seconds to serve).
WORKERS_READY_TIMEOUT = 60.0


class StackError(RuntimeError):
    """The stack cannot be brought up or down; the message says how to fix it."""


class StackInterruptedError(StackError):
    """A stack command was stopped by SIGTERM; what it had started keeps running."""


@contextlib.contextmanager
def sigterm_interrupts(what: str) -> Iterator[None]:
    """SIGTERM raises :class:`StackInterruptedError` inside: the command stops where it is, the
    child it waits for (mvn, initdb, pg_ctl) is killed with it by ``subprocess.run``, and the
    caller says what was left. What it started is tracked (pid files, or found in /proc by
    its working directory), so the next ``up`` finishes the job and ``down`` stops it.

    A C extension running when the signal lands may turn the handler's exception into its own
    (confluent-kafka's AdminClient reports it as ``TypeError: expected configuration property
    name``), so whatever escapes after a SIGTERM is reported as the interruption it was."""
    message = (
        f"stack {what} stopped by SIGTERM; what it started keeps running: "
        "`opledger stack up` finishes the start, `opledger stack down` stops it"
    )
    received = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        received.set()
        raise StackInterruptedError(message)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except StackInterruptedError:
        raise
    except BaseException as exc:
        if received.is_set():
            raise StackInterruptedError(message) from exc
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------
# paths


def _libs_dir(settings: Settings) -> Path:
    return settings.home / f"kafka-{settings.kafka_version}" / "libs"


def _jars_marker(settings: Settings) -> Path:
    # Written only after Maven succeeded, so an interrupted download is retried, not trusted.
    return settings.home / f"kafka-{settings.kafka_version}" / "jars.complete"


def _kafka_data(settings: Settings) -> Path:
    return settings.home / "kafka-data"


def _kafka_conf(settings: Settings) -> Path:
    return settings.home / "kafka-conf"


def _pg_data(settings: Settings) -> Path:
    return settings.home / "postgres"


def _pg_socket_dir(settings: Settings) -> Path:
    return settings.home / "pg-socket"


def _run_dir(settings: Settings) -> Path:
    return supervisor.run_dir(settings)


def _kafka_pid_file(settings: Settings) -> Path:
    return _run_dir(settings) / "kafka.pid"


def log_files(settings: Settings) -> dict[str, Path]:
    """The logs worth reading when something fails, by component."""
    logs = settings.home / "logs"
    return {
        "kafka": logs / "kafka.log",
        "kafka-stdout": logs / "kafka.out",
        "postgres": logs / "postgres.log",
        "supervisor": supervisor.supervisor_log(settings),
        **{spec.name: supervisor.worker_log(settings, spec.name) for spec in supervisor.WORKERS},
    }


def _kafka_resources() -> Path:
    # A checkout has kafka/ next to opledger/; a wheel force-includes it as opledger/kafka.
    here = Path(__file__).resolve()
    for candidate in (here.parents[1] / "kafka", here.parent / "kafka"):
        if (candidate / "pom.xml").is_file():
            return candidate
    raise StackError("kafka/pom.xml not found next to the opledger package: reinstall opledger")


# ---------------------------------------------------------------------------------------------
# tools


def find_java(path: str | None = None) -> str:
    """The ``java`` executable (17+); ``path`` replaces $PATH for the lookup (tests use it)."""
    java = shutil.which("java", path=path)
    if java is None:
        raise StackError(
            "java not found: install a JDK 17+ (apt-get install openjdk-17-jre-headless) "
            "or put it on PATH"
        )
    version = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)', version.stderr)
    if match and int(match.group(1)) < 17:
        raise StackError(
            f"{java} is Java {match.group(1)} but Kafka needs 17+: install "
            "openjdk-17-jre-headless or put a newer java first on PATH"
        )
    return java


def find_mvn(path: str | None = None) -> str:
    """The ``mvn`` executable; ``path`` replaces $PATH for the lookup (tests use it)."""
    mvn = shutil.which("mvn", path=path)
    if mvn is None:
        raise StackError(
            "mvn not found: install Maven (apt-get install maven) or put it on PATH; "
            "it downloads the Kafka jars once"
        )
    return mvn


def _is_root() -> bool:
    return os.geteuid() == 0


def _as_pg_user(argv: Sequence[str]) -> list[str]:
    # PostgreSQL refuses to run as root, so as root every server command runs as PG_USER.
    return ["runuser", "-u", PG_USER, "--", *argv] if _is_root() else list(argv)


def _run(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, cwd=cwd)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()[-3000:]
        raise StackError(f"{what} failed (exit {result.returncode}): {output}")
    return result.stdout


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        if sock.connect_ex(("127.0.0.1", port)) != 0:
            return False
        # A port inside the ephemeral range can "answer" by TCP simultaneous open: the
        # kernel hands this very socket the port it dials and it connects to itself.
        return bool(sock.getsockname() != sock.getpeername())


#: A log line longer than this is shown cut: scrubbing costs more than linearly in its length.
TAIL_LINE_MAX = 2000


def _tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log, safe to print: a log file can hold anything (a
    process's stray output, a line written by hand), so secrets are scrubbed and characters a
    terminal would act on (escape sequences, carriage returns) are shown escaped."""
    try:
        with path.open("rb") as log:
            # Only the end is read: a server's log grows to gigabytes.
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - (lines + 1) * 4 * TAIL_LINE_MAX))
            text = log.read().decode(errors="replace")
    except OSError:
        return f"({path} not readable)"
    # Split on newlines only: a carriage return must not start a line of its own (a forged
    # line); it is shown escaped instead.
    shown = text.split("\n")
    if shown and shown[-1] == "":
        shown.pop()
    if lines <= 0:
        return ""
    return "\n".join(displayable(scrub(_cut(line))) for line in shown[-lines:])


def _cut(line: str) -> str:
    return line if len(line) <= TAIL_LINE_MAX else line[:TAIL_LINE_MAX] + " [cut]"


def _lock_path(settings: Settings) -> Path:
    return settings.home / ".stack.lock"


@contextlib.contextmanager
def _locked(settings: Settings, what: str, echo: Echo = print) -> Iterator[None]:
    """One stack command at a time per home: several pytest sessions and make targets call
    `up` at once, and `down` or `restart` during an `up` would stop what it is starting. The
    others wait, told which process they wait for."""
    _prepare_home(settings)
    try:
        fd = os.open(_lock_path(settings), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise StackError(_home_error(settings, exc)) from None
    with os.fdopen(fd, "r+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(
                f"waiting for `opledger stack` ({_lock_holder(lock.fileno())}) to finish with "
                f"{settings.home} before `stack {what}`"
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_holder(fd: int) -> str:
    """``pid N: its command line`` of the process holding the flock on ``fd``, from the
    kernel's own table (a file the holder writes would be read before it is written)."""
    found = os.fstat(fd)
    wanted = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    for line in table:
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:00:5678 0 EOF"; a waiter's line has "->" second.
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted:
            argv = supervisor.argv_of(int(fields[4])) or []
            command = b" ".join(argv).decode(errors="replace")[:200]
            return displayable(f"pid {fields[4]}: {command}" if command else f"pid {fields[4]}")
    return "another process"


def _prepare_home(settings: Settings) -> None:
    try:
        for directory in (settings.home, settings.home / "logs", _run_dir(settings)):
            directory.mkdir(parents=True, exist_ok=True)
        if _is_root():
            # The unprivileged PostgreSQL user must traverse home to reach its own directories.
            settings.home.chmod(0o755)
    except OSError as exc:
        raise StackError(_home_error(settings, exc)) from None


def _home_error(settings: Settings, exc: OSError) -> str:
    return describe_os_error(exc, settings.home)


#: Errors that say the disk holding OPLEDGER_HOME cannot take what the stack writes.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def describe_os_error(exc: OSError, home: Path) -> str:
    """One sentence for a file operation under OPLEDGER_HOME that failed: what, and the fix."""
    where = exc.filename or home
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the disk holding {home} or point OPLEDGER_HOME at another disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = (
            f"make {home} writable by uid {os.geteuid()} or point OPLEDGER_HOME at a "
            "directory that is"
        )
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.ELOOP):
        fix = f"OPLEDGER_HOME ({home}) must be a directory path with no file or symlink in the way"
    else:
        fix = f"check {home} and point OPLEDGER_HOME elsewhere if it cannot be used"
    return f"cannot write {where} ({reason}): {fix}"


# ---------------------------------------------------------------------------------------------
# Kafka


def ensure_kafka_jars(settings: Settings, echo: Echo = print) -> Path:
    """Resolve the broker's jars with Maven once per Kafka version; return the libs dir."""
    libs, marker = _libs_dir(settings), _jars_marker(settings)
    if marker.is_file() and libs.is_dir():
        return libs
    mvn = find_mvn()
    work = libs.parent
    work.mkdir(parents=True, exist_ok=True)
    # Maven writes target/ next to the pom: give it a copy in the cache, not the source tree.
    shutil.copy2(_kafka_resources() / "pom.xml", work / "pom.xml")
    partial = work / "libs.partial"
    shutil.rmtree(partial, ignore_errors=True)
    echo(f"downloading Kafka {settings.kafka_version} jars with Maven (once) into {libs}")
    _run(
        [
            mvn,
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={partial}",
            "-DincludeScope=runtime",
            f"-Dkafka.version={settings.kafka_version}",
        ],
        "mvn dependency:copy-dependencies",
        cwd=work,
    )
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    marker.write_text(f"{len(list(libs.glob('*.jar')))} jars\n")
    return libs


def kraft_properties(
    *,
    node_id: int,
    port: int,
    controller_port: int,
    voters: str,
    log_dir: Path,
    replication: int = 1,
) -> dict[str, str]:
    """``server.properties`` of one combined broker and controller on 127.0.0.1: the local
    stack's single node, or one of the nodes of ``tests/cluster_support.py``'s cluster.
    ``voters`` is ``controller.quorum.voters`` (``id@host:port,...``); ``replication`` the
    replicas of the broker's internal topics (consumer offsets, transaction state)."""
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        "offsets.topic.replication.factor": str(replication),
        "transaction.state.log.replication.factor": str(replication),
        "transaction.state.log.min.isr": str(min_insync_replicas(replication)),
        # Topics are created explicitly (ledger.topics) with their partitions and retention.
        "auto.create.topics.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
    }


def write_properties(path: Path, properties: Mapping[str, str]) -> Path:
    """``properties`` as a Java properties file at ``path``."""
    path.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
    return path


def _write_kafka_config(settings: Settings) -> Path:
    conf = _kafka_conf(settings)
    conf.mkdir(parents=True, exist_ok=True)
    c = settings.kafka_controller_port
    properties = kraft_properties(
        node_id=1,
        port=settings.kafka_port,
        controller_port=c,
        voters=f"1@127.0.0.1:{c}",
        log_dir=_kafka_data(settings),
    )
    return write_properties(conf / "server.properties", properties)


def random_cluster_id() -> str:
    """A new KRaft cluster id, as ``kafka-storage random-uuid`` prints one, minus a JVM."""
    # Kafka's Uuid.randomUuid(): url-safe base64 of 16 random bytes, never starting with "-"
    # (it would read as a command-line flag).
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def format_kafka_storage(java: str, libs: Path, config: Path, cluster_id: str) -> None:
    """``kafka-storage format``: the log dirs of the node ``config`` describes, for
    ``cluster_id`` (every node of one cluster gets the same id)."""
    _run(
        [
            java,
            "-cp",
            f"{libs}/*",
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster_id,
            "-c",
            str(config),
        ],
        "kafka storage format",
    )


def _format_kafka(settings: Settings, java: str, libs: Path, config: Path) -> None:
    if (_kafka_data(settings) / "meta.properties").is_file():
        return
    format_kafka_storage(java, libs, config, random_cluster_id())


def kafka_command(
    java: str, libs: Path, config: Path, log: Path, heap: str = KAFKA_HEAP
) -> list[str]:
    """The command line of a broker started from ``libs`` with ``config``, logging to ``log``
    (quiet but for start and stop: ``kafka/log4j2.yaml``)."""
    return [
        java,
        heap,
        "-Xms256m",
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={_kafka_resources() / 'log4j2.yaml'}",
        f"-Dopledger.kafka.log={log}",
        "-cp",
        f"{libs}/*",
        "kafka.Kafka",
        str(config),
    ]


def kafka_pid(settings: Settings) -> int | None:
    """Pid of the broker this stack started, if it is still alive (the broker runs in home:
    a recycled pid or another home's broker is not ours)."""
    hint = supervisor.read_pid(_kafka_pid_file(settings))
    return supervisor.find_owned(b"kafka.Kafka", settings.home, hint)


def kafka_healthy(settings: Settings, timeout: float = 5.0) -> bool:
    """Whether a broker answers a metadata request on ``settings.bootstrap_servers``."""
    if not settings.kafka_bootstrap and not _port_open(settings.kafka_port):
        return False
    # log_level 0: librdkafka would otherwise print connection errors while we poll.
    admin = new_admin(settings, client_id="opledger-stack", overrides={"log_level": 0})
    try:
        admin.list_topics(timeout=timeout)
    except Exception:  # any failure here just means "not healthy yet"
        return False
    return True


def _start_kafka(settings: Settings, echo: Echo) -> None:
    starting = kafka_pid(settings)
    if starting is not None:
        # Ours but not healthy yet: an `up` stopped mid-start left it starting. A second
        # broker on the same data would fight it for the ports and the log dirs.
        _kafka_pid_file(settings).write_text(f"{starting}\n")
        echo(f"kafka: waiting for the broker already starting (pid {starting})")
        _wait_kafka(settings, starting)
        _wait_producer_ids(settings)
        return
    java = find_java()
    libs = ensure_kafka_jars(settings, echo)
    for port in (settings.kafka_port, settings.kafka_controller_port):
        if _port_open(port):
            raise StackError(
                f"127.0.0.1:{port} is in use by a process opledger did not start: stop it "
                "or choose other ports with OPLEDGER_KAFKA_PORT / OPLEDGER_KAFKA_CONTROLLER_PORT"
            )
    config = _write_kafka_config(settings)
    _format_kafka(settings, java, libs, config)
    logs = log_files(settings)
    argv = kafka_command(java, libs, config, logs["kafka"])
    with logs["kafka-stdout"].open("ab") as out:
        # A session of its own: the broker must outlive this command and ignore its Ctrl-C.
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=settings.home,
        )
    _kafka_pid_file(settings).write_text(f"{process.pid}\n")
    echo(f"kafka: starting (pid {process.pid}) on 127.0.0.1:{settings.kafka_port}")
    _wait_kafka(settings, process.pid, process)
    _wait_producer_ids(settings)


def _wait_kafka(
    settings: Settings, pid: int, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + KAFKA_START_TIMEOUT
    while time.monotonic() < deadline:
        exited = process.poll() if process is not None else None
        if exited is not None or not supervisor.alive(pid):
            raise StackError(
                f"kafka exited (code {exited if exited is not None else '?'}) during start-up; "
                "last log lines:\n" + _kafka_log_tails(settings)
            )
        if kafka_healthy(settings, timeout=2.0):
            return
        time.sleep(0.5)
    raise StackError(
        f"kafka not healthy after {KAFKA_START_TIMEOUT:.0f}s (pid {pid}); "
        "last log lines:\n" + _kafka_log_tails(settings)
    )


def _wait_producer_ids(settings: Settings, timeout: float = 60.0) -> None:
    """Wait until the broker hands out idempotent-producer ids.

    Right after start the broker answers metadata while its transaction coordinator is still
    loading; the first idempotent producers (every SDK client) would then log "Coordinator load
    in progress" warnings and retry. An idempotent producer that writes nothing, watched through
    librdkafka's statistics, tells when an id has been assigned.
    """
    assigned = threading.Event()

    def on_stats(raw: str) -> None:
        if json.loads(raw).get("eos", {}).get("idemp_state") == "Assigned":
            assigned.set()

    probe = new_producer(
        settings,
        client_id="opledger-stack-probe",
        overrides={
            "statistics.interval.ms": 100,
            "stats_cb": on_stats,
            "log_level": 0,  # the retries this waits out are expected; keep them quiet
        },
    )
    deadline = time.monotonic() + timeout
    while not assigned.is_set():
        if time.monotonic() > deadline:
            raise StackError(
                f"kafka did not assign a producer id within {timeout:.0f}s; last log lines:\n"
                + _kafka_log_tails(settings)
            )
        probe.poll(0.1)
    probe.flush(1)


def _kafka_log_tails(settings: Settings) -> str:
    logs = log_files(settings)
    return _tail(logs["kafka"]) + "\n--- stdout ---\n" + _tail(logs["kafka-stdout"], 15)


def _stop_kafka(settings: Settings, echo: Echo) -> None:
    pid = kafka_pid(settings)
    if pid is None:
        echo("kafka: not running")
        _kafka_pid_file(settings).unlink(missing_ok=True)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    # SIGTERM triggers a controlled shutdown that flushes the logs; give it a while.
    deadline = time.monotonic() + KAFKA_STOP_TIMEOUT
    while time.monotonic() < deadline and supervisor.alive(pid):
        time.sleep(0.2)
    if supervisor.alive(pid):
        echo(f"kafka: no exit {KAFKA_STOP_TIMEOUT:.0f}s after SIGTERM, sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while supervisor.alive(pid):
            time.sleep(0.1)
    _wait_ports_closed(settings)
    _kafka_pid_file(settings).unlink(missing_ok=True)
    echo(f"kafka: stopped (pid {pid})")


def _wait_ports_closed(settings: Settings, timeout: float = 10.0) -> None:
    """Until the broker's ports no longer answer: a killed JVM's main thread is reaped (a
    zombie) while its other threads still close its sockets, so for a moment after it looks
    dead its listener still accepts, and a start would take that for someone else's broker."""
    deadline = time.monotonic() + timeout
    ports = (settings.kafka_port, settings.kafka_controller_port)
    while any(_port_open(port) for port in ports) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# PostgreSQL


def find_pg_bindir(path: str | None = None) -> Path | None:
    """Directory of the newest PostgreSQL server binaries installed, if any."""

    def version(bindir: Path) -> int:
        return int(bindir.parent.name) if bindir.parent.name.isdigit() else 0

    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    pg_config = shutil.which("pg_config", path=path)
    if pg_config:
        result = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            candidates.append(Path(result.stdout.strip()))
    for bindir in candidates:
        if all((bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def _ensure_pg_bindir(echo: Echo) -> Path:
    bindir = find_pg_bindir()
    if bindir is not None:
        return bindir
    if not _is_root():
        raise StackError(
            "PostgreSQL server not found: install it (sudo apt-get install postgresql) "
            "or put its bin directory (with initdb and pg_ctl) on PATH"
        )
    echo("postgres: server not installed, running apt-get install postgresql")
    # `env` sets the variable for apt without this module touching os.environ. The package may
    # start Debian's own cluster on 5432; it is harmless to us, we run our own on pg_port.
    _run(["apt-get", "update"], "apt-get update")
    _run(
        ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "postgresql"],
        "apt-get install postgresql",
    )
    bindir = find_pg_bindir()
    if bindir is None:
        raise StackError("apt-get installed postgresql but no initdb/pg_ctl was found")
    return bindir


def _ensure_pg_user() -> None:
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        _run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            f"useradd {PG_USER}",
        )


def _own(path: Path) -> None:
    if _is_root():
        entry = pwd.getpwnam(PG_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _prepare_pg_paths(settings: Settings) -> None:
    if _is_root():
        _ensure_pg_user()
    for directory, mode in ((_pg_data(settings), 0o700), (_pg_socket_dir(settings), 0o755)):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(mode)
        _own(directory)
    log = log_files(settings)["postgres"]
    log.touch()
    _own(log)


def _pg_config_text(settings: Settings) -> str:
    # Durability settings stay at their safe values on purpose: the ledger claims durability,
    # and tests that pass on fsync=off would prove nothing about it.
    lines = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(settings.pg_port),
        "unix_socket_directories": f"'{_pg_socket_dir(settings)}'",
        "max_connections": "100",
        "shared_buffers": "'256MB'",
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "wal_level": "replica",
    }
    header = "# written by `opledger stack up` on every start; edit Settings, not this file\n"
    return header + "".join(f"{key} = {value}\n" for key, value in lines.items())


def _init_pg(settings: Settings, bindir: Path) -> None:
    data = _pg_data(settings)
    if not (data / "PG_VERSION").is_file():
        _run(
            _as_pg_user(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    PG_USER,
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                ]
            ),
            "initdb",
            cwd=settings.home,
        )
        conf = os.open(data / "postgresql.conf", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        with os.fdopen(conf, "a") as out:
            out.write("\ninclude_if_exists = 'opledger.conf'\n")
    _write_pg_owned(data / "opledger.conf", _pg_config_text(settings))


def _write_pg_owned(path: Path, text: str) -> None:
    """Replace ``path`` in the data directory with ``text``, owned by PG_USER.

    The data directory belongs to PG_USER, so as root anything in it may have been replaced by
    a symlink (say, to /etc/passwd): writing or chowning through it would hand that file to
    PG_USER; :func:`supervisor.write_atomically` renames a new file over the name instead.
    """
    owner = None
    if _is_root():
        entry = pwd.getpwnam(PG_USER)
        owner = (entry.pw_uid, entry.pw_gid)
    supervisor.write_atomically(path, text, owner)


def _postmaster_file(settings: Settings) -> Path:
    return _pg_data(settings) / "postmaster.pid"


def _is_postmaster(pid: int, data: Path) -> bool | None:
    """Whether ``pid`` is a PostgreSQL server of ``data``: it moves into its data directory
    before it writes postmaster.pid. None when this user may not inspect the process."""
    argv = supervisor.argv_of(pid)
    if argv is None:
        return False
    inside = supervisor.runs_in(pid, data)
    if inside is None:
        return None
    return inside and Path(argv[0].decode(errors="replace")).name == "postgres"


def postgres_pid(settings: Settings) -> int | None:
    """Pid of the postmaster serving our data directory, if it is alive (postmaster.pid can
    outlive its server, and after a crash or a reboot name some other process)."""
    pid = supervisor.read_pid(_postmaster_file(settings))
    if pid is None or _is_postmaster(pid, _pg_data(settings)) is False:
        return None
    return pid


def _clear_stale_postmaster_pid(settings: Settings, echo: Echo) -> None:
    """Remove a postmaster.pid naming a live process that is not our server, which PostgreSQL
    would take for another postmaster and refuse to start beside (it handles a dead pid)."""
    path = _postmaster_file(settings)
    pid = supervisor.read_pid(path)
    if pid is None or not supervisor.alive(pid):
        return
    if _is_postmaster(pid, _pg_data(settings)) is None:
        raise StackError(
            f"{path} names pid {pid}, which this user may not inspect: stop that process if it "
            f"is PostgreSQL serving {_pg_data(settings)}, else remove {path}"
        )
    if _port_open(settings.pg_port):
        return  # the port check that follows names the problem
    path.unlink(missing_ok=True)
    echo(f"postgres: removed a stale {path.name} naming pid {pid}, now another process")


#: How the launcher's own sessions are named in pg_stat_activity.
_PG_SESSION = "opledger-stack"


def _admin_dsn(settings: Settings) -> str:
    return f"postgresql://{PG_USER}@127.0.0.1:{settings.pg_port}/postgres"


def postgres_version(settings: Settings) -> str | None:
    """Server version when our PostgreSQL accepts connections, else None."""
    try:
        with pg.connect(_admin_dsn(settings), name=_PG_SESSION, connect_timeout=3) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error:
        return None
    # "15.18 (Debian 15.18-0+deb12u1)": the number is what status needs.
    return str(row[0]).split()[0] if row else None


def _start_postgres(settings: Settings, echo: Echo) -> None:
    bindir = _ensure_pg_bindir(echo)
    _prepare_pg_paths(settings)
    _init_pg(settings, bindir)
    if postgres_pid(settings) is None:
        _clear_stale_postmaster_pid(settings, echo)
        if _port_open(settings.pg_port):
            raise StackError(
                f"127.0.0.1:{settings.pg_port} is in use by a process opledger did not start: "
                "stop it or choose another port with OPLEDGER_PG_PORT"
            )
        echo(f"postgres: starting on 127.0.0.1:{settings.pg_port}")
        try:
            _run(
                _as_pg_user(
                    [
                        str(bindir / "pg_ctl"),
                        "-D",
                        str(_pg_data(settings)),
                        "-l",
                        str(log_files(settings)["postgres"]),
                        "-w",
                        "-t",
                        str(PG_START_TIMEOUT),
                        "start",
                    ]
                ),
                "pg_ctl start",
                cwd=settings.home,
            )
        except StackError as exc:
            raise StackError(
                f"{exc}\nlast log lines:\n{_tail(log_files(settings)['postgres'])}"
            ) from None
    _ensure_database(settings)


def _ensure_database(settings: Settings) -> None:
    deadline = time.monotonic() + PG_START_TIMEOUT
    while postgres_version(settings) is None:
        if time.monotonic() > deadline:
            raise StackError(
                f"postgres not accepting connections after {PG_START_TIMEOUT}s; last log "
                f"lines:\n{_tail(log_files(settings)['postgres'])}"
            )
        time.sleep(0.3)
    with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (PG_DATABASE,)
        ).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{PG_DATABASE}" OWNER "{PG_USER}"')
    with pg.connect(settings.dsn, name=_PG_SESSION):
        pass
    _ensure_consumer_database(settings)


def _ensure_consumer_database(settings: Settings) -> None:
    """The reference consumer's own database on the local server (it creates its tables, not
    its database). Left alone when OPLEDGER_CONSUMER_PG_DSN points elsewhere."""
    if settings.consumer_pg_dsn:
        return
    name = conninfo_to_dict(settings.consumer_dsn).get("dbname")
    if not name:
        return
    with pg.connect(_admin_dsn(settings), name=_PG_SESSION) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(str(name)), sql.Identifier(PG_USER)
                )
            )


def consumer_secret_file(settings: Settings) -> Path:
    """Where the local stack keeps the reference consumer's webhook signing secret."""
    return settings.home / supervisor.LOCAL_CONSUMER_SECRET


def ensure_consumer_secret(settings: Settings) -> Path:
    """Write a new ``whsec_`` secret for the local reference consumer, once; returns its path.

    Created with mode 0600 in a 0700 directory, never rewritten (destinations added with it
    keep working), and tightened back to 0600 if someone widened it.
    """
    path = consumer_secret_file(settings)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        path.chmod(0o600)
        return path
    # Standard Webhooks: "whsec_" + base64 of the key (32 random bytes here).
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode("ascii")
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return path


def _stop_postgres(settings: Settings, echo: Echo) -> None:
    pid = postgres_pid(settings)
    bindir = find_pg_bindir()
    if pid is None or bindir is None:
        echo("postgres: not running")
        return
    _run(
        _as_pg_user(
            [str(bindir / "pg_ctl"), "-D", str(_pg_data(settings)), "-m", "fast", "-w", "stop"]
        ),
        "pg_ctl stop",
        cwd=settings.home,
    )
    echo(f"postgres: stopped (pid {pid})")


# ---------------------------------------------------------------------------------------------
# the worker supervisor (opledger/supervisor.py)


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
    _prepare_home(settings)
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
                + _tail(log, 15)
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


def _check_worker_ports(settings: Settings) -> None:
    """Refuse to start workers whose ports another process listens on: they would only
    crash-loop, and `up` would take that process's /healthz (another stack's projector,
    say) for theirs."""
    for port, variable in worker_ports(settings):
        if _port_open(port):
            raise StackError(
                f"127.0.0.1:{port} is in use by a process this stack's supervisor did not "
                f"start (`ss -ltnp 'sport = :{port}'` names it): stop it or choose another "
                f"port with {variable}"
            )


# ---------------------------------------------------------------------------------------------
# commands


def up(settings: Settings, echo: Echo = print, workers: bool = True) -> None:
    """Start whatever is not running, wait until healthy, create the topics; then, unless
    ``workers`` is False, the supervisor of the workers (waiting until they serve)."""
    with _locked(settings, "up", echo):
        kafka_ok = kafka_pid(settings) is not None and kafka_healthy(settings)
        pg_ok = postgres_pid(settings) is not None and postgres_version(settings) is not None
        supervised = supervisor.supervisor_pid(settings) is not None
        if kafka_ok and pg_ok and (supervised or not workers):
            echo("stack already running")
        # PostgreSQL first: it is quick and independent, so a Kafka problem (port taken, no
        # java) still leaves the database usable and the error names only what is wrong.
        if pg_ok:
            _ensure_database(settings)
        else:
            _start_postgres(settings, echo)
        if not kafka_ok:
            _start_kafka(settings, echo)
        try:
            specs = ensure_topics(settings)
        except TopicError as exc:
            raise StackError(str(exc)) from None
        # Every component's tables, so the SDK and the workers find them (the SDK makes none).
        db.migrate(settings.dsn)
        ensure_consumer_secret(settings)
        if not (kafka_ok and pg_ok):
            echo(
                f"stack up: kafka {settings.bootstrap_servers}, postgres {settings.dsn}, "
                f"topics {', '.join(s.name for s in specs)}"
            )
        if workers and supervised and (changed := _workers_changed(settings)):
            # A supervisor started by an older opledger runs another worker list; only a new
            # supervisor reads this one. Its workers are crash-safe, so a restart loses nothing.
            echo(f"supervisor: the worker list changed ({changed}); restarting it")
            stop_supervisor(settings, echo)
            supervised = False
        # Last, on healthy servers: a worker started earlier would only crash and back off.
        if workers and not supervised:
            _check_worker_ports(settings)
            start_supervisor(settings, echo)
            wait_workers_ready(settings, echo)


def _workers_changed(settings: Settings) -> str:
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


def restart(settings: Settings, service: str, echo: Echo = print, *, kill: bool = False) -> None:
    """Stop and start one server (``kafka`` or ``postgres``) while the workers keep running:
    what an operator does for an upgrade, and what the chaos tests do to prove the workers
    ride it out. ``kill`` stops the broker with SIGKILL instead of a controlled shutdown."""
    with _locked(settings, f"restart {service}", echo):
        if service == "postgres":
            _stop_postgres(settings, echo)
            _start_postgres(settings, echo)
        elif service == "kafka":
            pid = kafka_pid(settings)
            if kill and pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                while supervisor.alive(pid):
                    time.sleep(0.05)
                _wait_ports_closed(settings)
                _kafka_pid_file(settings).unlink(missing_ok=True)
                echo(f"kafka: killed (pid {pid})")
            else:
                _stop_kafka(settings, echo)
            _start_kafka(settings, echo)
        else:
            raise StackError(f"unknown service {service!r}: restart kafka or postgres")


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
    with _locked(settings, f"restart {name}", echo):
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


def down(settings: Settings, echo: Echo = print) -> None:
    """Stop the supervisor and its workers, then the broker and the database server (data
    stays for the next ``up``)."""
    with _locked(settings, "down", echo):
        # Workers first: stopped after the servers, they would crash and be restarted in vain.
        stop_supervisor(settings, echo)
        _stop_kafka(settings, echo)
        _stop_postgres(settings, echo)


@dataclass(frozen=True, slots=True)
class Component:
    """What ``status`` reports about one server."""

    name: str
    pid: int | None
    address: str
    data_dir: Path
    version: str | None
    healthy: bool

    def line(self) -> str:
        state = "healthy" if self.healthy else ("unhealthy" if self.pid else "stopped")
        pid = f"pid {self.pid}" if self.pid else "pid -"
        return (
            f"{self.name:<9} {state:<9} {pid:<11} {self.address:<18} "
            f"version {self.version or '?':<8} data {self.data_dir}"
        )


def components(settings: Settings) -> list[Component]:
    """The current state of the broker and the database server."""
    pg_version = postgres_version(settings)
    pg_pid = postgres_pid(settings)
    broker_pid = kafka_pid(settings)
    return [
        Component(
            "kafka",
            broker_pid,
            f"127.0.0.1:{settings.kafka_port}",
            _kafka_data(settings),
            settings.kafka_version,
            broker_pid is not None and kafka_healthy(settings),
        ),
        Component(
            "postgres",
            pg_pid,
            f"127.0.0.1:{settings.pg_port}",
            _pg_data(settings),
            pg_version,
            # Someone else's server on our port answers too: healthy only if it is ours.
            pg_pid is not None and pg_version is not None,
        ),
    ]


def status(settings: Settings, echo: Echo = print) -> bool:
    """Print what runs where; True when both servers are healthy.

    Workers are shown (running, restarting or stopped) but do not decide the result: the
    servers are what `status` vouches for (CI and scripts wait on it, and `up --no-workers` is
    a supported setup), and a failing worker is already being restarted by the supervisor.
    """
    found = components(settings)
    for component in found:
        echo(component.line())
    for line in supervisor.status_lines(settings):
        echo(line)
    echo(f"logs      {settings.home / 'logs'}")
    return all(component.healthy for component in found)


def logs(settings: Settings, lines: int, echo: Echo = print) -> None:
    """Print the tail of each log (CI prints them when a run fails)."""
    for name, path in log_files(settings).items():
        echo(f"==> {name}: {path} <==")
        echo(_tail(path, lines))
