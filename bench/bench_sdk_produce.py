"""SDK append throughput against raw confluent-kafka produce, measured in the same run.

Not a test. Needs the local stack (``opledger`` launcher, or any broker at settings' bootstrap).
The baseline produces the *same pre-encoded bytes* (same keys, headers, producer config, topic)
with no fold, no encoding and no per-record bookkeeping; the SDK run appends the same events
through ``TransitionRecorder.append`` (fold + Avro encode + produce + wait for every ack).

    PYTHONPATH=. python bench/bench_sdk_produce.py [-n 200000] [--batch 20000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from confluent_kafka import Producer

from benchenv import isolated
from ledger.codec import default_codec
from ledger.domain import ids
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned, Transition
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.settings import Settings
from producers import KafkaTransport, TransitionRecorder, producer_config

EVENTS_PER_OPERATION = 4


def operation_events(index: int, start: datetime) -> list[Transition]:
    """INTENT, DISPATCHED, SUCCEEDED, delivery PENDING of one synthetic operation."""
    at = start + timedelta(microseconds=index)
    op = ids.operation_id(int(at.timestamp() * 1000), os.urandom(10))
    tool, args = "send_email", {"to": f"user{index}@example.com"}
    common = {"operation_id": op, "tenant_id": f"tenant-{index % 17}", "actor_id": "agent-1"}
    execution = {**common, "tool_name": tool, "request_hash": ids.request_hash(tool, args)}
    ref = ids.content_ref(f"result {index}".encode())

    def ev() -> str:
        return ids.event_id(int(at.timestamp() * 1000), os.urandom(10))

    return [
        ExecutionTransitioned(
            event_id=ev(),
            occurred_at=at,
            attempt=0,
            state=ExecutionState.INTENT_RECORDED,
            **execution,
        ),
        ExecutionTransitioned(
            event_id=ev(),
            occurred_at=at,
            attempt=1,
            state=ExecutionState.DISPATCHED,
            provider_ref=f"msg-{index}",
            **execution,
        ),
        ExecutionTransitioned(
            event_id=ev(),
            occurred_at=at,
            attempt=1,
            state=ExecutionState.SUCCEEDED,
            result_ref=ref,
            **execution,
        ),
        DeliveryTransitioned(
            event_id=ev(),
            occurred_at=at,
            attempt=0,
            state=DeliveryState.PENDING,
            destination="hook:billing",
            result_ref=ref,
            **common,
        ),
    ]


def raw_rate(settings: Settings, events: Sequence[Transition], compression: str) -> float:
    """Records/s producing pre-encoded bytes with the SDK's producer config, flushed at the end."""
    codec = default_codec()
    records = []
    for e in events:
        execution = isinstance(e, ExecutionTransitioned)
        topic = settings.execution_topic if execution else settings.delivery_topic
        schema = b"ExecutionTransitioned" if execution else b"DeliveryTransitioned"
        headers = [("opledger-schema", schema), ("tenant_id", e.tenant_id.encode())]
        records.append((topic, codec.encode(e), e.operation_id.encode(), headers))
    producer = Producer(producer_config(settings, compression=compression))
    started = time.perf_counter()
    for topic, value, key, headers in records:
        while True:
            try:
                producer.produce(topic, value, key, headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
    remaining = producer.flush(60)
    elapsed = time.perf_counter() - started
    if remaining:
        raise SystemExit(f"baseline: {remaining} records unacknowledged")
    return len(records) / elapsed


def sdk_rate(
    settings: Settings, events: Sequence[Transition], batch: int, compression: str, profile: bool
) -> float:
    """Records/s through TransitionRecorder.append, every batch waited for (acks checked)."""
    recorder = TransitionRecorder(settings, KafkaTransport(settings, compression=compression))
    # Batches hold whole operations, so each folds from an empty history.
    batch -= batch % EVENTS_PER_OPERATION
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    for i in range(0, len(events), batch):
        recorder.append(events[i : i + batch])
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - started
    recorder.close()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return len(events) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000, help="events per append() call")
    parser.add_argument("--rounds", type=int, default=2, help="alternate raw/SDK this many times")
    parser.add_argument("--compression", default="lz4", choices=["none", "lz4", "zstd", "snappy"])
    parser.add_argument("--profile", action="store_true", help="cProfile the last SDK round")
    args = parser.parse_args()

    # Private topics (and database), deleted on exit whatever happens.
    with isolated(Settings.from_env(), "sdk") as env:
        rounds = _run_rounds(env.settings, args)
    raw = max(x for x, _ in rounds)
    sdk = max(y for _, y in rounds)
    print(
        f"topics {env.settings.topic_prefix}.*  compression={args.compression}  batch={args.batch}"
    )
    print(f"raw confluent-kafka: {raw:,.0f} records/s (best of {args.rounds})")
    print(f"sdk append:          {sdk:,.0f} transitions/s (best of {args.rounds})")
    print(f"ratio = sdk/raw = {sdk / raw:.2f}  (target >= 0.8)")


def _run_rounds(settings: Settings, args: argparse.Namespace) -> list[tuple[float, float]]:
    start = datetime.now(UTC)
    operations = max(1, args.events // EVENTS_PER_OPERATION)
    print(f"building {operations * EVENTS_PER_OPERATION} events (not timed)...", flush=True)
    rounds = []
    for r in range(args.rounds):
        # Fresh operations per round: the SDK would rightly refuse to replay an intent.
        events = [e for i in range(operations) for e in operation_events(r * operations + i, start)]
        # The prebuilt input (hundreds of thousands of models a real service never holds at
        # once) would otherwise be re-traversed by every full GC pass during the timed runs.
        gc.collect()
        gc.freeze()
        raw = raw_rate(settings, events, args.compression)
        sdk = sdk_rate(
            settings, events, args.batch, args.compression, args.profile and r == args.rounds - 1
        )
        rounds.append((raw, sdk))
        del events
        gc.unfreeze()
        print(f"round {r + 1}: raw {raw:,.0f}/s  sdk {sdk:,.0f}/s  ratio {sdk / raw:.2f}")
    return rounds


if __name__ == "__main__":
    main()
