"""The delivery worker against the real broker, database and HTTP on 127.0.0.1, driven one pass
at a time in-process (the chaos tier runs it as a process and SIGKILLs it).

Every assertion counts what the outside saw: the requests the receiver got, the records on the
queue topic, the rows of the projection."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.destinations import DestinationStore, Kind
from ledger.domain.delivery import redrive
from ledger.domain.ids import content_ref
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState
from ledger.history import HistoryReader
from ledger.kafka import connection_config
from ledger.log import KafkaTransport, OutgoingRecord
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyStore
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.batch_reader import BatchProjector
from processors.delivery.senders import WebhookSender
from processors.delivery.worker import DeliveryWorker
from producers import TransitionRecorder
from projections.writer import PostgresProjection
from tests.delivery_support import Answer, ScriptedReceiver
from tests.support import (
    assert_no_identifying_labels,
    env_for,
    grant,
    project_in_process,
    read_all,
)

D = DeliveryState
TENANT = "acme"
ACTOR = "agent-7"
TOOL = "send_email"
SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef01234567").decode()


class Rig:
    """A delivery worker, a projector stepped alongside it, and a service that records
    operations as SUCCEEDED."""

    def __init__(self, settings: Settings, retry: RetryPolicy) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = Metrics.create(self.registry)
        self.pool = open_pool(settings.dsn, name="test-delivery")
        self.transport = KafkaTransport(settings)
        self.history = HistoryReader(settings, self.pool)
        self.webhooks = WebhookSender(concurrency=32, metrics=self.metrics)
        self.destinations = DestinationStore(self.pool, settings)
        self.worker = DeliveryWorker(
            settings,
            pool=self.pool,
            transport=self.transport,
            history=self.history,
            results=ResultStore(self.pool),
            destinations=self.destinations,
            policy=PolicyStore(self.pool, self.settings).evaluate_many,
            webhooks=self.webhooks,
            metrics=self.metrics,
            retry=retry,
            unit_random=lambda: 0.5,  # no jitter: the waits are the schedule's
        )
        self.worker.join()
        self.sink = PostgresProjection.connect(settings.dsn)
        self.projector_registry = CollectorRegistry()
        self.projector = BatchProjector(
            settings, self.sink, default_codec(), Metrics.create(self.projector_registry)
        )
        self.projector._consumer = self.projector._open()
        self.service = TransitionRecorder.connect(settings, owner="service")

    def close(self) -> None:
        self.service.close()
        self.projector.close()
        self.sink.close()
        self.worker.close()
        self.webhooks.close()
        self.history.close()
        self.transport.close()
        self.pool.close()
        for registry in (self.registry, self.projector_registry):
            assert assert_no_identifying_labels(registry) > 0

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def webhook(self, name: str, url: str, **extra: Any) -> None:
        self.destinations.add(
            tenant_id=TENANT,
            name=name,
            kind=Kind.WEBHOOK,
            target=url,
            tools=[TOOL],
            changed_by="test",
            secret=SECRET,
            **extra,
        )

    def queue(self, name: str, *, partitions: int) -> str:
        """A queue destination ``name`` on a new topic of its own; the topic's name."""
        topic = f"{self.settings.topic_prefix}.results-out"
        self.destinations.add(
            tenant_id=TENANT,
            name=name,
            kind=Kind.QUEUE,
            target=topic,
            tools=[TOOL],
            changed_by="test",
        )
        admin = AdminClient({**connection_config(self.settings)})
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result(timeout=30)
        return topic

    def succeeded(self, result: bytes = b'{"sent": true}') -> str:
        op = self.service.intent(TENANT, ACTOR, TOOL, {"to": "a@example.com", "n": time.time_ns()})
        self.service.dispatched(op, provider_ref=op.operation_id)
        self.service.succeeded(op, result, content_type="application/json")
        return op.operation_id

    def step(self) -> None:
        self.worker.run_once(timeout=0.05)
        self.projector.run_once()

    def until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.step()

    def delivery(self, op_id: str, destination: str) -> Any:
        snapshot = self.history.load([(op_id, TENANT)])[op_id]
        return snapshot.deliveries.get(destination)

    def state(self, op_id: str, destination: str) -> DeliveryState | None:
        record = self.delivery(op_id, destination)
        return None if record is None else record.state

    def steps(self, op_id: str, destination: str) -> list[tuple[str, int, Any, str | None]]:
        project_in_process(self.settings)
        with psycopg.connect(self.settings.dsn) as conn:
            rows = conn.execute(
                "SELECT state, attempt, next_attempt_at, error FROM operation_history "
                "WHERE operation_id = %s AND destination = %s AND outcome = 'applied' "
                'ORDER BY partition, "offset"',
                (op_id, destination),
            ).fetchall()
        return [tuple(r) for r in rows]


