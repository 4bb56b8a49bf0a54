"""The local stack: one KRaft Kafka broker and one PostgreSQL server, on 127.0.0.1 only, and
the supervisor that keeps the workers (the projector) running on them.

Everything lives under ``settings.home`` (outside the git tree): the broker's jars (resolved
once by Maven), its data, PostgreSQL's cluster, pid files and logs. ``up`` is idempotent and
cheap when the stack already runs, so tests and ``make`` targets call it freely.
"""

from __future__ import annotations

import base64
import contextlib
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
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ledger.kafka import admin_config, producer_config
from ledger.settings import Settings
from ledger.topics import TopicError, ensure_topics
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


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} not readable)"
    return "\n".join(text[-lines:])


@contextlib.contextmanager
def _locked(settings: Settings) -> Iterator[None]:
    # Several pytest sessions and make targets call `up` concurrently; one at a time.
    _prepare_home(settings)
    with (settings.home / ".stack.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prepare_home(settings: Settings) -> None:
    for directory in (settings.home, settings.home / "logs", _run_dir(settings)):
        directory.mkdir(parents=True, exist_ok=True)
    if _is_root():
        # The unprivileged PostgreSQL user must traverse home to reach its own directories.
        settings.home.chmod(0o755)


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


def _write_kafka_config(settings: Settings) -> Path:
    conf = _kafka_conf(settings)
    conf.mkdir(parents=True, exist_ok=True)
    k, c = settings.kafka_port, settings.kafka_controller_port
    properties = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{c}",
        "listeners": f"PLAINTEXT://127.0.0.1:{k},CONTROLLER://127.0.0.1:{c}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{k}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(_kafka_data(settings)),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        # Topics are created explicitly (ledger.topics) with their partitions and retention.
        "auto.create.topics.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
    }
    path = conf / "server.properties"
    path.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
    return path


def _random_cluster_id() -> str:
    # Kafka's Uuid.randomUuid(): url-safe base64 of 16 random bytes, never starting with "-"
    # (it would read as a command-line flag); same as `kafka-storage random-uuid`, minus a JVM.
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _format_kafka(settings: Settings, java: str, libs: Path, config: Path) -> None:
    if (_kafka_data(settings) / "meta.properties").is_file():
        return
    _run(
        [
            java,
            "-cp",
            f"{libs}/*",
            "kafka.tools.StorageTool",
            "format",
            "-t",
            _random_cluster_id(),
            "-c",
            str(config),
        ],
        "kafka storage format",
    )


