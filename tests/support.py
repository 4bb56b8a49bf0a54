"""Helpers for the integration and chaos tiers: put events on the real topics, run or await the
projector, and compute the expected projections independently of it (a plain sequential fold of
every record read back from Kafka, partition by partition, with no batching, SQL or offsets)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ledger.codec import DecodeError, default_codec
from ledger.domain.events import (
    ExecutionTransitioned,
    OperationEvent,
    PolicyChange,
    PolicyChanged,
    Transition,
)
from ledger.domain.ids import ULID_PATTERN, event_id
from ledger.kafka import connection_config, partition_for
from ledger.log import end_offsets
from ledger.metrics import Metrics
from ledger.settings import Settings
from processors.batch_reader import BatchProjector
from projections import progress
from projections.writer import PostgresProjection
from tests.independent_fold import (
    Delivery,
    IndependentFold,
    Operation,
    delivery_row,
    operation_row,
)


def producer(settings: Settings) -> Producer:
    return Producer(
        {
            **connection_config(settings),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "partitioner": "murmur2_random",
        }
    )


def produce(
    settings: Settings,
    events: Iterable[OperationEvent],
    flush: bool = True,
    p: Producer | None = None,
) -> int:
    """Append events keyed by operation_id, as the SDK does (ownership and decisions on the
    execution topic, with the transitions they order); returns how many."""
    p = p or producer(settings)
    codec = default_codec()
    n = 0
    for event in events:
        topic = settings.delivery_topic if event.kind == "delivery" else settings.execution_topic
        while True:
            try:
                p.produce(topic, key=event.operation_id.encode(), value=codec.encode(event))
                break
            except BufferError:
                p.poll(0.05)
        n += 1
        if n % 1000 == 0:
            p.poll(0)
    if flush:
        assert p.flush(60) == 0, "broker did not acknowledge every record"
    return n


def workload_events(count: int, seed: int) -> list[Transition]:
    """The events of ``count`` operations of the demo's workload (``opledger.workload``), in
    order: what services would append, repeats included."""
    from opledger.workload import Workload  # noqa: PLC0415

    return [e for op in Workload(seed=seed).operations(count) for e in op]


def produce_raw(settings: Settings, topic: str, key: bytes | None, value: bytes | None) -> None:
    p = producer(settings)
    p.produce(topic, key=key, value=value)
    assert p.flush(30) == 0


def stored_offsets(settings: Settings) -> dict[tuple[str, int], int]:
    return progress.stored_offsets(settings.dsn, settings.projector_group)


def caught_up(settings: Settings) -> bool:
    topics = [settings.execution_topic, settings.delivery_topic, settings.policy_topic]
    ends = end_offsets(settings, topics)
    return progress.records_behind(ends, stored_offsets(settings)) == 0


def wait_caught_up(settings: Settings, timeout: float = 120.0) -> float:
    """Poll until the stored projector offsets reach the topics' ends; returns seconds waited."""
    started = time.monotonic()
    while not caught_up(settings):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"projector did not catch up within {timeout}s")
        time.sleep(0.2)
    return time.monotonic() - started


def project_in_process(settings: Settings, timeout: float = 120.0) -> BatchProjector:
    """Run the batch projector in this process until it has projected everything on the topics."""
    sink = PostgresProjection.connect(settings.dsn)
    projector = BatchProjector(settings, sink, default_codec(), Metrics.create(CollectorRegistry()))
    projector._consumer = projector._open()  # drive the loop step by step
    deadline = time.monotonic() + timeout
    try:
        while not caught_up(settings):
            if time.monotonic() > deadline:
                raise AssertionError("in-process projector did not catch up")
            for _ in range(20):
                projector.run_once()
    finally:
        projector.close()
        sink.close()
    return projector