@pytest.fixture
def rig_factory(isolated: Settings) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(group: str | None = None, **retry: Any) -> Rig:
        values: dict[str, Any] = {"schedule": (timedelta(milliseconds=300),), "jitter": 0.0}
        values.update(retry)
        settings = isolated if group is None else isolated.with_(delivery_group=group)
        rig = Rig(settings, RetryPolicy(**values))
        rigs.append(rig)
        return rig

    grant(isolated, TENANT, actor=ACTOR, tool=TOOL, destinations=("hooks", "queue", "other"))
    project_in_process(isolated)
    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def receiver() -> Iterator[ScriptedReceiver]:
    server = ScriptedReceiver(SECRET)
    yield server
    server.close()


def test_a_result_reaches_each_destination_once_signed_and_keyed(
    rig_factory: Callable[..., Rig], receiver: ScriptedReceiver, isolated: Settings
) -> None:
    rig = rig_factory()
    rig.webhook("hooks", receiver.url)
    queue_topic = rig.queue("queue", partitions=3)
    result = b'{"message_id": "m-1"}'
    started = time.monotonic()
    op_id = rig.succeeded(result)
    rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED and rig.state(op_id, "queue") is D.ACKED)
    elapsed = time.monotonic() - started
    ack_latency = "opledger_delivery_confirmation_to_ack_seconds"
    for destination in ("hooks", "queue"):  # one observation per ACK, in the send's time
        assert rig.sample(f"{ack_latency}_count", destination=destination) == 1
        assert 0 < (rig.sample(f"{ack_latency}_sum", destination=destination) or 0) <= elapsed + 1

    assert len(receiver.received) == 1
    got = receiver.received[0]
    assert got.signature_ok
    assert got.headers["Idempotency-Key"] == op_id
    assert got.headers["webhook-id"] == f"{op_id}:hooks"
    body = json.loads(got.body)
    assert body["operation_id"] == op_id and body["tenant_id"] == TENANT
    assert body["tool_name"] == TOOL and body["destination"] == "hooks"
    assert base64.b64decode(body["result_b64"]) == result
    assert body["result_ref"] == content_ref(result)

    records = read_all(isolated, queue_topic)
    assert len(records) == 1
    _partition, _offset, key, value = records[0]
    assert key == op_id.encode() and value is not None
    assert json.loads(value)["destination"] == "queue"

    assert [s[:2] for s in rig.steps(op_id, "hooks")] == [("PENDING", 0), ("SENT", 1), ("ACKED", 1)]
    # More passes send nothing more.
    for _ in range(10):
        rig.step()
    assert len(receiver.received) == 1
    assert len(read_all(isolated, queue_topic)) == 1
    for destination in ("hooks", "queue"):
        assert rig.sample(f"{ack_latency}_count", destination=destination) == 1


def test_503_twice_then_202_is_acked_after_three_sends_with_the_backoff_between(
    rig_factory: Callable[..., Rig],
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(503), Answer(503)])
    try:
        rig = rig_factory(schedule=(timedelta(milliseconds=400), timedelta(milliseconds=800)))
        rig.webhook("hooks", receiver.url)
        op_id = rig.succeeded()
        rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
        sends = receiver.received
        assert len(sends) == 3
        assert len({s.body for s in sends}) == 1, "every send carries the same bytes"
        assert {s.headers["Idempotency-Key"] for s in sends} == {op_id}
        assert sends[1].at - sends[0].at >= 0.4
        assert sends[2].at - sends[1].at >= 0.8
        steps = rig.steps(op_id, "hooks")
        assert [s[:2] for s in steps] == [
            ("PENDING", 0),
            ("SENT", 1),
            ("PENDING", 1),
            ("SENT", 2),
            ("PENDING", 2),
            ("SENT", 3),
            ("ACKED", 3),
        ]
        assert steps[2][3] is not None and "503" in steps[2][3]
        assert steps[2][2] is not None and steps[4][2] is not None, "the backoff is recorded"
        # Three sends, one acknowledgement: one observation, not one per send.
        count = rig.sample(
            "opledger_delivery_confirmation_to_ack_seconds_count", destination="hooks"
        )
        assert count == 1
    finally:
        receiver.close()


