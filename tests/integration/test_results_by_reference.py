"""Results over the inline limit delivered by reference (decision 015), end to end with the real
processes: ``opledger projector run``, ``opledger deliver run`` (which serves ``GET /results``)
and ``opledger consumer run`` (which fetches it, checks it and applies it once). Then the
endpoint is probed as an attacker would: unsigned, stale, another destination's or another
tenant's signature."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from standardwebhooks import Webhook

from consumers.queue import EVERY_TENANT, QueueConsumer, drain
from consumers.runtime import ConsumerRuntime
from ledger.destinations import DestinationStore, Kind
from ledger.domain.ids import canonical_json
from ledger.kafka import connection_config
from ledger.pg import open_pool
from ledger.result_fetch import result_url, sign_fetch
from ledger.settings import Settings
from producers import TransitionRecorder
from tests.process_support import ROOT, kill, start_cli, wait_http
from tests.support import assert_no_identifying_labels, env_for, free_port, grant

pytestmark = pytest.mark.integration

SECRET = "whsec_" + base64.b64encode(b"by-reference-secret-012345").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"another-tenants-secret-0123").decode()
TENANT = "acme"
ACTOR = "agent-7"
INLINE_MAX = 64 * 1024


def _add(settings: Settings, tenant: str, name: str, url: str, secret: str) -> None:
    with open_pool(settings.dsn, name="by-reference-destinations", max_size=1) as pool:
        DestinationStore(pool, settings).add(
            tenant_id=tenant,
            name=name,
            kind=Kind.WEBHOOK,
            target=url,
            tools=["*"],
            changed_by="test",
            secret=secret,
            timeout_ms=5000,
        )


def _states(settings: Settings) -> dict[str, str]:
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute("SELECT operation_id, state FROM deliveries").fetchall()
    return dict(rows)


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read(), answer.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def _metric(port: int, name: str, label: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    assert assert_no_identifying_labels(text) > 0
    found = re.search(rf'^{name}\{{outcome="{label}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class Processes:
    """The real workers of one test: ``opledger projector run``, ``consumer run`` and
    ``deliver run``, each SIGKILLed at the end (or when a test says)."""

    def __init__(self, settings: Settings, env: dict[str, str], ports: dict[str, int], logs: Path):
        self.settings, self.ports = settings, ports
        self._env, self._logs = env, logs
        self._running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        argv = {
            "projector": ["projector", "run"],
            "consumer": ["consumer", "run"],
            "delivery": ["deliver", "run"],
        }[name]
        self._running[name] = start_cli(argv, self._env, self._logs / f"{name}.log")
        wait_http(f"http://127.0.0.1:{self.ports[name]}/healthz")

    def kill(self, name: str) -> None:
        kill(self._running.pop(name))

    def kill_all(self) -> None:
        for name in list(self._running):
            self.kill(name)


@pytest.fixture
def processes(isolated: Settings, tmp_path: Path) -> Iterator[Processes]:
    ports = {name: free_port() for name in ("projector", "delivery", "consumer")}
    settings = isolated.with_(
        consumer_pg_dsn=isolated.dsn,
        consumer_secrets=SECRET,
        delivery_web_port=ports["delivery"],
        delivery_inline_max_bytes=INLINE_MAX,
    )
    env = env_for(
        settings,
        PYTHONPATH=str(ROOT),
        OPLEDGER_PROJECTOR_WEB_PORT=str(ports["projector"]),
        OPLEDGER_DELIVERY_WEB_PORT=str(ports["delivery"]),
        OPLEDGER_DELIVERY_GROUP=f"{settings.topic_prefix}-delivery",
        OPLEDGER_DELIVERY_SCHEDULE="500ms",
        OPLEDGER_DELIVERY_INLINE_MAX_BYTES=str(INLINE_MAX),
        OPLEDGER_CONSUMER_PG_DSN=settings.dsn,
        OPLEDGER_CONSUMER_SECRETS=SECRET,
        OPLEDGER_CONSUMER_WEB_PORT=str(ports["consumer"]),
    )
    running = Processes(settings, env, ports, tmp_path)
    try:
        for name in ("projector", "consumer", "delivery"):
            running.start(name)
        yield running
    finally:
        running.kill_all()


def test_a_large_result_is_fetched_by_the_receiver_checked_and_applied_once(
    processes: Processes,
) -> None:
    settings, ports = processes.settings, processes.ports
    grant(settings, TENANT, actor=ACTOR, tool="render_report", destinations=("reference",))
    _add(settings, TENANT, "reference", f"http://127.0.0.1:{ports['consumer']}/events", SECRET)
    large = os.urandom(INLINE_MAX) * 5 + b"tail"  # 320 KiB and a bit: over the inline limit
    small = b'{"pages": 1}'
    with TransitionRecorder.connect(settings, owner="by-reference-test") as service:
        ops = {}
        for label, result, content_type in (
            ("large", large, "application/pdf"),
            ("small", small, "application/json"),
        ):
            op = service.intent(TENANT, ACTOR, "render_report", {"which": label})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, result, content_type=content_type)
            ops[label] = op.operation_id
    deadline = time.monotonic() + 90
    while {_states(settings).get(op) for op in ops.values()} != {"ACKED"}:
        assert time.monotonic() < deadline, f"not both ACKED: {_states(settings)}"
        time.sleep(0.3)

    with psycopg.connect(settings.dsn) as conn:
        applied = dict(
            conn.execute(
                "SELECT operation_id, result_bytes FROM consumer_applied_changes "
                "WHERE operation_id = ANY(%s)",
                (list(ops.values()),),
            ).fetchall()
        )
        stored = conn.execute(
            "SELECT result_ref FROM deliveries WHERE operation_id = %s", (ops["large"],)
        ).fetchone()
    assert applied == {ops["large"]: len(large), ops["small"]: len(small)}
    assert stored == ("sha256:" + hashlib.sha256(large).hexdigest(),)
    # Only the large one went by reference, and the receiver fetched it once.
    assert _metric(ports["delivery"], "opledger_delivery_result_fetches_total", "served") == 1

    url = result_url(settings.results_base_url, TENANT, "reference", ops["large"])
    now = datetime.now(UTC)
    signed = sign_fetch([SECRET], TENANT, "reference", ops["large"], now)
    status, body, content_type = _get(url, signed)
    assert (status, body, content_type) == (200, large, "application/pdf")

    # Unsigned, stale, or signed with a secret that is not this destination's: 401.
    assert _get(url, {})[0] == 401
    stale = sign_fetch([SECRET], TENANT, "reference", ops["large"], now - timedelta(minutes=6))
    assert _get(url, stale)[0] == 401
    assert _get(url, sign_fetch([OTHER_SECRET], TENANT, "reference", ops["large"], now))[0] == 401
    # A destination that does not exist answers like a bad signature: nothing to learn.
    ghost = result_url(settings.results_base_url, TENANT, "ghost", ops["large"])
    assert _get(ghost, sign_fetch([SECRET], TENANT, "ghost", ops["large"], now))[0] == 401

    # Another destination of the same tenant, correctly signed, was not delivered this result.
    _add(settings, TENANT, "billing", "http://127.0.0.1:9/events", SECRET)
    billing = result_url(settings.results_base_url, TENANT, "billing", ops["large"])
    assert _get(billing, sign_fetch([SECRET], TENANT, "billing", ops["large"], now))[0] == 404
    # Another tenant with a destination of the same name and its own secret: not its result.
    _add(settings, "globex", "reference", "http://127.0.0.1:9/events", OTHER_SECRET)
    theirs = result_url(settings.results_base_url, "globex", "reference", ops["large"])
    probe = sign_fetch([OTHER_SECRET], "globex", "reference", ops["large"], now)
    status, body, content_type = _get(theirs, probe)
    assert status == 404 and large[:64] not in body
    assert content_type.startswith("application/problem+json")
    # A receiver rotating its secret signs with both; the one the ledger holds matches.
    rotating = sign_fetch([OTHER_SECRET, SECRET], TENANT, "reference", ops["large"], now)
    assert _get(url, rotating)[0] == 200
    assert _get(url.replace("tenant=acme", "tenant=%00"), signed)[0] == 400

    # The receiver's side: a reference it cannot fetch now is refused for now (503, the sender
    # retries), one naming another result is refused for good (422); neither is applied.
    for base, other_op, status in (
        ("http://127.0.0.1:9", None, 503),
        (settings.results_base_url, ops["small"], 422),
    ):
        op_id = "op_01JD8Z8Z8Z8Z8Z8Z8Z8Z8Z8Z8" + str(status)[0]
        body = canonical_json(
            {
                "operation_id": op_id,
                "tenant_id": TENANT,
                "tool_name": "render_report",
                "destination": "reference",
                "result_ref": "sha256:" + hashlib.sha256(large).hexdigest(),
                "content_type": "application/pdf",
                "result_url": result_url(base, TENANT, "reference", other_op or op_id),
                "result_size": len(large),
            }
        )
        headers = {"Content-Type": "application/json", "Idempotency-Key": op_id}
        headers.update(
            {
                "webhook-id": f"{op_id}:reference",
                "webhook-timestamp": str(int(now.timestamp())),
                "webhook-signature": Webhook(SECRET).sign(f"{op_id}:reference", now, body.decode()),
            }
        )
        post = urllib.request.Request(
            f"http://127.0.0.1:{ports['consumer']}/events", data=body, headers=headers
        )
        try:
            with urllib.request.urlopen(post, timeout=30) as answer:
                got = answer.status
        except urllib.error.HTTPError as exc:
            got = exc.code
        assert got == status, body
    with psycopg.connect(settings.dsn) as conn:
        count = conn.execute("SELECT count(*) FROM consumer_applied_changes").fetchone()
    assert count == (2,)

    # A disabled destination, correctly signed, is told so (403) and gets nothing.
    with open_pool(settings.dsn, name="by-reference-disable", max_size=1) as pool:
        DestinationStore(pool, settings).set_enabled(
            TENANT, "reference", enabled=False, changed_by="test", reason="probe"
        )
    status, body, _type = _get(url, sign_fetch([SECRET], TENANT, "reference", ops["large"], now))
    assert status == 403 and large[:64] not in body


QUEUE_SECRET = "whsec_" + base64.b64encode(b"queue-fetch-secret-0123456").decode()


def _fetches(consumer: QueueConsumer, outcome: str) -> float:
    value = consumer.runtime.registry.get_sample_value(
        "opledger_consumer_result_fetches_total",
        {"consumer": consumer.runtime.name, "outcome": outcome},
    )
    return value or 0.0


def test_a_queue_with_a_fetch_secret_gets_large_results_by_reference(
    processes: Processes,
) -> None:
    """Decision 016: a queue destination with a fetch secret gets a large result by reference;
    its consumer fetches it signed with that secret, checks it and applies it once. Without
    the secret a consumer refuses the reference (and applies the rest); with the wrong one, or
    while no delivery worker serves, it reads the result's partition again, committing nothing
    of it, instead of skipping what it could not fetch."""
    settings, ports = processes.settings, processes.ports
    topic = f"{settings.topic_prefix}.results-queue"
    admin = AdminClient({**connection_config(settings)})
    for future in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        future.result(timeout=30)
    grant(settings, TENANT, actor=ACTOR, tool="export_csv", destinations=("results-queue",))
    with open_pool(settings.dsn, name="by-reference-queue", max_size=1) as pool:
        DestinationStore(pool, settings).add(
            tenant_id=TENANT,
            name="results-queue",
            kind=Kind.QUEUE,
            target=topic,
            tools=["export_csv"],
            changed_by="test",
            secret=QUEUE_SECRET,
        )
    large = os.urandom(INLINE_MAX) * 3 + b"tail"
    small = b"a,b\n1,2\n"
    with TransitionRecorder.connect(settings, owner="by-reference-queue-test") as service:
        ops = {}
        for label, result in (("large", large), ("small", small)):
            op = service.intent(TENANT, ACTOR, "export_csv", {"which": label})
            service.dispatched(op, provider_ref=op.operation_id)
            service.succeeded(op, result, content_type="text/csv")
            ops[label] = op.operation_id
    deadline = time.monotonic() + 90
    while {_states(settings).get(op) for op in ops.values()} != {"ACKED"}:
        assert time.monotonic() < deadline, f"not both ACKED: {_states(settings)}"
        time.sleep(0.3)

    def applied(consumer: str = "billing") -> dict[str, int]:
        """Operation -> the bytes ``consumer`` applied."""
        with psycopg.connect(settings.dsn) as conn:
            rows = conn.execute(
                "SELECT operation_id, result_bytes FROM consumer_applied_changes "
                "WHERE operation_id = ANY(%s) AND consumer = %s",
                (list(ops.values()), consumer),
            ).fetchall()
        return {op: n for op, n in rows}

    partition = _partitions_of(settings, topic)
    apart = partition[ops["small"]] != partition[ops["large"]]
    group = f"{settings.topic_prefix}-queue"
    # The wrong secret: the fetch is refused with 401, so nothing of the large result's
    # partition is recorded and its offset stays uncommitted, however long it runs. The small
    # result goes on if it is on the other partition (the operation ids are random).
    wrong = QueueConsumer(
        ConsumerRuntime(settings, name="queue-wrong"),
        topic,
        group_id=f"{group}-wrong",
        fetch_secrets=[OTHER_SECRET],
        tenants=EVERY_TENANT,
    )
    try:
        runner = threading.Thread(target=wrong.run)
        runner.start()
        deadline = time.monotonic() + 30
        while _fetches(wrong, "unavailable") < 3:
            assert time.monotonic() < deadline, "the wrong secret's fetch was not retried"
            time.sleep(0.2)
        wrong.stop()
        runner.join(30)
        assert not runner.is_alive()
        assert _fetches(wrong, "fetched") == 0
        assert applied("queue-wrong") == ({ops["small"]: len(small)} if apart else {})
        reader = Consumer({**connection_config(settings), "group.id": f"{group}-wrong"})
        try:
            committed = reader.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
        finally:
            reader.close()
        offsets = {tp.partition: tp.offset for tp in committed}
        assert offsets[partition[ops["large"]]] < 0, committed
        if apart:
            assert offsets[partition[ops["small"]]] == 1, committed
    finally:
        wrong.stop()
        wrong.runtime.close()

    # No secret: the reference is refused and skipped; the small result is applied.
    bare = QueueConsumer(
        ConsumerRuntime(settings, name="billing"), topic, group_id=group, tenants=EVERY_TENANT
    )
    try:
        bare.open()
        drain(bare)
        bare.close()
        assert _fetches(bare, "refused") == 1
    finally:
        bare.runtime.close()
    assert applied() == {ops["small"]: len(small)}

    # The destination's secret, in another group that reads both again, while no delivery
    # worker serves (SIGKILLed): the consumer reads the batch again and again; once a worker
    # serves, the large result is fetched, checked and applied, and the small one is a
    # duplicate, not applied twice.
    processes.kill("delivery")
    right = QueueConsumer(
        ConsumerRuntime(settings, name="billing"),
        topic,
        group_id=f"{group}-right",
        fetch_secrets=[QUEUE_SECRET],
        tenants=EVERY_TENANT,
    )
    runner = threading.Thread(target=right.run)
    try:
        runner.start()
        deadline = time.monotonic() + 30
        while _fetches(right, "unavailable") < 2:
            assert time.monotonic() < deadline, "the fetch was not tried again"
            time.sleep(0.2)
        assert applied() == {ops["small"]: len(small)}
        processes.start("delivery")
        deadline = time.monotonic() + 60
        while ops["large"] not in applied():
            assert time.monotonic() < deadline, "the large result never applied"
            time.sleep(0.2)
    finally:
        right.stop()
        runner.join(30)
        right.runtime.close()
    assert not runner.is_alive()
    assert _fetches(right, "fetched") == 1
    records = right.runtime.registry
    for outcome in ("accepted", "duplicate"):  # the large one, then the small one seen again
        sample = {"consumer": "billing", "outcome": outcome}
        assert records.get_sample_value("opledger_consumer_queue_records_total", sample) == 1
    assert applied() == {ops["large"]: len(large), ops["small"]: len(small)}
    # The new worker served exactly the one fetch.
    assert _metric(ports["delivery"], "opledger_delivery_result_fetches_total", "served") == 1
    with psycopg.connect(settings.dsn) as conn:
        changes = conn.execute(
            "SELECT count(*) FROM consumer_applied_changes WHERE operation_id = ANY(%s)",
            (list(ops.values()),),
        ).fetchone()
    assert changes == (3 if apart else 2,), "billing's two, and queue-wrong's small one if apart"


def _partitions_of(settings: Settings, topic: str) -> dict[str, int]:
    """Operation id -> the partition of its record on ``topic``."""
    reader = Consumer(
        {
            **connection_config(settings),
            "group.id": "unused",
            "fetch.max.bytes": 8 << 20,
        }
    )
    found: dict[str, int] = {}
    try:
        reader.assign([TopicPartition(topic, p, 0) for p in (0, 1)])
        deadline = time.monotonic() + 30
        while len(found) < 2:
            assert time.monotonic() < deadline, found
            message = reader.poll(0.5)
            if message is not None and message.error() is None:
                found[message.key().decode()] = message.partition()
    finally:
        reader.close()
    return found


def test_destinations_add_gives_a_queue_a_fetch_secret_only_when_asked(isolated: Settings) -> None:
    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "opledger.cli", "destinations", "add", "--tenant", TENANT,
             "--tool", "*", *argv],
            env=env_for(isolated),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip

    with_secret = cli("--name", "q1", "--topic", "acme.q1", "--fetch-secret")
    without = cli("--name", "q2", "--topic", "acme.q2")
    webhook = cli("--name", "h1", "--url", "http://127.0.0.1:9/events", "--fetch-secret")
    assert with_secret.returncode == 0, with_secret.stderr
    assert without.returncode == 0, without.stderr
    assert webhook.returncode == 2 and "--fetch-secret is for a queue" in webhook.stderr
    printed = re.findall(r"fetch secret \(configure the queue's consumer with it\): (\S+)",
                         with_secret.stdout)  # fmt: skip
    assert "secret" not in without.stdout
    with open_pool(isolated.dsn, name="fetch-secret-cli", max_size=1) as pool:
        stored = DestinationStore(pool, isolated).get_many(
            [(TENANT, "q1"), (TENANT, "q2"), (TENANT, "h1")]
        )
    assert set(stored) == {(TENANT, "q1"), (TENANT, "q2")}
    assert printed == [stored[(TENANT, "q1")].secret]
    assert stored[(TENANT, "q2")].secret is None
