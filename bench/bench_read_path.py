"""Read-path throughput: a faust agent against the raw confluent-kafka batch loop the projector
uses (``processors/batch_reader.py``), measured in the same run. Not a test; needs the local
stack (``opledger stack up``). Nothing is written to PostgreSQL.

Untimed: N events from ``opledger.workload.Workload``, encoded with ``default_codec()`` and keyed
by operation_id, are appended to one private 6-partition topic (``bench<read><hex>.readpath``).
Then the same records are read four times, each by a fresh reader from the beginning, counting
only (timed from the first record received to the N-th):

1. faust agent, ``stream.take(1000, within=0.5)``, concurrency 1 (a faust worker subprocess);
2. faust agent, ``async for event in stream`` (per event, otherwise the same);
3. raw confluent-kafka ``consume(5000, 0.05)`` over all 6 partitions assigned from the beginning
   - the baseline;
4. the same raw loop plus ``default_codec().decode`` of every record (the projector's read path
   without PostgreSQL).

    ratio = mode events/s / raw consume events/s

    PYTHONPATH=. python bench/bench_read_path.py [-n 200000] [--seed 7] [--only take,raw,...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import faust
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from benchenv import faust_credentials, isolated, producer
from ledger.codec import default_codec
from ledger.domain.events import Transition
from ledger.kafka import connection_config
from ledger.settings import Settings
from opledger.workload import Workload

PARTITIONS = 6
MODES = ("take", "each", "raw", "decode")
LABELS = {
    "take": "faust agent, stream.take(1000, within=0.5)",
    "each": "faust agent, async for event in stream",
    "raw": "raw confluent consume(5000, 0.05)",
    "decode": "raw consume + default_codec().decode",
}

# --- setup --------------------------------------------------------------------------------------


def workload_events(count: int, seed: int) -> list[Transition]:
    """Exactly ``count`` events of whole operations from the seeded workload (the last cut)."""
    events: list[Transition] = []
    workload = Workload(seed=seed)
    while len(events) < count:
        events.extend(workload.operation())
    return events[:count]


def create_topic(settings: Settings, name: str) -> None:
    admin = AdminClient({**connection_config(settings)})
    for future in admin.create_topics([NewTopic(name, PARTITIONS, 1)]).values():
        future.result(timeout=30)


def fill(settings: Settings, topic: str, events: list[Transition]) -> None:
    """Append every encoded event keyed by operation_id (acks=all, the tests' producer)."""
    p = producer(settings)
    codec = default_codec()
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for index, event in enumerate(events):
        value = codec.encode(event)
        key = event.operation_id.encode()
        while True:
            try:
                p.produce(topic, key=key, value=value, on_delivery=delivered)
                break
            except BufferError:
                p.poll(0.05)
        if index % 1000 == 999:
            p.poll(0)
    if p.flush(60) or failures:
        raise SystemExit(f"broker did not acknowledge every record: {failures[:3]}")


# --- raw confluent-kafka ------------------------------------------------------------------------


def raw_read(settings: Settings, topic: str, total: int, decode: bool) -> float:
    """Seconds from the first record received to the ``total``-th, assign + consume() loop."""
    consumer = Consumer(
        {
            **connection_config(settings),
            # assign() without commits: the group id is never registered on the broker.
            "group.id": f"{settings.topic_prefix}-raw-{uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            # As BatchProjector._open() configures its consumer.
            "fetch.wait.max.ms": 20,
            "queued.max.messages.kbytes": 65536,
        }
    )
    codec = default_codec()
    decoder = codec.decode
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        count = 0
        first = 0.0
        deadline = time.monotonic() + 60
        while count < total:
            if time.monotonic() > deadline:
                raise SystemExit(f"raw consumer read {count} of {total} records in 60 s")
            messages = consumer.consume(5000, 0.05)
            if not messages:
                continue
            if not count:
                first = time.perf_counter()
            for message in messages:
                if message.error() is not None:
                    raise SystemExit(f"consume failed: {message.error()}")
                if decode:
                    decoder(message.value())  # type: ignore[arg-type]
                count += 1
        return time.perf_counter() - first
    finally:
        consumer.close()


# --- faust, in a worker subprocess --------------------------------------------------------------


def faust_worker(spec: dict[str, Any]) -> None:
    """Subprocess body: one faust worker whose agent counts ``spec["total"]`` records, writes
    the timing to ``spec["out"]``, and runs until the parent's SIGTERM (faust's graceful stop)."""
    app_id, topic, total, mode, out = (spec[k] for k in ("app_id", "topic", "total", "mode", "out"))
    # The parent's environment, as the admin (a faust app makes its own topics and groups).
    settings = Settings.from_env().as_kafka_role("admin")
    app = faust.App(
        app_id,
        broker=f"kafka://{spec['bootstrap']}",
        broker_credentials=faust_credentials(settings),
        store="memory://",
        web_enabled=False,
        datadir=spec["datadir"],
        consumer_auto_offset_reset="earliest",
    )
    source = app.topic(topic, key_type=bytes, value_type=bytes, value_serializer="raw")
    state = {"count": 0, "first": 0.0}

    def record(seen: int) -> None:
        if not state["count"]:
            state["first"] = time.perf_counter()
        state["count"] += seen
        if state["count"] >= total and seen:
            seconds = time.perf_counter() - state["first"]
            tmp = f"{out}.tmp"
            Path(tmp).write_text(json.dumps({"count": state["count"], "seconds": seconds}))
            os.replace(tmp, out)

    if mode == "take":

        @app.agent(source, concurrency=1)
        async def count_batches(stream: Any) -> None:
            async for values in stream.take(1000, within=0.5):
                record(len(values))

    else:

        @app.agent(source, concurrency=1)
        async def count_events(stream: Any) -> None:
            async for _value in stream:
                record(1)

    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()


def faust_read(
    settings: Settings, topic: str, total: int, mode: str, workdir: Path
) -> tuple[float, str]:
    """(seconds first-to-last record, app id) of a faust worker subprocess in ``mode``."""
    app_id = f"{settings.topic_prefix}-faust-{mode}"
    out = workdir / f"{mode}.json"
    log = workdir / f"{mode}.log"
    cmd = [
        sys.executable,
        __file__,
        "--faust-worker",
        json.dumps(
            {
                "bootstrap": settings.bootstrap_servers,
                "app_id": app_id,
                "topic": topic,
                "total": total,
                "mode": mode,
                "out": str(out),
                "datadir": str(workdir),
            }
        ),
    ]
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, (root, os.getenv("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=workdir, env=env)
    try:
        deadline = time.monotonic() + 90
        while not out.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"faust worker ({mode}) did not count {total} records:\n{tail}")
            time.sleep(0.1)
        result = json.loads(out.read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if result["count"] != total:
        raise SystemExit(f"faust worker ({mode}) counted {result['count']}, expected {total}")
    return float(result["seconds"]), app_id


def delete_groups(settings: Settings, groups: list[str]) -> None:
    """faust commits its offsets under the app id; drop those groups with the topics."""
    if not groups:
        return
    admin = AdminClient({**connection_config(settings)})
    for group, future in admin.delete_consumer_groups(groups, request_timeout=15).items():
        try:
            future.result(timeout=30)
        except Exception as exc:  # best effort: report, the topics still go
            print(f"(could not delete consumer group {group}: {exc})", file=sys.stderr)


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-n", "--events", type=int, default=200_000, help="records to read")
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    parser.add_argument(
        "--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}"
    )
    parser.add_argument("--faust-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.faust_worker:
        faust_worker(json.loads(args.faust_worker))
        return
    modes = [m for m in MODES if m in args.only.split(",")]

    base = Settings.from_env()
    rates: dict[str, float] = {}
    groups: list[str] = []
    with isolated(base, "read") as env, tempfile.TemporaryDirectory() as tmp:
        settings = env.settings
        topic = f"{settings.topic_prefix}.readpath"
        try:
            t0 = time.perf_counter()
            create_topic(settings, topic)
            events = workload_events(args.events, args.seed)
            fill(settings, topic, events)
            n = len(events)
            print(
                f"prepared {n:,} encoded events on {topic} ({PARTITIONS} partitions) "
                f"in {time.perf_counter() - t0:.1f}s (not timed)",
                flush=True,
            )
            del events
            for mode in modes:
                if mode in ("raw", "decode"):
                    seconds = raw_read(settings, topic, n, decode=mode == "decode")
                else:
                    seconds, app_id = faust_read(settings, topic, n, mode, Path(tmp))
                    groups.append(app_id)
                rates[mode] = n / seconds
                print(
                    f"{LABELS[mode]:45} {n:,} in {seconds:6.2f}s = {rates[mode]:>11,.0f} events/s",
                    flush=True,
                )
        finally:
            delete_groups(settings, groups)

    print()
    baseline = rates.get("raw")
    for mode in modes:
        ratio = f"{rates[mode] / baseline:.4f}" if baseline else "n/a"
        print(f"{LABELS[mode]:45} {rates[mode]:>11,.0f} events/s  ratio vs raw consume {ratio}")
    if baseline and "each" in rates:
        print(f"raw consume / faust per-event = {baseline / rates['each']:,.0f}x")


if __name__ == "__main__":
    main()
