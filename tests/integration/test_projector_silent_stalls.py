"""What could stop the projector without a word, each made for real: a consumer that stops
fetching, and another session's lock on a projection table.

A Kafka consumer that stops fetching while records wait: librdkafka's
assigned consumer does so now and then after a broker restart (confluentinc/librdkafka#5153,
fede1024/rust-rdkafka#597), and one clean-clone CI run saw the projector idle for two minutes
behind its topics after the restart chaos test's broker restarts. The stall is made here by
pausing the projector's partitions behind its back (the real consumer and broker, fetching
nothing): the projector must notice that records wait, reopen its consumer from the positions
stored with the rows, and catch up, in the same process.

A lock another session holds (an analyst's ``LOCK TABLE`` in an open transaction) made a batch
wait for ever, the projector silent and /healthz still 200. Now the batch gives up after the
lock timeout, /healthz says 503 with the reason, and the same batch commits once the lock is
released: nothing dead-lettered, nothing lost."""

from __future__ import annotations

import threading
import time

import psycopg
from confluent_kafka import Consumer
from prometheus_client import CollectorRegistry

from ledger.codec import default_codec
from ledger.domain.events import Transition
from ledger.metrics import Metrics
from ledger.settings import Settings
from processors.batch_reader import BatchProjector
from projections.writer import PostgresProjection
from tests.support import (
    assert_projection_matches,
    caught_up,
    independent_fold,
    produce,
    wait_caught_up,
    workload_events,
)


def produce_ordered(settings: Settings, events: list[Transition]) -> None:
    """Append ``events`` as services do for a projector that reads while they are written: every
    execution record acknowledged before the delivery records that follow it (the SDK appends a
    PENDING only once SUCCEEDED is acknowledged). ``produce`` sends both topics at once, so a
    delivery can be visible before its execution, which a live projector rightly records as an
    anomaly once the execution partition is read to its end (failed once in CI this way)."""
    produce(settings, [e for e in events if e.kind == "execution"])
    produce(settings, [e for e in events if e.kind != "execution"])


class _Running:
    def __init__(
        self, settings: Settings, fetch_stall_s: float = 20.0, lock_timeout_ms: int = 30_000
    ) -> None:
        self.registry = CollectorRegistry()
        self.sink = PostgresProjection.connect(settings.dsn, lock_timeout_ms=lock_timeout_ms)
        self.projector = BatchProjector(
            settings,
            self.sink,
            default_codec(),
            Metrics.create(self.registry),
            fetch_stall_s=fetch_stall_s,
        )
        self.thread = threading.Thread(target=self.projector.run, daemon=True)
        self.thread.start()

    def caught_up_with(
        self, settings: Settings, events: list[Transition]
    ) -> tuple[float, Consumer]:
        """Produce ``events`` and wait until they are projected; returns the reopens counted so
        far (a bound this short may reopen once while the first fetch is slow) and the consumer
        the projector reads with now."""
        produce_ordered(settings, events)
        wait_caught_up(settings, timeout=60)
        consumer = self.projector._consumer
        assert consumer is not None
        return self.reopens(), consumer

    def reopens(self) -> float:
        return self.registry.get_sample_value("opledger_projector_consumer_reopens_total") or 0.0

    def close(self) -> None:
        self.projector.stop()
        self.thread.join(timeout=30)
        self.sink.close()


def test_a_consumer_that_stops_fetching_is_reopened_and_catches_up(isolated: Settings) -> None:
    running = _Running(isolated, fetch_stall_s=1.0)
    try:
        before, consumer = running.caught_up_with(isolated, workload_events(200, seed=21))
        consumer.pause(consumer.assignment())  # the fetcher stops; nothing says so
        produce_ordered(isolated, workload_events(200, seed=22))
        waited = wait_caught_up(isolated, timeout=60)
        assert running.reopens() - before == 1, running.reopens()
        assert running.projector._consumer is not consumer, "a new consumer"
        assert running.thread.is_alive()
        print(f"\ncaught up {waited:.1f}s after the fetcher stopped (bound 1 s)")
    finally:
        running.close()
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["operations"] == 400 and summary["anomalies"] == 0


def test_an_idle_projector_with_nothing_waiting_keeps_its_consumer(isolated: Settings) -> None:
    running = _Running(isolated, fetch_stall_s=0.5)
    try:
        before, consumer = running.caught_up_with(isolated, workload_events(20, seed=23))
        time.sleep(3.0)  # six bounds with nothing to fetch
        assert caught_up(isolated)
        assert running.reopens() == before
        assert running.projector._consumer is consumer
    finally:
        running.close()


def test_a_lock_another_session_holds_pauses_the_projector_visibly_then_it_catches_up(
    isolated: Settings,
) -> None:
    running = _Running(isolated, lock_timeout_ms=300)
    try:
        produce_ordered(isolated, workload_events(20, seed=24))
        wait_caught_up(isolated, timeout=60)
        with psycopg.connect(isolated.dsn) as analyst:
            analyst.execute("LOCK TABLE agent_operations IN ACCESS EXCLUSIVE MODE")
            produce_ordered(isolated, workload_events(50, seed=25))
            deadline = time.monotonic() + 30
            while True:
                health = running.projector.health.snapshot()
                if health["status"] == "stalled":
                    break
                assert time.monotonic() < deadline, f"never said it waits: {health}"
                time.sleep(0.05)
            assert "lock timeout" in health["reason"], health
            assert not caught_up(isolated)
            analyst.rollback()  # the lock is released
        wait_caught_up(isolated, timeout=60)
        assert running.projector.health.snapshot()["status"] == "ok"
        assert running.thread.is_alive()
    finally:
        running.close()
    summary = assert_projection_matches(isolated, independent_fold(isolated))
    assert summary["operations"] == 70 and summary["anomalies"] == 0
    assert summary["dead"] == 0, "a batch that waited for a lock is retried, not dead-lettered"