def test_retry_after_is_honoured_over_a_shorter_schedule(rig_factory: Callable[..., Rig]) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(429, retry_after="2")])
    try:
        rig = rig_factory(schedule=(timedelta(milliseconds=100),))
        rig.webhook("hooks", receiver.url)
        op_id = rig.succeeded()
        rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
        assert len(receiver.received) == 2
        assert receiver.received[1].at - receiver.received[0].at >= 2.0
        assert rig.metrics.deliveries.labels("hooks", "throttled")._value.get() == 1
    finally:
        receiver.close()


def test_a_redirect_is_a_failure_not_followed(rig_factory: Callable[..., Rig]) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(307)])
    try:
        rig = rig_factory(schedule=(timedelta(milliseconds=100),))
        rig.webhook("hooks", receiver.url)
        op_id = rig.succeeded()
        rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
        assert len(receiver.received) == 2
        assert "307" in (rig.steps(op_id, "hooks")[2][3] or "")
    finally:
        receiver.close()


def test_410_dead_letters_and_disables_the_destination(
    rig_factory: Callable[..., Rig],
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(410)])
    try:
        rig = rig_factory()
        rig.webhook("hooks", receiver.url)
        first = rig.succeeded()
        rig.until(lambda: rig.state(first, "hooks") is D.DEAD_LETTERED)
        assert "410" in (rig.delivery(first, "hooks").error or "")
        (listed,) = rig.destinations.list(TENANT)
        assert not listed.enabled and "410" in (listed.disabled_reason or "")
        # Later results for it are dead-lettered without a send.
        second = rig.succeeded()
        rig.until(lambda: rig.state(second, "hooks") is D.DEAD_LETTERED)
        assert "disabled" in (rig.delivery(second, "hooks").error or "")
        assert len(receiver.received) == 1
    finally:
        receiver.close()


def test_413_dead_letters_after_one_send_and_leaves_the_destination_enabled(
    rig_factory: Callable[..., Rig],
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(413)])
    try:
        rig = rig_factory()
        rig.webhook("hooks", receiver.url)
        op = rig.succeeded()
        rig.until(lambda: rig.state(op, "hooks") is D.DEAD_LETTERED)
        assert "413" in (rig.delivery(op, "hooks").error or "")
        assert len(receiver.received) == 1, "the same bytes were sent again"
        (listed,) = rig.destinations.list(TENANT)
        assert listed.enabled
    finally:
        receiver.close()


def test_a_result_too_large_for_the_queue_is_dead_lettered_and_stops_nothing(
    rig_factory: Callable[..., Rig], isolated: Settings
) -> None:
    rig = rig_factory()
    queue_topic = rig.queue("queue", partitions=1)
    # Stored whole (the result store takes 16 MiB), but base64 in the body makes it larger than
    # the producer may send: the same bytes every time, so no retry can succeed.
    big = rig.succeeded(json.dumps({"blob": "x" * 900_000}).encode())
    small = [rig.succeeded() for _ in range(3)]
    rig.until(
        lambda: (
            rig.state(big, "queue") is D.DEAD_LETTERED
            and all(rig.state(op, "queue") is D.ACKED for op in small)
        )
    )
    error = rig.delivery(big, "queue").error or ""
    assert "too large" in error and "bytes" in error, error
    assert "fetch secret" in error, error  # what would let it through (decision 016)
    assert [s[:2] for s in rig.steps(big, "queue")] == [
        ("PENDING", 0),
        ("SENT", 1),
        ("DEAD_LETTERED", 1),
    ]
    keys = [key for _p, _o, key, _v in read_all(isolated, queue_topic)]
    assert sorted(keys) == sorted(op.encode() for op in small)  # each small one, once