@dataclass
class Expected:
    """The independent fold of everything on the topics (``tests/independent_fold.py``)."""

    operations: dict[str, Operation] = field(default_factory=dict)
    deliveries: dict[tuple[str, str], Delivery] = field(default_factory=dict)
    outcomes: dict[tuple[str, int, int], str] = field(default_factory=dict)
    #: operation id -> partition of its first execution event (agent_operations.kafka_partition)
    partitions: dict[str, int] = field(default_factory=dict)
    dead: set[tuple[str, int, int]] = field(default_factory=set)


def read_all(settings: Settings, topic: str) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of ``topic`` as (partition, offset, key, value), in partition-offset order."""
    return [(p, o, k, v) for p, o, k, v, _h in read_with_headers(settings, topic)]


def read_with_headers(
    settings: Settings, topic: str
) -> list[tuple[int, int, bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    """Every record of ``topic`` as (partition, offset, key, value, headers), in
    partition-offset order, read by a consumer of the tests' own (the outside verifier)."""
    ends = end_offsets(settings, [topic])
    consumer = Consumer(
        {
            **connection_config(settings),
            "group.id": "verifier",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for (_, p) in ends])
    remaining = sum(ends.values())
    records = []
    deadline = time.monotonic() + 120
    while remaining > 0 and time.monotonic() < deadline:
        for m in consumer.consume(10000, 1.0):
            if m.error():
                continue
            records.append((m.partition(), m.offset(), m.key(), m.value(), m.headers() or []))
            remaining -= 1
    consumer.close()
    assert remaining == 0, f"could not read {remaining} records back from {topic}"
    return sorted(records, key=lambda r: (r[0], r[1]))


# Written out here, not imported from the projector: the expected fold must not share the table
# it checks.
_KINDS = {"execution": {"execution", "ownership", "decision"}, "delivery": {"delivery"}}


def accepted_event(
    settings: Settings,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    partition: int | None = None,
) -> OperationEvent | None:
    """The event a record carries if the contract accepts it (it decodes, it is on its own
    machine's topic, keyed by its operation_id, on the partition that key maps to), else None:
    the projector must store exactly these and dead-letter everything else."""
    try:
        event = default_codec().decode(value or b"")
    except DecodeError:
        return None
    machine = "execution" if topic == settings.execution_topic else "delivery"
    if not isinstance(event, OperationEvent) or event.kind not in _KINDS[machine]:
        return None  # a record the codec reads, but not one of these topics' records
    if key != event.operation_id.encode():
        return None
    if partition is not None and partition != partition_for(key, settings.partitions):
        return None
    return event


def independent_fold(
    settings: Settings,
    refused: set[tuple[str, int, int]] | frozenset[tuple[str, int, int]] = frozenset(),
) -> Expected:
    """Fold every record of both topics in (topic, partition, offset) order, executions first,
    with the tests' own fold (``tests/independent_fold.py``), not the projector's.

    ``refused`` names records to treat as dead letters although they decode: those the test
    made the database refuse (the projector must isolate exactly those).
    """
    fold = IndependentFold()
    expected = Expected(operations=fold.operations, deliveries=fold.deliveries)
    for topic in (settings.execution_topic, settings.delivery_topic):
        for partition, offset, key, value in read_all(settings, topic):
            if (topic, partition, offset) in refused:
                expected.dead.add((topic, partition, offset))
                continue
            event = accepted_event(settings, topic, key, value, partition)
            if event is None:
                expected.dead.add((topic, partition, offset))
                continue
            if isinstance(event, ExecutionTransitioned):
                expected.partitions.setdefault(event.operation_id, partition)
            expected.outcomes[(topic, partition, offset)] = fold.fold(event)
    return expected


