"""Key-store restore: time to rebuild a consumer's key view from the compacted key store, against
a raw consume of the same records that builds nothing, measured in the same run. Not a test;
needs the local stack (``opledger stack up``).

*Untimed*: ``--keys`` key-store records of consumer ``bench`` (``consumers.keystore.KeyEntry``,
the publisher's layout: key ``bench/<operation_id>``, placed on the operation's murmur2
partition, JSON value) are produced to a private prefix's ``consumer-keys.v1`` topic (6
partitions, ``cleanup.policy=compact``, created by ``ensure_topics`` as in a deployment), with
acks=all. ``--other`` more records of another consumer are mixed in (restore skips them by key).

*Timed*, each by a fresh consumer reading every partition from the beginning to the end offsets
taken when it starts, both with ``consumers.keystore.RESTORE_FETCH`` (8 MB fetches per
partition instead of librdkafka's 1 MB):

- ``raw consume``: the baseline, confluent-kafka ``consume(10000, 0.5)`` counting records only;
- ``restore``: ``consumers.keystore.restore``, the same read plus parsing every record of its
  consumer into the ``KeyView`` (what ``opledger consumer run`` does on start).

Printed: records, seconds and records/s for both, keys in the view (must equal ``--keys``), the
process's resident memory growth while the view was built, and ``ratio = restore s / raw s``.

    PYTHONPATH=. .venv/bin/python bench/bench_consumer_restore.py [--keys 1000000] [--other 0]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from benchenv import isolated
from consumers.keystore import (
    RESTORE_FETCH,
    KeyEntry,
    KeyView,
    partition_of,
    record_key,
    restore,
)
from ledger.domain.ids import operation_id
from ledger.kafka import connection_config
from ledger.log import end_offsets
from ledger.settings import Settings


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def produce(settings: Settings, keys: int, other: int, seed: int) -> None:
    rng = random.Random(seed)
    producer = Producer(
        {
            **connection_config(settings),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 50,
            "batch.size": 1_000_000,
            "compression.type": "lz4",  # as the publisher (ledger.kafka.producer_config)
        }
    )
    topic = settings.consumer_keys_topic
    now_ms = int(time.time() * 1000)
    started = time.monotonic()
    consumers = ["bench"] * keys + ["other"] * other
    rng.shuffle(consumers)
    for n, consumer in enumerate(consumers):
        op = operation_id(now_ms - n, rng.randbytes(10))
        entry = KeyEntry(consumer, op, rng.randbytes(32), datetime.now(UTC), "applied")
        while True:
            try:
                producer.produce(
                    topic,
                    entry.encode(),
                    record_key(consumer, op),
                    partition=partition_of(op, settings.partitions),
                )
                break
            except BufferError:
                producer.poll(0.05)
        if n % 10_000 == 0:
            producer.poll(0)
    if producer.flush(120):
        raise SystemExit("broker did not acknowledge every record")
    print(f"produced {len(consumers):,} records in {time.monotonic() - started:.1f} s (untimed)")


def raw_consume(settings: Settings) -> tuple[int, float]:
    topic = settings.consumer_keys_topic
    started = time.monotonic()
    ends = {p: o for (_, p), o in end_offsets(settings, [topic]).items() if o > 0}
    reader = Consumer(
        {
            **connection_config(settings),
            "group.id": f"{settings.topic_prefix}-raw",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            **RESTORE_FETCH,
        }
    )
    reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
    remaining, records = set(ends), 0
    while remaining:
        for message in reader.consume(10_000, 0.5):
            if message.error():
                continue
            records += 1
            partition, offset = message.partition() or 0, message.offset() or 0
            if offset >= ends[partition] - 1:
                remaining.discard(partition)
    reader.close()
    return records, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys of the consumer (1M)")
    parser.add_argument("--other", type=int, default=0, help="records of another consumer (0)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with isolated(Settings.from_env(), "restore") as iso:
        settings = iso.settings
        produce(settings, args.keys, args.other, args.seed)
        records, raw_s = raw_consume(settings)
        rate = records / raw_s
        print(f"raw consume      {records:>10,} records in {raw_s:6.2f} s  {rate:>10,.0f}/s")
        view = KeyView()
        before = rss_bytes()
        report = restore(settings, "bench", view)
        grown = rss_bytes() - before
        print(
            f"restore          {report.records:>10,} records in {report.seconds:6.2f} s  "
            f"{report.records / report.seconds:>10,.0f}/s  -> {report.keys:,} keys "
            f"(skipped {report.skipped}); memory +{grown / 2**20:.0f} MiB"
        )
        if report.keys != args.keys:
            raise SystemExit(f"the view holds {report.keys} keys, expected {args.keys}")
        print(f"ratio restore / raw: {report.seconds / raw_s:.2f}")
        print(f"pid {os.getpid()} done")


if __name__ == "__main__":
    main()
