"""Random bytes for ids: ``os.urandom(10)`` per id against ``ledger.entropy`` (4 KiB blocks),
alone and with other threads busy (as in a worker whose sender and report threads run).

    .venv/bin/python bench/bench_entropy.py [--seconds 2] [--busy 0,1,3]

Printed per number of busy threads: draws/s and µs per draw of each, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

from ledger.entropy import EntropyPool


def rate(draw: Callable[[int], bytes], seconds: float) -> float:
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(100):
            draw(10)
        count += 100
    return count / elapsed


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--busy", default="0,1,3", help="comma list of busy-thread counts")
    args = parser.parse_args()
    pool = EntropyPool()
    print(f"{'busy threads':>12}  {'os.urandom':>16}  {'pool':>16}  {'ratio':>6}")
    for busy in (int(b) for b in args.busy.split(",")):
        stop = threading.Event()

        threads = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for thread in threads:
            thread.start()
        try:
            raw, pooled = rate(os.urandom, args.seconds), rate(pool, args.seconds)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        print(
            f"{busy:>12}  {raw:>8,.0f}/s {1e6 / raw:5.1f}us  {pooled:>8,.0f}/s "
            f"{1e6 / pooled:5.1f}us  {pooled / raw:6.1f}"
        )


if __name__ == "__main__":
    main()
