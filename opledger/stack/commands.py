"""The stack commands: ``up``, ``down``, ``restart``, ``status`` and ``logs``, each run under
the home's lock over the servers and the supervisor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ledger.policy_keys import ensure_local_keys
from ledger.secret_box import ensure_local_secret_key
from ledger.settings import Settings
from ledger.topics import TopicError, ensure_topics
from opledger import db, supervisor
from opledger.stack.errors import StackError
from opledger.stack.home import (
    ensure_consumer_secret,
    kafka_data,
    locked,
    log_files,
    pg_data,
)
from opledger.stack.kafka import (
    ensure_principals,
    kafka_config_stale,
    kafka_healthy,
    kafka_pid,
    kill_kafka,
    stack_admin,
    start_kafka,
    stop_kafka,
)
from opledger.stack.postgres import (
    ensure_database,
    ensure_service_logins,
    postgres_pid,
    postgres_version,
    start_postgres,
    stop_postgres,
)
from opledger.stack.processes import Echo, tail
from opledger.stack.workers import (
    check_worker_ports,
    start_supervisor,
    stop_supervisor,
    wait_workers_ready,
    workers_changed,
)


def up(settings: Settings, echo: Echo = print, workers: bool = True) -> None:
    """Start whatever is not running, wait until healthy, create the topics; then, unless
    ``workers`` is False, the supervisor of the workers (waiting until they serve)."""
    with locked(settings, "up", echo):
        if kafka_pid(settings) is not None and (stale := kafka_config_stale(settings)):
            # Its clients too: the workers read how to reach the broker when they start.
            echo(f"kafka: {stale}; restarting it and the workers")
            stop_supervisor(settings, echo)
            stop_kafka(settings, echo)
        kafka_ok = kafka_pid(settings) is not None and kafka_healthy(settings)
        pg_ok = postgres_pid(settings) is not None and postgres_version(settings) is not None
        supervised = supervisor.supervisor_pid(settings) is not None
        if kafka_ok and pg_ok and (supervised or not workers):
            echo("stack already running")
        # PostgreSQL first: it is quick and independent, so a Kafka problem (port taken, no
        # java) still leaves the database usable and the error names only what is wrong.
        if pg_ok:
            ensure_database(settings)
        else:
            start_postgres(settings, echo)
        if not kafka_ok:
            start_kafka(settings, echo)
        # The broker denies whoever has no credential and no ACL: the users and the topics'
        # ACLs exist before any worker signs in (decision 029).
        ensure_principals(settings)
        try:
            specs = ensure_topics(stack_admin(settings))
        except TopicError as exc:
            raise StackError(str(exc)) from None
        # Every component's tables, so the SDK and the workers find them (the SDK makes none).
        db.migrate(settings.with_(pg_role="owner").dsn)
        # Then each service's role may sign in (decision 034): the migrations made it.
        ensure_service_logins(settings)
        ensure_consumer_secret(settings)
        # Before the workers: the projector folds only changes signed by a trusted key, and
        # the delivery worker opens destinations' secrets with the secrets key.
        ensure_local_keys(settings)
        seal_stored_secrets(settings)
        if not (kafka_ok and pg_ok):
            echo(
                f"stack up: kafka {settings.bootstrap_servers}, postgres {settings.dsn}, "
                f"topics {', '.join(s.name for s in specs)}"
            )
        if workers and supervised and (changed := workers_changed(settings)):
            # A supervisor started by an older opledger runs another worker list; only a new
            # supervisor reads this one. Its workers are crash-safe, so a restart loses nothing.
            echo(f"supervisor: the worker list changed ({changed}); restarting it")
            stop_supervisor(settings, echo)
            supervised = False
        # Last, on healthy servers: a worker started earlier would only crash and back off.
        if workers and not supervised:
            check_worker_ports(settings)
            start_supervisor(settings, echo)
            wait_workers_ready(settings, echo)


def seal_stored_secrets(settings: Settings) -> None:
    """The local stack's secrets key, made once, and every destination's secret sealed under
    it: a stack upgraded from before decision 033 holds no secret in the clear after `up`."""
    from ledger.destinations import DestinationStore  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415

    ensure_local_secret_key(settings)
    with open_pool(settings.dsn, name="opledger-stack", max_size=1) as pool:
        DestinationStore(pool, settings).rekey()


def restart(settings: Settings, service: str, echo: Echo = print, *, kill: bool = False) -> None:
    """Stop and start one server (``kafka`` or ``postgres``) while the workers keep running:
    what an operator does for an upgrade, and what the chaos tests do to prove the workers
    ride it out. ``kill`` stops the broker with SIGKILL instead of a controlled shutdown."""
    with locked(settings, f"restart {service}", echo):
        if service == "postgres":
            stop_postgres(settings, echo)
            start_postgres(settings, echo)
        elif service == "kafka":
            pid = kafka_pid(settings)
            if kill and pid is not None:
                kill_kafka(settings, pid, echo)
            else:
                stop_kafka(settings, echo)
            start_kafka(settings, echo)
        else:
            raise StackError(f"unknown service {service!r}: restart kafka or postgres")


def down(settings: Settings, echo: Echo = print) -> None:
    """Stop the supervisor and its workers, then the broker and the database server (data
    stays for the next ``up``)."""
    with locked(settings, "down", echo):
        # Workers first: stopped after the servers, they would crash and be restarted in vain.
        stop_supervisor(settings, echo)
        stop_kafka(settings, echo)
        stop_postgres(settings, echo)


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
            kafka_data(settings),
            settings.kafka_version,
            broker_pid is not None and kafka_healthy(settings),
        ),
        Component(
            "postgres",
            pg_pid,
            f"127.0.0.1:{settings.pg_port}",
            pg_data(settings),
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
        echo(tail(path, lines))
