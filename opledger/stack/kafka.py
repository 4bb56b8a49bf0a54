"""The local stack's KRaft Kafka broker on 127.0.0.1: its jars (resolved once by Maven from
``kafka/pom.xml``), the ``server.properties`` it is started with, its start, readiness and
stop. ``tests/cluster_support.py`` builds its three-node cluster from the same pieces."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ledger.kafka_access import ADMIN, PRINCIPALS, ensure_users, make_passwords, password_file
from ledger.log import new_admin, new_producer
from ledger.log.reads import ride_out
from ledger.private_files import write_private
from ledger.settings import Settings
from ledger.topics import min_insync_replicas
from opledger import supervisor
from opledger.stack.errors import StackError
from opledger.stack.home import (
    jars_marker,
    kafka_conf,
    kafka_data,
    kafka_pid_file,
    libs_dir,
    log_files,
)
from opledger.stack.processes import Echo, port_open, run, tail

KAFKA_HEAP = "-Xmx1g"


KAFKA_START_TIMEOUT = 120.0


KAFKA_STOP_TIMEOUT = 30.0


def _kafka_resources() -> Path:
    # A checkout has kafka/ next to opledger/; a wheel force-includes it as opledger/kafka.
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "kafka", here.parents[1] / "kafka"):
        if (candidate / "pom.xml").is_file():
            return candidate
    raise StackError("kafka/pom.xml not found next to the opledger package: reinstall opledger")


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


def ensure_kafka_jars(settings: Settings, echo: Echo = print) -> Path:
    """Resolve the broker's jars with Maven once per Kafka version; return the libs dir."""
    libs, marker = libs_dir(settings), jars_marker(settings)
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
    run(
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


@dataclass(frozen=True, slots=True)
class BrokerSecrets:
    """The passwords a SASL broker's own configuration holds: the admin's (PLAIN on the client
    listener, the one credential that exists before any SCRAM user does) and the controller's
    (PLAIN on the controller listener, which no client uses)."""

    admin_password: str = field(repr=False)
    controller_password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class BrokerTls:
    """The local broker's own key and certificate for a TLS client listener (decision 035):
    ``keystore`` of ``keystore_type`` (``PEM``, ``PKCS12`` or ``JKS``), opened with
    ``password`` (a PEM key's only if encrypted), and ``truststore``, the PEM of the CA the
    broker trusts when it reaches its own listener (transaction markers go over the network,
    even to itself); None: the JVM's own trust store."""

    keystore: Path
    keystore_type: str
    password: str | None = field(repr=False)
    truststore: Path | None = None

    def properties(self) -> dict[str, str]:
        props = {
            "ssl.keystore.type": self.keystore_type,
            "ssl.keystore.location": str(self.keystore),
            # Clients prove who they are with SCRAM, not with certificates of their own.
            "ssl.client.auth": "none",
        }
        if self.password is not None:
            # Kafka refuses a store password for a PEM file: there it is the key's.
            key = "ssl.key.password" if self.keystore_type == "PEM" else "ssl.keystore.password"
            props[key] = self.password
        if self.truststore is not None:
            props["ssl.truststore.type"] = "PEM"
            props["ssl.truststore.location"] = str(self.truststore)
        return props


_KEYSTORE_TYPES = {".pem": "PEM", ".p12": "PKCS12", ".pfx": "PKCS12", ".jks": "JKS"}


def broker_tls(settings: Settings) -> BrokerTls | None:
    """The local broker's TLS from OPLEDGER_KAFKA_TLS_KEYSTORE, checked before the broker
    sees it: a file Kafka would refuse, or one others may read, is named with what to do."""
    if not settings.kafka_tls_keystore:
        return None
    var = "OPLEDGER_KAFKA_TLS_KEYSTORE"
    keystore = Path(settings.kafka_tls_keystore).expanduser().resolve()
    kind = _KEYSTORE_TYPES.get(keystore.suffix.lower())
    if kind is None:
        raise StackError(
            f"{var}={keystore}: name a .pem file (key and certificate chain) or a .p12, .pfx "
            "or .jks keystore"
        )
    try:
        mode = keystore.stat().st_mode
        content = keystore.read_bytes()
    except OSError as exc:
        raise StackError(f"{var}: cannot read {keystore}: {exc.strerror}") from None
    if mode & 0o077:
        raise StackError(
            f"{var}: {keystore} holds a private key and others may read it "
            f"(mode {mode & 0o777:o}): chmod 600 it"
        )
    password = _keystore_password(settings)
    if kind == "PEM":
        _check_pem_keystore(keystore, content, encrypted_key_password=password)
    elif password is None:
        raise StackError(
            f"{var}: a {kind} keystore needs its password in "
            "OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE"
        )
    truststore = None
    if settings.kafka_ca_file:
        truststore = Path(settings.kafka_ca_file).expanduser().resolve()
        if b"-----BEGIN CERTIFICATE-----" not in _read(truststore, "OPLEDGER_KAFKA_CA_FILE"):
            raise StackError(f"OPLEDGER_KAFKA_CA_FILE: {truststore} holds no PEM certificate")
    return BrokerTls(keystore, kind, password, truststore)


def _read(path: Path, var: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise StackError(f"{var}: cannot read {path}: {exc.strerror}") from None


def _keystore_password(settings: Settings) -> str | None:
    if not settings.kafka_tls_keystore_password_file:
        return None
    var = "OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE"
    path = Path(settings.kafka_tls_keystore_password_file).expanduser()
    lines = _read(path, var).decode("utf-8", "replace").splitlines()
    if not lines or not lines[0].strip():
        raise StackError(f"{var}: {path} is empty")
    return lines[0].strip()


def _check_pem_keystore(path: Path, content: bytes, *, encrypted_key_password: str | None) -> None:
    var = "OPLEDGER_KAFKA_TLS_KEYSTORE"
    if (
        b"-----BEGIN RSA PRIVATE KEY-----" in content
        or b"-----BEGIN EC PRIVATE KEY-----" in content
    ):
        raise StackError(
            f"{var}: the key in {path} is not PKCS#8, the only form Kafka reads: convert it "
            "with `openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY8` (or -v2 aes256 to keep it "
            "encrypted)"
        )
    encrypted = b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in content
    if not encrypted and b"-----BEGIN PRIVATE KEY-----" not in content:
        raise StackError(f"{var}: {path} holds no private key (PEM, PKCS#8)")
    if b"-----BEGIN CERTIFICATE-----" not in content:
        raise StackError(f"{var}: {path} holds no certificate: append the chain to the key")
    if encrypted and encrypted_key_password is None:
        raise StackError(
            f"{var}: the key in {path} is encrypted; name its password in "
            "OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE"
        )
    if not encrypted and encrypted_key_password is not None:
        raise StackError(
            f"{var}: the key in {path} is not encrypted, yet "
            "OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE names a password for it: drop one"
        )


_PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule required"
_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule required;"


def _plain_login(user: str, password: str) -> str:
    """The PLAIN login of a broker's listener: the one user it knows, which is also who the
    broker signs in as when it is the client (inter-broker, controller)."""
    if not re.fullmatch(r"[!#-\[\]-~]+", password):
        # A quote, a backslash or a space would end the JAAS value early or change its meaning.
        raise ValueError(
            f"the Kafka password of {user} must be printable ASCII without quotes, "
            "backslashes or spaces"
        )
    return f'{_PLAIN} username="{user}" password="{password}" user_{user}="{password}";'


def plain_client(user: str, password: str) -> str:
    """A Kafka client's ``sasl.jaas.config`` for PLAIN (Kafka's own tools, as the admin)."""
    _plain_login(user, password)  # the same refusal of a password JAAS cannot hold
    return f'{_PLAIN} username="{user}" password="{password}";'


#: The broker's SASL settings that hold no secret: the same in ``server.properties`` and in
#: docker-compose.yml (whose logins are in a JAAS file, :func:`broker_jaas`).
SASL_BROKER_SETTINGS = {
    "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
    "sasl.mechanism.inter.broker.protocol": "PLAIN",
    "sasl.mechanism.controller.protocol": "PLAIN",
    "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
    "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
    "super.users": f"User:{ADMIN};User:controller",
    # Deny what no ACL allows: a principal (or a user created later) starts with nothing.
    "allow.everyone.if.no.acl.found": "false",
}


def broker_jaas(secrets: BrokerSecrets, listener: str = "SASL_PLAINTEXT") -> str:
    """The logins of :func:`_sasl_properties` as a JAAS file, for a broker configured without
    secrets in its properties (the apache/kafka image takes its settings from environment
    variables, which ``docker inspect`` shows): one context per listener."""
    admin = _plain_login(ADMIN, secrets.admin_password)
    controller = _plain_login("controller", secrets.controller_password)
    return (
        f"{listener.lower()}.KafkaServer {{\n    {admin}\n    {_SCRAM}\n}};\n"
        f"controller.KafkaServer {{\n    {controller}\n}};\n"
    )


def _sasl_properties(secrets: BrokerSecrets, listener: str) -> dict[str, str]:
    name = listener.lower()
    return {
        **SASL_BROKER_SETTINGS,
        f"listener.name.{name}.plain.sasl.jaas.config": _plain_login(ADMIN, secrets.admin_password),
        f"listener.name.{name}.scram-sha-512.sasl.jaas.config": _SCRAM,
        "listener.name.controller.plain.sasl.jaas.config": _plain_login(
            "controller", secrets.controller_password
        ),
    }


def kraft_properties(
    *,
    node_id: int,
    port: int,
    controller_port: int,
    voters: str,
    log_dir: Path,
    replication: int = 1,
    secrets: BrokerSecrets | None = None,
    tls: BrokerTls | None = None,
) -> dict[str, str]:
    """``server.properties`` of one combined broker and controller on 127.0.0.1: the local
    stack's single node, or one of the nodes of ``tests/cluster_support.py``'s cluster.
    ``voters`` is ``controller.quorum.voters`` (``id@host:port,...``); ``replication`` the
    replicas of the broker's internal topics (consumer offsets, transaction state). With
    ``secrets``, every listener asks for SASL and ACLs decide (decision 029); without, it is
    plaintext and open (the test cluster's nodes). With ``tls`` too, the client listener is
    SASL over TLS (decision 035); the controller's stays on loopback without it, since no
    client reaches it."""
    if tls and not secrets:
        raise ValueError("TLS on the local broker comes with SASL: pass its secrets too")
    controller_protocol = "SASL_PLAINTEXT" if secrets else "PLAINTEXT"
    listener = "SASL_SSL" if tls else controller_protocol
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": f"{listener}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"{listener}://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": f"{listener}:{listener},CONTROLLER:{controller_protocol}",
        "inter.broker.listener.name": listener,
        **(_sasl_properties(secrets, listener) if secrets else {}),
        **(tls.properties() if tls else {}),
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
    """``properties`` as a Java properties file at ``path`` (0600: it may hold passwords)."""
    write_private(path, "".join(f"{key}={value}\n" for key, value in properties.items()))
    return path


def stack_admin(settings: Settings) -> Settings:
    """``settings`` as the local broker's super user signs in: PLAIN, with the password its
    own configuration holds, which works before any SCRAM user exists (a new cluster, or one
    an older opledger made without SASL). A broker named by OPLEDGER_KAFKA_BOOTSTRAP is
    someone else's: its admin is whatever OPLEDGER_KAFKA_PRINCIPAL says."""
    if settings.kafka_bootstrap:
        return settings.as_kafka_role(ADMIN)
    return settings.with_(
        kafka_principal=ADMIN, kafka_password_file="", kafka_sasl_mechanism="PLAIN"
    )


def _broker_secrets(settings: Settings) -> BrokerSecrets:
    make_passwords(settings, (*PRINCIPALS, "controller"))

    def read(principal: str) -> str:
        return password_file(settings, principal).read_text().splitlines()[0].strip()

    return BrokerSecrets(admin_password=read(ADMIN), controller_password=read("controller"))


def _local_properties(settings: Settings, secrets: BrokerSecrets) -> dict[str, str]:
    """The local stack's single node, as ``settings`` describe it."""
    c = settings.kafka_controller_port
    return kraft_properties(
        node_id=1,
        port=settings.kafka_port,
        controller_port=c,
        voters=f"1@127.0.0.1:{c}",
        log_dir=kafka_data(settings),
        secrets=secrets,
        tls=broker_tls(settings),
    )


def _write_kafka_config(settings: Settings) -> Path:
    conf = kafka_conf(settings)
    conf.mkdir(parents=True, exist_ok=True)
    properties = _local_properties(settings, _broker_secrets(settings))
    return write_properties(conf / "server.properties", properties)


#: What a running broker must have been started with to serve these settings' clients.
_LISTENING_KEYS = ("listeners", "ssl.keystore.location", "ssl.truststore.location")


def kafka_config_stale(settings: Settings) -> str | None:
    """Why the running broker's ``server.properties`` no longer fits ``settings`` (TLS turned
    on or off, another keystore or CA), or None. A broker started otherwise would only look
    unhealthy to clients that now speak another protocol."""
    path = kafka_conf(settings) / "server.properties"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    running = dict(line.split("=", 1) for line in lines if "=" in line)
    # Only the listeners are compared: any password will do.
    wanted = _local_properties(settings, BrokerSecrets(admin_password="-", controller_password="-"))
    for key in _LISTENING_KEYS:
        if running.get(key) != wanted.get(key):
            was, now = running.get(key, "(none)"), wanted.get(key, "(none)")
            return f"it runs with {key}={was}, the settings ask for {now}"
    return None


def ensure_principals(settings: Settings) -> None:
    """Every principal's SCRAM credential on the local broker, from its password file."""
    if settings.kafka_bootstrap:
        return  # someone else's cluster: its users are theirs to make
    make_passwords(settings)
    ride_out(
        lambda: ensure_users(stack_admin(settings)),
        deadline=time.monotonic() + 60,
        what="the SCRAM users",
        bootstrap=settings.bootstrap_servers,
    )


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
    run(
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
    if (kafka_data(settings) / "meta.properties").is_file():
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
    hint = supervisor.read_pid(kafka_pid_file(settings))
    return supervisor.find_owned(b"kafka.Kafka", settings.home, hint)


def kafka_healthy(settings: Settings, timeout: float = 5.0) -> bool:
    """Whether a broker answers a metadata request on ``settings.bootstrap_servers``."""
    if not settings.kafka_bootstrap and not port_open(settings.kafka_port):
        return False
    # log_level 0: librdkafka would otherwise print connection errors while we poll.
    admin = new_admin(stack_admin(settings), client_id="opledger-stack", overrides={"log_level": 0})
    try:
        admin.list_topics(timeout=timeout)
    except Exception:  # any failure here just means "not healthy yet"
        return False
    return True


def start_kafka(settings: Settings, echo: Echo) -> None:
    """Start the broker (or wait for the one already starting) until it is healthy and hands out
    producer ids."""
    starting = kafka_pid(settings)
    if starting is not None:
        # Ours but not healthy yet: an `up` stopped mid-start left it starting. A second
        # broker on the same data would fight it for the ports and the log dirs.
        kafka_pid_file(settings).write_text(f"{starting}\n")
        echo(f"kafka: waiting for the broker already starting (pid {starting})")
        _wait_kafka(settings, starting)
        _wait_producer_ids(settings)
        return
    java = find_java()
    libs = ensure_kafka_jars(settings, echo)
    for port in (settings.kafka_port, settings.kafka_controller_port):
        if port_open(port):
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
    kafka_pid_file(settings).write_text(f"{process.pid}\n")
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
        stack_admin(settings),
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
    return tail(logs["kafka"]) + "\n--- stdout ---\n" + tail(logs["kafka-stdout"], 15)


def kill_kafka(settings: Settings, pid: int, echo: Echo) -> None:
    """SIGKILL the broker ``pid``, as a crash would stop it (no controlled shutdown), and wait
    until it and its listeners are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    while supervisor.alive(pid):
        time.sleep(0.05)
    _wait_ports_closed(settings)
    kafka_pid_file(settings).unlink(missing_ok=True)
    echo(f"kafka: killed (pid {pid})")


def stop_kafka(settings: Settings, echo: Echo) -> None:
    """Stop the broker with a controlled shutdown, SIGKILL if it hangs, and wait until its ports
    close."""
    pid = kafka_pid(settings)
    if pid is None:
        echo("kafka: not running")
        kafka_pid_file(settings).unlink(missing_ok=True)
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
    kafka_pid_file(settings).unlink(missing_ok=True)
    echo(f"kafka: stopped (pid {pid})")


def _wait_ports_closed(settings: Settings, timeout: float = 10.0) -> None:
    """Until the broker's ports no longer answer: a killed JVM's main thread is reaped (a
    zombie) while its other threads still close its sockets, so for a moment after it looks
    dead its listener still accepts, and a start would take that for someone else's broker."""
    deadline = time.monotonic() + timeout
    ports = (settings.kafka_port, settings.kafka_controller_port)
    while any(port_open(port) for port in ports) and time.monotonic() < deadline:
        time.sleep(0.05)