def kafka_pid(settings: Settings) -> int | None:
    """Pid of the broker this stack started, if it is still alive."""
    try:
        pid = int(_kafka_pid_file(settings).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    # Guards against a recycled pid belonging to some other process.
    return pid if b"kafka.Kafka" in cmdline else None


def kafka_healthy(settings: Settings, timeout: float = 5.0) -> bool:
    """Whether a broker answers a metadata request on ``settings.bootstrap_servers``."""
    if not settings.kafka_bootstrap and not _port_open(settings.kafka_port):
        return False
    # log_level 0: librdkafka would otherwise print connection errors while we poll.
    admin = AdminClient({**admin_config(settings, client_id="opledger-stack"), "log_level": 0})
    try:
        admin.list_topics(timeout=timeout)
    except Exception:  # any failure here just means "not healthy yet"
        return False
    return True


def _start_kafka(settings: Settings, echo: Echo) -> None:
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
    argv = [
        java,
        KAFKA_HEAP,
        "-Xms256m",
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={_kafka_resources() / 'log4j2.yaml'}",
        f"-Dopledger.kafka.log={logs['kafka']}",
        "-cp",
        f"{libs}/*",
        "kafka.Kafka",
        str(config),
    ]
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
    _wait_kafka(settings, process)
    _wait_producer_ids(settings)


def _wait_kafka(settings: Settings, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + KAFKA_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(
                f"kafka exited with code {process.returncode} during start-up; last log lines:\n"
                + _kafka_log_tails(settings)
            )
        if kafka_healthy(settings, timeout=2.0):
            return
        time.sleep(0.5)
    raise StackError(
        f"kafka not healthy after {KAFKA_START_TIMEOUT:.0f}s (pid {process.pid}); "
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

    probe = Producer(
        {
            **producer_config(settings, client_id="opledger-stack-probe"),
            "statistics.interval.ms": 100,
            "stats_cb": on_stats,
            "log_level": 0,  # the retries this waits out are expected; keep them quiet
        }
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
    os.kill(pid, signal.SIGTERM)
    # SIGTERM triggers a controlled shutdown that flushes the logs; give it a while.
    deadline = time.monotonic() + KAFKA_STOP_TIMEOUT
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        echo(f"kafka: no exit {KAFKA_STOP_TIMEOUT:.0f}s after SIGTERM, sending SIGKILL")
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
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


def _alive(pid: int) -> bool:
    try:
        # A zombie still answers kill(0); /proc status tells them apart.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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
        with (data / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude_if_exists = 'opledger.conf'\n")
    opledger_conf = data / "opledger.conf"
    opledger_conf.write_text(_pg_config_text(settings))
    _own(opledger_conf)


def postgres_pid(settings: Settings) -> int | None:
    """Pid of the postmaster serving our data directory, if it is alive."""
    try:
        pid = int((_pg_data(settings) / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _admin_dsn(settings: Settings) -> str:
    return f"postgresql://{PG_USER}@127.0.0.1:{settings.pg_port}/postgres"


def postgres_version(settings: Settings) -> str | None:
    """Server version when our PostgreSQL accepts connections, else None."""
    try:
        with psycopg.connect(_admin_dsn(settings), connect_timeout=3) as conn:
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
    with psycopg.connect(_admin_dsn(settings), autocommit=True) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (PG_DATABASE,)
        ).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{PG_DATABASE}" OWNER "{PG_USER}"')
    with psycopg.connect(settings.dsn, connect_timeout=5):
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
    with psycopg.connect(_admin_dsn(settings), autocommit=True) as conn:
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
    while supervisor.supervisor_pid(settings) != process.pid:
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
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + SUPERVISOR_STOP_TIMEOUT
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        echo(f"supervisor: no exit {SUPERVISOR_STOP_TIMEOUT:.0f}s after SIGTERM, sending SIGKILL")
        # Its workers die with it (PR_SET_PDEATHSIG); the process group catches any left over,
        # but only when it is the supervisor's own group (started by `up`), never a shell's.
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.1)
    echo(f"supervisor: stopped (pid {pid}) with its workers")


# ---------------------------------------------------------------------------------------------
# commands


def up(settings: Settings, echo: Echo = print, workers: bool = True) -> None:
    """Start whatever is not running, wait until healthy, create the topics; then, unless
    ``workers`` is False, the supervisor of the workers (waiting until they serve)."""
    with _locked(settings):
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
            start_supervisor(settings, echo)
            wait_workers_ready(settings, echo)


def _workers_changed(settings: Settings) -> str:
    """How the running supervisor's workers differ from WORKERS ("" when they do not, or when
    it has not written its status yet)."""
    status = supervisor.read_status(settings)
    if status.get("supervisor", {}).get("pid") != supervisor.supervisor_pid(settings):
        return ""  # a status written by an earlier supervisor, or none yet: nothing to compare
    running = {
        name: tuple(worker.get("argv_suffix", ()))
        for name, worker in status.get("workers", {}).items()
        if isinstance(worker, dict)
    }
    wanted = {spec.name: spec.args for spec in supervisor.WORKERS}
    differences = [f"+{name}" for name in wanted if name not in running]
    differences += [f"-{name}" for name in running if name not in wanted]
    differences += [
        f"~{name}" for name in wanted if name in running and running[name] != wanted[name]
    ]
    return ", ".join(differences)


def restart(settings: Settings, service: str, echo: Echo = print, *, kill: bool = False) -> None:
    """Stop and start one server (``kafka`` or ``postgres``) while the workers keep running:
    what an operator does for an upgrade, and what the chaos tests do to prove the workers
    ride it out. ``kill`` stops the broker with SIGKILL instead of a controlled shutdown."""
    with _locked(settings):
        if service == "postgres":
            _stop_postgres(settings, echo)
            _start_postgres(settings, echo)
        elif service == "kafka":
            pid = kafka_pid(settings)
            if kill and pid is not None:
                os.kill(pid, signal.SIGKILL)
                while _alive(pid):
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
    if supervisor.supervisor_pid(settings) is None:
        raise StackError("the supervisor is not running: start it with `opledger stack up`")
    worker = supervisor.read_status(settings).get("workers", {}).get(name, {})
    pid = worker.get("pid") if isinstance(worker, dict) else None
    try:
        # The pid must still be that worker's, not a recycled one.
        ours = isinstance(pid, int) and b"opledger.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        ours = False
    if not ours or not isinstance(pid, int):
        raise StackError(
            f"{name} is not running now (the supervisor is restarting it?): "
            "see `opledger stack status`"
        )
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
    with _locked(settings):
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
            postgres_pid(settings),
            f"127.0.0.1:{settings.pg_port}",
            _pg_data(settings),
            pg_version,
            pg_version is not None,
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
