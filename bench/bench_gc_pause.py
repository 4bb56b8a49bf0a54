"""Full-collection pause of a worker process, before and after its start-up heap is frozen.

Not a test; needs no stack. This process imports and builds what a worker's start-up leaves
behind (aiohttp, confluent-kafka, psycopg, pydantic models, the Avro schemas, the
receiver's routes), then times ``gc.collect()`` (a full collection, which is what a long-running
worker pays every few seconds under load) ``--rounds`` times, then calls
``ledger.heap.freeze_startup_heap()`` (what ``processors/host.py`` and the receiver do once
started) and times the same collections again. The baseline is the first measurement.

    PYTHONPATH=. .venv/bin/python bench/bench_gc_pause.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def load_worker_modules() -> int:
    """Import what the workers import and touch what they build at start-up; tracked objects."""
    import prometheus_client  # noqa: PLC0415

    import consumers.receiver  # noqa: F401, PLC0415
    import processors.delivery.worker  # noqa: PLC0415
    import processors.host  # noqa: PLC0415
    import processors.recovery.worker  # noqa: F401, PLC0415
    import projections.writer  # noqa: F401, PLC0415
    from ledger import codec  # noqa: PLC0415

    codec.default_codec()  # parses every schema
    prometheus_client.CollectorRegistry()
    return len(gc.get_objects())


def pauses(rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - started) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    from ledger.heap import freeze_startup_heap  # noqa: PLC0415

    tracked = load_worker_modules()
    before = pauses(args.rounds)
    frozen = freeze_startup_heap()
    after = pauses(args.rounds)
    b, a = statistics.median(before), statistics.median(after)
    print(f"objects tracked by the collector after start-up: {tracked:,}")
    print(f"full collection, nothing frozen (baseline): median {b:6.2f} ms, max {max(before):6.2f}")
    print(f"full collection, {frozen:,} objects frozen: median {a:6.2f} ms, max {max(after):6.2f}")
    print(f"ratio frozen / scanned: {a / b:.3f}")


if __name__ == "__main__":
    main()
