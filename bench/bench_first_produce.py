"""How long a fresh producer takes to get its first record acknowledged, by the pause between
making the client and producing.

Not a test. Needs the local stack; uses its own topics. Backs ``KafkaTransport.warm``: with the
SDK's producer config (idempotent), a record produced in the client's first milliseconds often
waits about half a second; a few milliseconds later it does not. The recorder therefore only
overlaps a lease's commit with an intent's acknowledgement once its producer had a record
acknowledged (before that, the lease's commit comes first and gives the client that time).

    .venv/bin/python bench/bench_first_produce.py [--tries 10] [--gaps 0,2,5,10,20]
"""

from __future__ import annotations

import argparse
import time

from confluent_kafka import Producer

from benchenv import isolated
from ledger.kafka import producer_config
from ledger.settings import Settings

SLOW_S = 0.3


def first_ack_s(settings: Settings, gap_s: float, *, idempotent: bool) -> float:
    """Seconds from producing a fresh client's first record to its acknowledgement."""
    config = producer_config(settings)
    if not idempotent:
        config["enable.idempotence"] = False
    producer = Producer(config)
    time.sleep(gap_s)
    started = time.monotonic()
    producer.produce(settings.execution_topic, b"probe", b"first-produce")
    if producer.flush(10):
        raise RuntimeError("record not acknowledged within 10 s")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=10, help="fresh clients per row")
    parser.add_argument("--gaps", default="0,2,5,10,20", help="pauses in ms, comma list")
    args = parser.parse_args()
    gaps = [float(g) for g in args.gaps.split(",") if g.strip()]
    with isolated(Settings.from_env(), "first") as env:
        rows = [(gap, True) for gap in gaps] + [(gaps[0], False)]
        for gap_ms, idempotent in rows:
            times = [
                first_ack_s(env.settings, gap_ms / 1000, idempotent=idempotent)
                for _ in range(args.tries)
            ]
            slow = sum(t > SLOW_S for t in times)
            print(
                f"pause {gap_ms:>4g} ms, idempotence {'on ' if idempotent else 'off'}: "
                f"{slow}/{len(times)} first acks over {SLOW_S * 1000:.0f} ms "
                f"(median {sorted(times)[len(times) // 2] * 1000:.1f} ms, "
                f"max {max(times) * 1000:.1f} ms)",
                flush=True,
            )


if __name__ == "__main__":
    main()