def test_an_answer_no_store_can_hold_is_recorded_storably_and_stops_nothing(
    rig_factory: Callable[..., Rig], receiver: ScriptedReceiver
) -> None:
    # A destination's own words go into the recorded error: NUL in its reason phrase must not
    # make the outcome unrecordable (that failed every pass, and the worker with it).
    hostile = socket.socket()
    hostile.bind(("127.0.0.1", 0))
    hostile.listen(8)
    answered = threading.Event()

    def serve() -> None:
        while True:
            try:
                conn, _ = hostile.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 20)
                conn.sendall(b"HTTP/1.1 500 bad\x00reason\r\nContent-Length: 0\r\n\r\n")
                answered.set()

    threading.Thread(target=serve, daemon=True).start()
    try:
        rig = rig_factory(max_attempts=1)
        rig.webhook("hooks", f"http://127.0.0.1:{hostile.getsockname()[1]}/events")
        rig.webhook("other", receiver.url)
        op_id = rig.succeeded()
        rig.until(
            lambda: (
                rig.state(op_id, "hooks") is D.DEAD_LETTERED
                and rig.state(op_id, "other") is D.ACKED
            )
        )
        assert answered.is_set()
        error = rig.delivery(op_id, "hooks").error or ""
        assert "bad\ufffdreason" in error and "\x00" not in error, error
    finally:
        hostile.close()


def test_a_destination_that_never_answers_is_dead_lettered_at_the_horizon_then_redriven_once(
    rig_factory: Callable[..., Rig], isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [], then=Answer(delay=1.0))
    try:
        # The horizon counts from the delivery's PENDING, before the worker has even joined its
        # group: 3 s saw one send only on a loaded machine (three test processes on 2 cores).
        rig = rig_factory(
            schedule=(timedelta(milliseconds=300),), horizon=timedelta(seconds=8), max_attempts=50
        )
        rig.webhook("hooks", receiver.url, timeout_ms=200)
        op_id = rig.succeeded()
        rig.until(lambda: rig.state(op_id, "hooks") is D.DEAD_LETTERED)
        dead = rig.delivery(op_id, "hooks")
        assert "horizon" in (dead.error or "") and "no answer" in (dead.error or "")
        sends_before = len(receiver.received)
        assert sends_before >= 2, "sent again before the horizon"

        receiver.then = Answer(202)
        # Two operators redrive the same dead letter at once: the same event, sent once.
        events = [redrive(dead, actor_id=f"ops:{who}", reason="receiver fixed", now=dead.updated_at)
                  for who in ("ann", "bob")]  # fmt: skip
        assert events[0].event_id == events[1].event_id
        rig.transport.send(
            [
                OutgoingRecord(
                    isolated.delivery_topic,
                    op_id.encode(),
                    default_codec().encode(e),
                    [("opledger-schema", b"DeliveryTransitioned")],
                )
                for e in events
            ]
        )
        project_in_process(isolated)
        rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
        for _ in range(10):
            rig.step()
        assert len(receiver.received) == sends_before + 1
        record = rig.delivery(op_id, "hooks")
        assert record.redrives == 1
    finally:
        receiver.close()


def test_redrive_from_the_command_line_is_audited_and_idempotent(
    rig_factory: Callable[..., Rig], isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(400)])
    try:
        rig = rig_factory(max_attempts=1)
        rig.webhook("hooks", receiver.url)
        op_id = rig.succeeded()
        rig.until(lambda: rig.state(op_id, "hooks") is D.DEAD_LETTERED)
        project_in_process(isolated)
        # The gauge follows the projection (refreshed every 5 s by the worker's passes).
        dead = "opledger_dead_lettered_deliveries"
        rig.until(lambda: rig.sample(dead, destination="hooks") == 1, timeout=15)

        def cli(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "opledger.cli", "deliveries", "redrive", *argv],
                env=env_for(isolated),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

        args = ["--tenant", TENANT, "--reason", "schema fixed", "--by", "ops:ann"]
        first = cli(op_id, "--destination", "hooks", *args)
        assert first.returncode == 0, first.stderr
        assert "1 redriven" in first.stdout
        # Another tenant cannot redrive it.
        other = cli(op_id, "--destination", "hooks", "--tenant", "globex", "--reason", "x")
        assert "no such delivery" in other.stdout
        rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
        project_in_process(isolated)
        # Redriven and acknowledged: the destination leaves the gauge (cleared, not left at 1).
        rig.until(lambda: rig.sample(dead, destination="hooks") is None, timeout=15)
        again = cli(op_id, "--destination", "hooks", *args)
        assert "not dead-lettered" in again.stdout
        for _ in range(5):
            rig.step()
        assert len(receiver.received) == 2
        redriven = [s for s in rig.steps(op_id, "hooks") if s[3] and "redriven" in s[3]]
        assert len(redriven) == 1 and "ops:ann" in (redriven[0][3] or "")
        assert "schema fixed" in (redriven[0][3] or "")
    finally:
        receiver.close()