def assert_projection_matches(settings: Settings, expected: Expected) -> dict[str, int]:
    """Row-by-row comparison of the projections with the independent fold."""
    with psycopg.connect(settings.dsn) as conn:
        ops = conn.execute(
            "SELECT operation_id, tenant_id, actor_id, tool_name, request_hash, execution_state, "
            "attempt, provider_ref, result_ref, error, created_at, updated_at, state_entered_at, "
            "version, seen, lease_token, permit_attempt, permit_decision, parked, cancelled, "
            "decision, decided_at, controls FROM agent_operations"
        ).fetchall()
        deliveries = conn.execute(
            "SELECT operation_id, destination, tenant_id, actor_id, state, attempts, result_ref, "
            "next_attempt_at, error, created_at, updated_at, state_entered_at, version, seen, "
            "redrives, retired, round_started_at FROM deliveries"
        ).fetchall()
        history = conn.execute(
            'SELECT topic, partition, "offset", outcome FROM operation_history'
        ).fetchall()
        dead = conn.execute('SELECT topic, partition, "offset" FROM dead_letters').fetchall()
        anomalies = conn.execute('SELECT topic, partition, "offset" FROM anomalies').fetchall()
    actual_ops = {row[0]: tuple(row) for row in ops}
    want_ops = {k: operation_row(v) for k, v in expected.operations.items()}
    assert actual_ops.keys() == want_ops.keys(), "operation ids differ"
    for key, want in want_ops.items():
        assert actual_ops[key] == want, f"agent_operations row {key} differs"
    with psycopg.connect(settings.dsn) as conn:
        placed = dict(
            conn.execute("SELECT operation_id, kafka_partition FROM agent_operations").fetchall()
        )
    assert placed == {op: expected.partitions[op] for op in want_ops}, "kafka_partition differs"
    actual_del = {(row[0], row[1]): tuple(row) for row in deliveries}
    want_del = {k: delivery_row(v) for k, v in expected.deliveries.items()}
    assert actual_del.keys() == want_del.keys(), "delivery keys differ"
    for key, want in want_del.items():
        assert actual_del[key] == want, f"deliveries row {key} differs"
    actual_outcomes = {(t, p, o): outcome for t, p, o, outcome in history}
    assert len(history) == len(actual_outcomes)
    assert actual_outcomes == expected.outcomes, "history outcomes differ"
    assert {tuple(r) for r in dead} == expected.dead
    assert {tuple(r) for r in anomalies} == {
        k for k, v in expected.outcomes.items() if v == "anomaly"
    }
    return {
        "operations": len(actual_ops),
        "deliveries": len(actual_del),
        "history": len(history),
        "duplicates": sum(1 for v in expected.outcomes.values() if v == "duplicate"),
        "anomalies": len(anomalies),
        "dead": len(dead),
    }


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    """The OPLEDGER_* environment that rebuilds ``settings`` in a child process."""
    import os  # noqa: PLC0415  # only the process-spawning helpers need it

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPLEDGER_")}
    env.update(
        OPLEDGER_HOME=str(settings.home),
        OPLEDGER_KAFKA_BOOTSTRAP=settings.bootstrap_servers,
        # No principal: a child signs in as its command's role (ledger.kafka_access), as it
        # would on the stack; the test process itself is the broker's admin.
        OPLEDGER_KAFKA_SECURITY=settings.kafka_security_protocol,
        OPLEDGER_KAFKA_PASSWORD_DIR=str(settings.kafka_password_directory),
        OPLEDGER_KAFKA_CA_FILE=settings.kafka_ca_file,
        OPLEDGER_TOPIC_PREFIX=settings.topic_prefix,
        OPLEDGER_PARTITIONS=str(settings.partitions),
        OPLEDGER_REPLICATION_FACTOR=str(settings.replication_factor),
        # No role: a child signs in to the database as its command's role (decision 034).
        OPLEDGER_PG_DSN=settings.pg_dsn,
        OPLEDGER_PG_DATABASE=settings.pg_database,
        OPLEDGER_PG_PORT=str(settings.pg_port),
        OPLEDGER_PG_PASSWORD_DIR=str(settings.pg_passfile_path.parent),
        OPLEDGER_PROJECTOR_GROUP=settings.projector_group,
        OPLEDGER_PROJECTOR_BATCH=str(settings.projector_batch),
        OPLEDGER_PROJECTOR_WEB_PORT=str(settings.projector_web_port),
        OPLEDGER_RECOVERY_WEB_PORT=str(settings.recovery_web_port),
        OPLEDGER_RECOVERY_GROUP=settings.recovery_group,
        OPLEDGER_RECOVERY_UNLEASED_GRACE_S=str(settings.recovery_unleased_grace_s),
        OPLEDGER_DELIVERY_GROUP=settings.delivery_group,
        OPLEDGER_DELIVERY_WEB_PORT=str(settings.delivery_web_port),
        OPLEDGER_DELIVERY_INTERVAL_MS=str(settings.delivery_interval_ms),
        OPLEDGER_DELIVERY_SCHEDULE=settings.delivery_schedule,
        OPLEDGER_DELIVERY_MAX_ATTEMPTS=str(settings.delivery_max_attempts),
        OPLEDGER_DELIVERY_HORIZON_S=str(settings.delivery_horizon_s),
        OPLEDGER_DELIVERY_ALLOW_NETWORKS=settings.delivery_allow_networks,
        OPLEDGER_FAKE_PROVIDER_URL=settings.fake_provider_url,
        OPLEDGER_RECOVERY_INTERVAL_MS=str(settings.recovery_interval_ms),
        OPLEDGER_CONSUMER_NAME=settings.consumer_name,
        OPLEDGER_CONSUMER_WEB_PORT=str(settings.consumer_web_port),
        # Empty: the default (database opledger_consumer on the local server).
        OPLEDGER_CONSUMER_PG_DSN=settings.consumer_pg_dsn,
        OPLEDGER_POLICY_SIGNING_KEY_FILE=str(settings.policy_signing_key_path),
        OPLEDGER_POLICY_TRUSTED_KEYS_FILE=str(settings.policy_trusted_keys_path),
        OPLEDGER_SECRETS_KEY_FILE=str(settings.secrets_key_path),
        OPLEDGER_FAKE_PROVIDER_CONTROL_TOKEN_FILE=settings.fake_provider_control_token_file,
        OPLEDGER_LOG_LEVEL="INFO",
    )
    env.update(extra)
    return env


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999 here).

    A port from bind(0) lies inside that range, so while its server is down a client
    redialing it (librdkafka does, every backoff) can be handed the same number as its
    own local port and connect to itself, holding the port the restarted server needs.
    """
    import random  # noqa: PLC0415
    import socket  # noqa: PLC0415

    for _ in range(200):
        port = random.randint(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port between 20000 and 32000")


_HANDED_OUT: set[int] = set()


def private_stack_settings(base: Settings, home: Path) -> Settings:
    """``base`` moved to a stack of its own in ``home``: a broker and a database on free ports,
    reached through them (no inherited bootstrap or DSN)."""
    return base.with_(
        home=home,
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        pg_port=free_port(),
        kafka_bootstrap="",
        pg_dsn="",
    )


def grant(
    settings: Settings,
    tenant_id: str,
    *,
    actor: str = "*",
    tool: str = "*",
    repeat_safe: bool = False,
    revoke: bool = False,
    destinations: tuple[str, ...] = (),
) -> str:
    """Append a grant (or its revocation) to the policy topic, as `opledger policy grant`
    does; returns its event id (the policy version decisions cite). Project it before use."""
    from datetime import UTC, datetime  # noqa: PLC0415
    from os import urandom  # noqa: PLC0415

    from ledger.domain.events import PolicyChange, PolicyChanged  # noqa: PLC0415
    from ledger.domain.ids import event_id  # noqa: PLC0415

    change = PolicyChanged(
        event_id=event_id(int(time.time() * 1000), urandom(10)),
        tenant_id=tenant_id,
        actor_id="test-operator",
        occurred_at=datetime.now(UTC),
        change=PolicyChange.REVOKE if revoke else PolicyChange.GRANT,
        principal=actor,
        tool_name=tool,
        repeat_safe=repeat_safe and not revoke,
        destinations=() if revoke else tuple(destinations),
    )
    change = signed(settings, change)
    p = producer(settings)
    p.produce(settings.policy_topic, key=change.subject_key(), value=default_codec().encode(change))
    assert p.flush(30) == 0
    return change.event_id


def signed(settings: Settings, change: PolicyChanged) -> PolicyChanged:
    """``change`` signed by the operator key of ``settings``' stack (created there if missing,
    as `opledger stack up` does): what `opledger policy` writes, and the only kind of change the
    projector folds (decision 032)."""
    from ledger.policy_keys import ensure_local_keys  # noqa: PLC0415

    return ensure_local_keys(settings).sign(change)


_policy_sequence = iter(range(1, 1_000_000_000))


def policy_change(
    change: PolicyChange = PolicyChange.GRANT,
    *,
    actor_id: str = "test:ops",
    tenant_id: str = "acme",
    principal: str = "agent-7",
    tool_name: str = "send_email",
    **fields: Any,
) -> PolicyChanged:
    """A policy event as the CLI writes it, with an event id unique in this process; ``fields``
    set the rest (expiry, destinations, a credential...)."""
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "event_id": event_id(
            int(now.timestamp() * 1000), next(_policy_sequence).to_bytes(10, "big")
        ),
        "tenant_id": tenant_id,
        "actor_id": actor_id,
        "occurred_at": now,
        "change": change,
        "principal": principal,
        "tool_name": tool_name,
    }
    values.update(fields)  # any of them, the event id and time included
    return PolicyChanged(**values)


#: An operation id anywhere in a label value ("op_" + a ULID), or a webhook secret's prefix.
_IDENTIFYING = re.compile(rf"op_{ULID_PATTERN}|whsec_")


def assert_no_identifying_labels(source: str | CollectorRegistry) -> int:
    """Fail if any label value of a ``/metrics`` text or a registry holds an operation id or a
    webhook secret (README, Metrics: "No label ever holds an operation id or a tenant's
    secret"); returns how many samples were checked."""
    families = (
        text_string_to_metric_families(source) if isinstance(source, str) else source.collect()
    )
    checked = 0
    for family in families:
        for sample in family.samples:
            checked += 1
            for label, value in sample.labels.items():
                assert not _IDENTIFYING.search(value), (
                    f"{sample.name}{{{label}={value!r}}}: a label holds an operation id or a secret"
                )
    return checked


@contextmanager
def recovery_worker(
    settings: Settings, providers: Sequence[Any], allow: Callable[[Any], Any]
) -> Iterator[Any]:
    """A recovery worker in this process, as ``opledger recover run`` wires it, with the policy
    ``allow`` (one request -> one decision); closed afterwards."""
    from ledger.history import HistoryReader  # noqa: PLC0415
    from ledger.leases import LeaseStore  # noqa: PLC0415
    from ledger.log import KafkaTransport  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415
    from ledger.results import ResultStore  # noqa: PLC0415
    from processors.recovery.worker import RecoveryWorker  # noqa: PLC0415

    pool = open_pool(settings.dsn, name="test-recovery")
    transport = KafkaTransport(settings)
    history = HistoryReader(settings, pool)
    worker = RecoveryWorker(
        settings,
        pool=pool,
        transport=transport,
        leases=LeaseStore(pool, "test-recovery"),
        history=history,
        results=ResultStore(pool),
        policy=lambda requests: [allow(r) for r in requests],
        providers=list(providers),
        metrics=Metrics.create(CollectorRegistry()),
    )
    try:
        yield worker
    finally:
        worker.close()
        history.close()
        transport.close()
        pool.close()
