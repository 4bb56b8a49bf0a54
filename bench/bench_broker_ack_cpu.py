"""What the broker spends per acknowledged record, at the SDK's rate and flat out.

Not a test. Needs the local stack; uses its own topics. Backs the CPU analysis in README.md and
bench/README.md: the broker's share of one SDK call depends on how fast the callers are, because
records that wait together for the broker go in one request.

Both phases: ``--callers`` threads share one producer with the SDK's configuration
(``ledger.kafka.producer_config``: idempotent, acks=all, linger 0) and each produces one record
(``--size`` bytes, a random key, on a private execution topic with the ledger's partitions,
``OPLEDGER_PARTITIONS``) and waits for its own
acknowledgement, ``-n`` records in all. Timed: records/s and the broker's CPU per record (from
``/proc``), plus this process's.

- *baseline* (flat out): the callers do nothing between records;
- *paced*: each caller first holds the interpreter for ``--work-us`` (default 400 µs, about what
  an SDK call's Python costs per record: a call is three records and 1.0 to 1.3 ms of the callers'
  CPU, bench/README.md), so the records come at about the SDK's rate.

    .venv/bin/python bench/bench_broker_ack_cpu.py [-n 20000] [--callers 16] [--work-us 400]
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from dataclasses import dataclass

from confluent_kafka import Producer

from benchenv import cpu_seconds, isolated, stack_cpu_seconds
from ledger.kafka import producer_config
from ledger.settings import Settings


@dataclass(frozen=True)
class Phase:
    records: int
    seconds: float
    broker_s: float
    process_s: float

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    def per_record_us(self, seconds: float) -> float:
        return seconds / self.records * 1e6


def run_phase(settings: Settings, topic: str, args: argparse.Namespace, work_s: float) -> Phase:
    producer = Producer(producer_config(settings, client_id="bench-broker-ack"))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            producer.poll(0.05)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    payload = os.urandom(args.size)
    left = itertools.count()

    def caller(count: int) -> None:
        acked = threading.Lock()
        while next(left) < count:
            deadline = time.perf_counter() + work_s
            while time.perf_counter() < deadline:  # the caller's own Python, under the GIL
                pass
            acked.acquire()
            producer.produce(
                topic, payload, key=os.urandom(16), on_delivery=lambda _e, _m: acked.release()
            )
            acked.acquire()  # released by this record's delivery report
            acked.release()

    try:
        caller(200)  # warm-up, unmeasured
        left = itertools.count()
        broker0 = stack_cpu_seconds(settings)["broker"]
        process0 = cpu_seconds(os.getpid())
        started = time.perf_counter()
        threads = [threading.Thread(target=caller, args=(args.n,)) for _ in range(args.callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        return Phase(
            args.n,
            seconds,
            stack_cpu_seconds(settings)["broker"] - broker0,
            cpu_seconds(os.getpid()) - process0,
        )
    finally:
        stop.set()
        server.join()
        producer.flush(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20_000, help="records per phase (20000)")
    parser.add_argument("--callers", type=int, default=16, help="threads (16)")
    parser.add_argument("--size", type=int, default=300, help="record bytes (300)")
    parser.add_argument(
        "--work-us", type=float, default=400.0, help="paced: µs of Python per record (400)"
    )
    args = parser.parse_args()
    with isolated(Settings.from_env(), "brokerack") as env:
        settings = env.settings
        topic = settings.execution_topic
        print(
            f"{args.callers} callers, {args.n} records of {args.size} bytes per phase on "
            f"{topic} ({settings.partitions} partitions), each caller waits for its own ack"
        )
        phases = {
            "flat out (baseline)": run_phase(settings, topic, args, 0.0),
            f"paced ({args.work_us:.0f} µs of Python per record)": run_phase(
                settings, topic, args, args.work_us / 1e6
            ),
        }
    print(f"{'phase':<40} {'records/s':>10} {'broker µs/record':>17} {'this process':>13}")
    for name, phase in phases.items():
        print(
            f"{name:<40} {phase.rate:>10,.0f} {phase.per_record_us(phase.broker_s):>17.0f} "
            f"{phase.per_record_us(phase.process_s):>13.0f}"
        )
    base, paced = phases.values()
    ratio = paced.per_record_us(paced.broker_s) / base.per_record_us(base.broker_s)
    print(f"ratio: broker CPU per record, paced / flat out = {ratio:.2f}")


if __name__ == "__main__":
    main()
