"""The disk's own sync stalls, alone and beside a write load: do the receiver's stalls come from
its own writes? Not a test; needs no stack (it writes beside the local stack's data, in
``$OPLEDGER_HOME``, default ``/var/lib/opledger``, so it measures the same filesystem).

The receiver bench (``bench_consumer_receiver.py``) saw its slow answers coincide with stalls of
a probe that ``fdatasync``s 8 KiB every 5 ms. If those stalls were caused by the receiver's own
writes (PostgreSQL's WAL: one 8 KiB page rewritten and synced per commit, about 850 a second at
1,000 requests/s), writing less would help. This script runs the same probe:

1. *alone* (the baseline): nothing else written by this script;
2. beside a load thread that writes and ``fdatasync``s 8 KiB blocks at each ``--rates`` (syncs
   per second; 0 = as fast as it can) to another file on the same filesystem.

Printed per phase: the probe's p50 / p99 / max, its stalls (syncs over 20 ms) and their total
time, the load's achieved syncs/s, and the ratio of stall time to the baseline's. Stalls that
do not grow with the load are the disk's, not the writer's.

    PYTHONPATH=. .venv/bin/python bench/bench_disk_sync.py [--seconds 15] [--rates 200,1000,0]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from bench_consumer_receiver import Probe, SyncProbe, percentiles

BLOCK = 8192
SPAN = 64 * 1024 * 1024


def load(directory: Path, rate: float, until: float) -> int:
    """Write and sync 8 KiB blocks at ``rate`` per second (0: flat out) until ``until``."""
    path = directory / f"bench-sync-load-{os.getpid()}.bin"
    block = os.urandom(BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    done, offset, started = 0, 0, time.monotonic()
    try:
        while (now := time.monotonic()) < until:
            if rate > 0 and (due := started + done / rate) > now:
                time.sleep(due - now)
            os.pwrite(fd, block, offset)
            os.fdatasync(fd)
            offset = (offset + BLOCK) % SPAN
            done += 1
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return done


def stall_seconds(probe: Probe) -> tuple[int, float]:
    stalls = [seconds for _start, seconds in probe.writes if seconds > Probe.STALL_S]
    return len(stalls), sum(stalls)


def phase(directory: Path, seconds: float, rate: float | None) -> tuple[float, int, float]:
    """One phase; ``rate`` None runs the probe alone. Returns (load syncs/s, stalls, stall s)."""
    syncs = 0
    until = time.monotonic() + seconds

    def run_load() -> None:
        nonlocal syncs
        syncs = load(directory, rate or 0.0, until)

    writer = threading.Thread(target=run_load, daemon=True) if rate is not None else None
    with SyncProbe(directory) as probe:
        if writer:
            writer.start()
        time.sleep(max(0.0, until - time.monotonic()))
        if writer:
            writer.join()
    count, total = stall_seconds(probe)
    name = "alone" if rate is None else f"load {rate:.0f}/s" if rate else "load flat out"
    achieved = syncs / seconds
    print(
        f"{name:<14} probe {percentiles([s for _t, s in probe.writes])}; "
        f"stalls {count} ({total * 1000:.0f} ms in all); load {achieved:.0f} syncs/s",
        flush=True,
    )
    return achieved, count, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument(
        "--rates", default="200,1000,0", help="load syncs per second per phase; 0 = flat out"
    )
    parser.add_argument("--dir", type=Path, default=None, help="default: $OPLEDGER_HOME")
    args = parser.parse_args()
    directory = args.dir or Path(os.environ.get("OPLEDGER_HOME", "/var/lib/opledger"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"8 KiB fdatasync probe every 5 ms in {directory}, {args.seconds:.0f} s per phase")
    _rate, _count, baseline = phase(directory, args.seconds, None)
    for rate in (float(r) for r in args.rates.split(",")):
        _achieved, _count, total = phase(directory, args.seconds, rate)
        ratio = f"{total / baseline:.2f}" if baseline > 0 else "n/a (no stall alone)"
        print(f"{'':<14} stall time / alone: {ratio}")
    # The baseline again last: a disk that stalls on its own schedule can change within minutes.
    _rate, _count, again = phase(directory, args.seconds, None)
    ratio = f"{again / baseline:.2f}" if baseline > 0 else "n/a (no stall alone)"
    print(f"{'':<14} stall time / first alone: {ratio}")


if __name__ == "__main__":
    main()