def test_policy_is_checked_at_each_send(
    rig_factory: Callable[..., Rig], receiver: ScriptedReceiver, isolated: Settings
) -> None:
    rig = rig_factory()
    rig.webhook("not-granted", receiver.url)
    op_id = rig.succeeded()
    rig.until(lambda: rig.state(op_id, "not-granted") is D.DEAD_LETTERED)
    error = rig.delivery(op_id, "not-granted").error or ""
    assert "refused by policy" in error and "not-granted" in error
    assert receiver.received == []
    assert rig.metrics.deliveries.labels("not-granted", "refused")._value.get() == 1


def test_a_stale_sent_is_sent_again_with_the_same_key(
    rig_factory: Callable[..., Rig], receiver: ScriptedReceiver
) -> None:
    rig = rig_factory()
    rig.webhook("hooks", receiver.url, timeout_ms=200)
    op_id = rig.succeeded()
    rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED)
    # What a worker that died as its request left leaves behind: a SENT, outcome unrecorded.
    other = rig.succeeded()

    def dies(*_args: object) -> None:
        raise SystemExit("died while sending")

    rig.worker.sender._send = dies  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        rig.until(lambda: False, timeout=10)
    del rig.worker.sender._send
    assert rig.state(other, "hooks") is D.SENT
    rig.until(lambda: rig.state(other, "hooks") is D.ACKED, timeout=30)
    assert [r.headers["Idempotency-Key"] for r in receiver.received] == [op_id, other]
    steps = rig.steps(other, "hooks")
    assert [s[:2] for s in steps] == [
        ("PENDING", 0),
        ("SENT", 1),
        ("PENDING", 1),
        ("SENT", 2),
        ("ACKED", 2),
    ]
    assert "never recorded" in (steps[2][3] or "")


def test_the_outbox_repeated_after_a_crash_opens_no_second_delivery(
    rig_factory: Callable[..., Rig], receiver: ScriptedReceiver, isolated: Settings
) -> None:
    rig = rig_factory()
    rig.webhook("hooks", receiver.url)
    rig.webhook("other", receiver.url)
    op_id = rig.succeeded()
    rig.until(lambda: rig.state(op_id, "hooks") is D.ACKED and rig.state(op_id, "other") is D.ACKED)
    # A reader that never committed its position (a worker killed between its appends and its
    # commit) reads the execution topic again from the start: no new delivery, no new send.
    again = rig_factory(group=isolated.delivery_group + "-again")
    for _ in range(30):
        again.step()
    project_in_process(isolated)
    with psycopg.connect(isolated.dsn) as conn:
        count = conn.execute("SELECT count(*) FROM deliveries").fetchone()
        outcomes = dict(
            conn.execute(
                "SELECT outcome, count(*) FROM operation_history WHERE machine = 'delivery' "
                "GROUP BY outcome"
            ).fetchall()
        )
    assert count == (2,)
    assert outcomes.get("anomaly", 0) == 0
    assert len(receiver.received) == 2


def test_redrive_since_a_time_sends_every_dead_letter_of_the_period_again(
    rig_factory: Callable[..., Rig], isolated: Settings
) -> None:
    receiver = ScriptedReceiver(SECRET, [Answer(500), Answer(500), Answer(500)])
    try:
        rig = rig_factory(max_attempts=1)
        rig.webhook("hooks", receiver.url)
        old = rig.succeeded()
        rig.until(lambda: rig.state(old, "hooks") is D.DEAD_LETTERED)
        project_in_process(isolated)
        since = datetime.now(UTC)
        recent = [rig.succeeded(), rig.succeeded()]
        rig.until(lambda: all(rig.state(op, "hooks") is D.DEAD_LETTERED for op in recent))
        project_in_process(isolated)
        done = subprocess.run(
            [
                sys.executable, "-m", "opledger.cli", "deliveries", "redrive",
                "--tenant", TENANT, "--since", since.isoformat(), "--reason", "outage over",
                "--by", "ops:ann",
            ],
            env=env_for(isolated), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "2 redriven" in done.stdout
        rig.until(lambda: all(rig.state(op, "hooks") is D.ACKED for op in recent))
        assert rig.state(old, "hooks") is D.DEAD_LETTERED, "before the period: left alone"
        keys = [r.headers["Idempotency-Key"] for r in receiver.received]
        assert sorted(keys) == sorted([old, *recent, *recent])
    finally:
        receiver.close()
