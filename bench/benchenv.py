"""What every benchmark needs: a private topic prefix and databases, dropped afterwards.

Same recipe as the ``isolated`` test fixture (``tests/conftest.py``), copied rather than imported
so the benchmarks do not depend on the test tree: ``CREATE DATABASE`` through the ``postgres``
database, ``ensure_topics`` for the prefix, and on the way out ``DROP DATABASE ... WITH (FORCE)``
and ``delete_topics`` (retention is infinite, so forgotten topics would stay on disk).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ledger.codec import default_codec
from ledger.domain.events import Transition
from ledger.kafka import connection_config
from ledger.settings import Settings
from ledger.topics import ensure_topics, topic_specs
from opledger import db


@dataclass(frozen=True, slots=True)
class Isolated:
    """Settings on a private prefix and database, plus the DSNs of any extra databases."""

    settings: Settings
    extra_dsns: tuple[str, ...]


def _admin_dsn(settings: Settings) -> str:
    return make_conninfo(settings.dsn, dbname="postgres")


def create_database(settings: Settings, name: str) -> str:
    with psycopg.connect(_admin_dsn(settings), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(settings.dsn, dbname=name)


def drop_database(settings: Settings, name: str) -> None:
    with psycopg.connect(_admin_dsn(settings), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@contextmanager
def isolated(base: Settings, label: str, extra_databases: int = 0) -> Iterator[Isolated]:
    """A private topic prefix + database (and ``extra_databases`` more), removed on exit."""
    # The broker's admin, as the test suite is: a benchmark makes and drops its own topics.
    base = base.as_kafka_role("admin")
    tag = f"bench{label}{uuid4().hex[:8]}"
    names = [f"opledger_{tag}"] + [f"opledger_{tag}_{i}" for i in range(extra_databases)]
    created: list[str] = []
    settings = base.with_(topic_prefix=tag)
    try:
        dsns = []
        for name in names:
            dsns.append(create_database(base, name))
            created.append(name)
        # The local server's database, not a DSN: the SDK signs in as its own role there.
        settings = settings.with_(pg_database=names[0])
        ensure_topics(settings)
        db.migrate(settings.dsn)  # the tables `opledger db migrate` makes, as a deployment has
        yield Isolated(settings, tuple(dsns[1:]))
    finally:
        for name in created:
            drop_database(base, name)
        # Our topics, and any a worker made under the same unique prefix (faust's
        # "<prefix>-projector-__assignor-__leader").
        admin = AdminClient({**connection_config(settings)})
        existing = admin.list_topics(timeout=10).topics
        doomed = {spec.name for spec in topic_specs(settings)} & existing.keys()
        doomed |= {t for t in existing if t.startswith((f"{tag}.", f"{tag}-"))}
        if doomed:
            for future in admin.delete_topics(sorted(doomed)).values():
                future.exception(timeout=30)


def producer(settings: Settings, linger_ms: int = 5) -> Producer:
    """The producer configuration the tests (and the SDK) append with."""
    return Producer(
        {
            **connection_config(settings),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            "partitioner": "murmur2_random",
        }
    )


def topic_of(settings: Settings, event: Transition) -> str:
    return settings.execution_topic if event.kind == "execution" else settings.delivery_topic


def produce_all(settings: Settings, events: Iterable[Transition]) -> list[tuple[str, int, int]]:
    """Append every event keyed by operation_id; returns each one's (topic, partition, offset)."""
    p = producer(settings)
    codec = default_codec()
    coordinates: list[tuple[str, int, int]] = []
    failures: list[str] = []

    def delivered(i: int) -> Callable[[KafkaError | None, Message], None]:
        def callback(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failures.append(str(err))
                return
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            if topic is None or partition is None or offset is None:
                failures.append("delivery report without coordinates")
                return
            coordinates[i] = (topic, partition, offset)

        return callback

    for index, event in enumerate(events):
        coordinates.append(("", -1, -1))
        topic = topic_of(settings, event)
        value = codec.encode(event)
        while True:
            try:
                p.produce(
                    topic,
                    key=event.operation_id.encode(),
                    value=value,
                    on_delivery=delivered(index),
                )
                break
            except BufferError:
                p.poll(0.05)
        if index % 1000 == 999:
            p.poll(0)
    if p.flush(60) or failures:
        raise SystemExit(f"broker did not acknowledge every record: {failures[:3]}")
    return coordinates


# -- CPU seconds from /proc (Linux) ---------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> list[str] | None:
    """The fields after the command name of a ``/proc/.../stat``; None if it is gone."""
    try:
        with open(path, encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _used(fields: list[str] | None, children: bool = False) -> float:
    if fields is None:
        return 0.0
    used = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        used += int(fields[13]) + int(fields[14])  # of the children that have exited
    return used / TICK


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    return _used(_stat(f"/proc/{pid}/stat"))


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """This process's threads: native id -> (name, CPU seconds so far)."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="ascii") as comm:
                name = comm.read().strip()
        except FileNotFoundError:
            continue
        out[int(task)] = (name, _used(_stat(f"/proc/self/task/{task}/stat")))
    return out


def stack_cpu_seconds(settings: Settings) -> dict[str, float]:
    """CPU seconds used so far by the local stack's broker and by PostgreSQL (the postmaster,
    its live backends, and the backends that have exited)."""
    broker = int((settings.home / "run" / "kafka.pid").read_text().split()[0])
    postmaster_file = settings.home / "postgres" / "postmaster.pid"
    postmaster = int(postmaster_file.read_text().split("\n", 1)[0])
    postgres = _used(_stat(f"/proc/{postmaster}/stat"), children=True)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(f"/proc/{entry.name}/stat")
            if fields is not None and int(fields[1]) == postmaster:
                postgres += _used(fields)
    return {"broker": cpu_seconds(broker), "postgres": postgres}


def machine_seconds() -> tuple[float, float]:
    """(CPU seconds of all cores so far, the idle ones among them)."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return sum(values) / TICK, (values[3] + values[4]) / TICK


def faust_credentials(settings: Settings) -> Any:
    """The SASL credentials a faust (aiokafka) app needs for ``settings``' broker (over TLS,
    trusting its CA file, on a TLS one), or None on a plaintext one: the benchmarks that still
    compare against faust sign in as the admin."""
    config = connection_config(settings)
    if not str(config["security.protocol"]).startswith("sasl"):
        return None
    import ssl  # noqa: PLC0415

    from faust.auth import SASLCredentials  # noqa: PLC0415

    context = None
    if config["security.protocol"] == "sasl_ssl":
        context = ssl.create_default_context(cafile=config.get("ssl.ca.location"))
    return SASLCredentials(
        username=config["sasl.username"],
        password=config["sasl.password"],
        mechanism=config["sasl.mechanism"],
        ssl_context=context,
    )
