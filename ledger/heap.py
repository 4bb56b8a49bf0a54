"""The collector's view of a long-running worker's heap.

A worker's start-up leaves tens of thousands of long-lived objects behind (modules, classes,
pydantic models, Avro schemas, its clients). CPython's full collection walks every one of them,
and a busy worker runs one every few seconds: ``bench/bench_gc_pause.py`` prints that pause
and the same collection after the freeze (figures in ``bench/README.md``). A pause that long
sits in the receiver's p99 (``bench/bench_consumer_receiver.py``). What start-up allocated
lives as long as the process, so it is frozen out of the collector's reach; what is allocated
later is collected as before.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation (never
    scanned again, never freed by the collector: only call this once start-up is done). The
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
