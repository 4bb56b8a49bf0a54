"""Seed rule 2 and failure row 5 from the consumer's side, with real processes and SIGKILL:
``opledger consumer run`` (and ``consumer queue``) killed exactly at a named boundary, or at
random moments while senders keep retrying as a delivery worker does. Afterwards nothing is
applied twice, nothing is lost, and every key reaches the key store."""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from consumers.keystore import decode_entry
from ledger.kafka import connection_config
from ledger.log import end_offsets
from ledger.settings import Settings
from tests.consumer_support import DESTINATION, SECRET, event_body, new_op_id, signed_headers
from tests.support import env_for, free_port, read_all

ROOT = Path(__file__).resolve().parents[2]


class ConsumerProcess:
    """One ``opledger consumer ...`` child process at a time, restartable."""

    def __init__(self, settings: Settings, logs: Path, *argv: str) -> None:
        self.settings = settings
        self.logs = logs
        self.argv = argv
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, fault: str = "") -> None:
        env = env_for(
            self.settings,
            PYTHONPATH=str(ROOT),
            OPLEDGER_CONSUMER_PG_DSN=self.settings.consumer_dsn,
            OPLEDGER_CONSUMER_SECRETS=SECRET,
            OPLEDGER_CONSUMER_WEB_PORT=str(self.port),
            OPLEDGER_FAULT_POINTS=fault,
        )
        self.starts += 1
        log = (self.logs / f"consumer-{self.starts}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "opledger.cli", "consumer", *self.argv],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/healthz"
        while True:
            assert self.process is not None and self.process.poll() is None, self.tail()
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
            assert time.monotonic() < deadline, f"consumer not healthy: {self.tail()}"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def tail(self) -> str:
        text = (self.logs / f"consumer-{self.starts}.log").read_text(errors="replace")
        return text[-3000:]


@pytest.fixture
def consumer_settings(isolated: Settings) -> Settings:
    return isolated.with_(consumer_pg_dsn=isolated.dsn, consumer_secrets=SECRET)


@pytest.fixture
def receiver_process(consumer_settings: Settings, tmp_path: Path) -> Iterator[ConsumerProcess]:
    process = ConsumerProcess(consumer_settings, tmp_path, "run")
    try:
        yield process
    finally:
        process.kill()


def post_event(port: int, op: str, body: bytes | None = None) -> tuple[int, dict[str, str]]:
    """One signed POST /events; raises OSError/HTTPException when the connection dies."""
    body = event_body(op) if body is None else body
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/events", body=body, headers=signed_headers(op, body))
        response = conn.getresponse()
        response.read()
        return response.status, dict(response.getheaders())
    finally:
        conn.close()


def inbox(settings: Settings) -> dict[str, bool]:
    """operation id -> published, for every inbox row."""
    with psycopg.connect(settings.consumer_dsn) as conn:
        rows = conn.execute("SELECT operation_id, published FROM consumer_inbox").fetchall()
    return {op: published for op, published in rows}


def changes(settings: Settings) -> Counter[str]:
    with psycopg.connect(settings.consumer_dsn) as conn:
        rows = conn.execute("SELECT operation_id FROM consumer_applied_changes").fetchall()
    return Counter(row[0] for row in rows)


def key_store(settings: Settings) -> set[str]:
    """Operation ids on the key store (every record read back from Kafka)."""
    found = set()
    for _partition, _offset, key, value in read_all(settings, settings.consumer_keys_topic):
        assert key is not None and value is not None
        found.add(decode_entry(key, value).operation_id)
    return found


def wait_until(condition: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]  # a zero-argument callable
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def queue_metric(port: int, name: str, label: str) -> dict[str, float]:
    """One counter of a process's ``/metrics``, summed by the value of ``label``."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels[label]
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


@pytest.mark.parametrize(
    "fault", ["consumer.after_commit_before_publish", "consumer.after_commit_before_response"]
)
def test_killed_between_commit_and_answer_applies_once_and_loses_no_key(
    consumer_settings: Settings, receiver_process: ConsumerProcess, fault: str
) -> None:
    consumer = receiver_process
    consumer.start(fault=f"{fault}:kill@2")
    consumer.wait_healthy()
    before = new_op_id()
    assert post_event(consumer.port, before)[0] == 202  # the first pass of the point is survived
    op = new_op_id()
    with pytest.raises((OSError, http.client.HTTPException)):
        post_event(consumer.port, op)  # the process dies with the request in its hands
    assert consumer.wait_exit() == -signal.SIGKILL, consumer.tail()

    # The change was committed with its inbox row, the key not acknowledged on the key store.
    assert changes(consumer_settings) == Counter({before: 1, op: 1})
    assert inbox(consumer_settings)[op] is False
    if fault == "consumer.after_commit_before_publish":
        assert op not in key_store(consumer_settings), "the key was never handed to Kafka"

    consumer.start()
    consumer.wait_healthy()
    # Nothing lost: the restart's sweep republishes the key the crash left unpublished.
    wait_until(lambda: inbox(consumer_settings).get(op) is True, "key not republished")
    assert op in key_store(consumer_settings)
    # The sender never got an answer and resends: a duplicate, not applied again.
    status, headers = post_event(consumer.port, op)
    assert (status, headers.get("Idempotent-Replayed")) == (202, "true")
    assert post_event(consumer.port, op, event_body(op, tenant="other"))[0] == 422
    after = new_op_id()
    assert post_event(consumer.port, after)[0] == 202
    assert changes(consumer_settings) == Counter({before: 1, op: 1, after: 1})


def test_killed_at_random_moments_under_retrying_senders(
    consumer_settings: Settings, receiver_process: ConsumerProcess
) -> None:
    consumer = receiver_process
    consumer.start()
    consumer.wait_healthy()
    ops = [new_op_id() for _ in range(3000)]
    answered: dict[str, int] = {}
    attempts: Counter[str] = Counter()
    lock = threading.Lock()
    done = threading.Event()

    def sender(mine: list[str]) -> None:
        for op in mine:
            body = event_body(op)
            while not done.is_set():  # retry until a 2xx, as the delivery worker does
                attempts[op] += 1
                try:
                    status, _ = post_event(consumer.port, op, body)
                except (OSError, http.client.HTTPException):
                    time.sleep(0.05)
                    continue
                if status == 202:
                    with lock:
                        answered[op] = status
                    break
                assert status in (409, 503), (op, status)
                time.sleep(0.05)

    senders = [threading.Thread(target=sender, args=(ops[i::4],)) for i in range(4)]
    for thread in senders:
        thread.start()
    rng = random.Random(7)
    kills = 0
    try:
        while kills < 4 and any(t.is_alive() for t in senders):
            time.sleep(rng.uniform(0.2, 0.5))
            consumer.kill()  # SIGKILL, wherever the process is
            kills += 1
            consumer.start()
            consumer.wait_healthy()
        for thread in senders:
            thread.join(timeout=180)
    finally:
        done.set()
    assert all(not t.is_alive() for t in senders), "senders did not finish"
    assert kills == 4 and set(answered) == set(ops)
    # Nothing applied twice, nothing lost; every key reaches the key store after the last start.
    assert changes(consumer_settings) == Counter(dict.fromkeys(ops, 1))
    wait_until(lambda: all(inbox(consumer_settings).values()), "keys left unpublished")
    assert set(inbox(consumer_settings)) == set(ops)
    assert key_store(consumer_settings) == set(ops)
    assert sum(attempts.values()) > len(ops), "no request was ever retried: no kill landed"


def test_a_queue_consumer_killed_before_its_offset_commit_applies_once(
    consumer_settings: Settings, tmp_path: Path
) -> None:
    topic = f"{consumer_settings.topic_prefix}.queue.crm"
    admin = AdminClient({**connection_config(consumer_settings)})
    for future in admin.create_topics([NewTopic(topic, num_partitions=3)]).values():
        future.result(30)
    ops = [new_op_id() for _ in range(60)]
    producer = Producer({**connection_config(consumer_settings)})
    for op in ops:
        headers: list[tuple[str, str | bytes | None]] = [
            ("Idempotency-Key", op.encode()),
            ("webhook-id", f"{op}:{DESTINATION}".encode()),
        ]
        producer.produce(topic, key=op.encode(), value=event_body(op), headers=headers)
    assert producer.flush(30) == 0
    group = f"{consumer_settings.topic_prefix}-consumer-reference"

    def committed() -> dict[tuple[str, int], int]:
        reader = Consumer({**connection_config(consumer_settings), "group.id": group})
        try:
            ends = end_offsets(consumer_settings, [topic])
            tps = reader.committed([TopicPartition(topic, p) for (_, p) in ends], timeout=10)
            return {(tp.topic, tp.partition): tp.offset for tp in tps}
        finally:
            reader.close()

    queue = ConsumerProcess(
        consumer_settings, tmp_path, "queue", "--topic", topic, "--every-tenant"
    )
    try:
        queue.start(fault="consumer.queue_after_commit_before_offsets:kill")
        assert queue.wait_exit(timeout=120) == -signal.SIGKILL, queue.tail()
        applied_before = changes(consumer_settings)
        assert applied_before and all(n == 1 for n in applied_before.values())
        assert all(offset < 0 for offset in committed().values()), "offsets were committed"

        metrics_port = free_port()
        queue.argv = (*queue.argv, "--metrics-port", str(metrics_port))
        queue.start()  # Kafka redelivers the batch whose offsets were never committed
        ends = end_offsets(consumer_settings, [topic])
        wait_until(lambda: committed() == ends, f"queue did not catch up: {queue.tail()}", 120)
        # What the restarted instance says on /metrics: every record handled once, and the
        # records the killed one had applied recognised as duplicates, not applied again.
        outcomes = queue_metric(metrics_port, "opledger_consumer_queue_records_total", "outcome")
        expected = {"accepted": len(ops) - len(applied_before), "duplicate": len(applied_before)}
        assert outcomes == {outcome: n for outcome, n in expected.items() if n}
    finally:
        queue.kill()
    assert changes(consumer_settings) == Counter(dict.fromkeys(ops, 1))
    wait_until(lambda: set(inbox(consumer_settings)) == set(ops), "inbox incomplete")
