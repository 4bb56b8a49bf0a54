"""What the lease adds to one call, with its commit before the intent is sent or while the
intent's acknowledgement is in flight, interleaved call by call in one process.

Not a test. Needs the local stack; uses its own topics and database. Three recorders, each
with its own producer and pool, take turns call by call (in a shuffled order each turn), so the
box's drifting load falls on all three alike:

- ``recorder``: ``bench_sdk_calls.py``'s recorder path (no lease store);
- ``lease first``: its lease path on a transport that only sends and waits in one go (not a
  ``SplitTransport``), so ``intent`` commits the lease before the intent is sent (the order
  before issue 6);
- ``lease beside``: the same on the plain ``KafkaTransport``: the commit runs while the
  intent's acknowledgement is in flight.

Prints p50 / p90 of each and the lease's cost at p50 (lease path minus recorder) for both.

    .venv/bin/python bench/bench_lease_overlap.py [--calls 1500] [--warmup 100] [--seed 1]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench_sdk_calls import leased_call, recorder_call
from benchenv import isolated
from ledger.leases import LeaseStore, process_identity
from ledger.log import KafkaTransport, OutgoingRecord, Positions, SplitTransport
from ledger.pg import open_pool
from ledger.settings import Settings
from producers import ResultStore, TransitionRecorder


class SendOnly:
    """A KafkaTransport seen through ``send`` alone: the recorder takes the lease first."""

    def __init__(self, inner: KafkaTransport) -> None:
        self._inner = inner

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        return self._inner.send(records)

    def close(self) -> None:
        self._inner.close()


def leased(settings: Settings, *, beside: bool) -> tuple[TransitionRecorder, LeaseStore]:
    kafka = KafkaTransport(settings)
    transport: Any = kafka if beside else SendOnly(kafka)
    assert isinstance(transport, SplitTransport) is beside
    pool = open_pool(settings.dsn, name="opledger-sdk")
    leases = LeaseStore(pool, process_identity("bench"))
    recorder = TransitionRecorder(
        settings, transport, results=ResultStore(pool), leases=leases, owns=[transport, pool]
    )
    return recorder, leases


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=100, help="untimed calls per variant")
    parser.add_argument("--seed", type=int, default=1, help="of the order within each turn")
    args = parser.parse_args()
    order = random.Random(args.seed)
    numbers = itertools.count()
    with isolated(Settings.from_env(), "overlap") as env:
        settings = env.settings
        plain_transport = KafkaTransport(settings)
        plain_results = ResultStore.connect(settings.dsn)
        plain = TransitionRecorder(
            settings,
            plain_transport,
            results=plain_results,
            owns=[plain_transport, plain_results],
        )
        first, first_leases = leased(settings, beside=False)
        beside, beside_leases = leased(settings, beside=True)
        calls = {
            "recorder": recorder_call(plain, numbers),
            "lease first": leased_call(first, first_leases, numbers),
            "lease beside": leased_call(beside, beside_leases, numbers),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        try:
            for _ in range(args.warmup):
                for call in calls.values():
                    call()
            names = list(calls)
            for _ in range(args.calls):
                order.shuffle(names)
                for name in names:
                    started = time.perf_counter()
                    calls[name]()
                    times[name].append((time.perf_counter() - started) * 1000)
        finally:
            for recorder in (plain, first, beside):
                recorder.close()
    p50 = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(
            f"{name:<13} p50 {p50[name]:6.2f} ms  p90 {percentile(values, 0.9):6.2f} ms  "
            f"({len(values)} calls)"
        )
    for name in ("lease first", "lease beside"):
        print(f"the lease adds at p50, {name}: {p50[name] - p50['recorder']:+.2f} ms")


if __name__ == "__main__":
    main()
