"""The local stack: one KRaft Kafka broker and one PostgreSQL server, on 127.0.0.1 only, and
the supervisor that keeps the workers (the projector) running on them.

Everything lives under ``settings.home`` (outside the git tree): the broker's jars (resolved
once by Maven), its data, PostgreSQL's cluster, pid files and logs. ``up`` is idempotent and
cheap when the stack already runs, so tests and ``make`` targets call it freely.

Split by what it runs: ``kafka``, ``postgres`` and ``workers`` (the supervisor), over
``home`` (the layout of ``settings.home``), ``processes`` and ``errors``; ``commands`` holds
the commands. This module is the face callers use.
"""

from opledger.stack.commands import Component, components, down, logs, restart, status, up
from opledger.stack.errors import StackError, StackInterruptedError, sigterm_interrupts
from opledger.stack.home import (
    STORAGE_ERRNOS,
    consumer_secret_file,
    describe_os_error,
    ensure_consumer_secret,
    log_files,
)
from opledger.stack.kafka import (
    KAFKA_HEAP,
    KAFKA_START_TIMEOUT,
    KAFKA_STOP_TIMEOUT,
    ensure_kafka_jars,
    find_java,
    find_mvn,
    format_kafka_storage,
    kafka_command,
    kafka_healthy,
    kafka_pid,
    kraft_properties,
    random_cluster_id,
    stack_admin,
    write_properties,
)
from opledger.stack.postgres import (
    PG_DATABASE,
    PG_START_TIMEOUT,
    PG_USER,
    find_pg_bindir,
    postgres_pid,
    postgres_version,
)
from opledger.stack.processes import TAIL_LINE_MAX, Echo
from opledger.stack.workers import (
    SUPERVISOR_START_TIMEOUT,
    SUPERVISOR_STOP_TIMEOUT,
    WORKERS_READY_TIMEOUT,
    restart_worker,
    start_supervisor,
    stop_supervisor,
    wait_workers_ready,
    worker_ports,
)

__all__ = [
    "KAFKA_HEAP",
    "KAFKA_START_TIMEOUT",
    "KAFKA_STOP_TIMEOUT",
    "PG_DATABASE",
    "PG_START_TIMEOUT",
    "PG_USER",
    "STORAGE_ERRNOS",
    "SUPERVISOR_START_TIMEOUT",
    "SUPERVISOR_STOP_TIMEOUT",
    "TAIL_LINE_MAX",
    "WORKERS_READY_TIMEOUT",
    "Component",
    "Echo",
    "StackError",
    "StackInterruptedError",
    "components",
    "consumer_secret_file",
    "describe_os_error",
    "down",
    "ensure_consumer_secret",
    "ensure_kafka_jars",
    "find_java",
    "find_mvn",
    "find_pg_bindir",
    "format_kafka_storage",
    "kafka_command",
    "kafka_healthy",
    "kafka_pid",
    "kraft_properties",
    "log_files",
    "logs",
    "postgres_pid",
    "postgres_version",
    "random_cluster_id",
    "restart",
    "restart_worker",
    "sigterm_interrupts",
    "stack_admin",
    "start_supervisor",
    "status",
    "stop_supervisor",
    "up",
    "wait_workers_ready",
    "worker_ports",
    "write_properties",
]
