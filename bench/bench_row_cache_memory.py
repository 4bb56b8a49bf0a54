"""Memory the projector's row cache holds per operation (decision 011), against the bytes of the
same operations' events on the wire.

    PYTHONPATH=. .venv/bin/python bench/bench_row_cache_memory.py [-n 3000] [--seed 3]

Folds ``-n`` workload operations with the domain's fold, turns each final record into its row and
back (what the cache keeps after a commit: ``execution_from_row``, ``delivery_from_row``), and
measures what the two caches' entries hold with ``tracemalloc``. Printed: bytes per operation, the
cache's size at ``ROW_CACHE_LIMIT``, and the ratio to the operations' encoded events.
"""

from __future__ import annotations

import argparse
import tracemalloc
from typing import Any

from ledger.codec import default_codec
from ledger.domain.events import DeliveryTransitioned, ExecutionTransitioned
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    ExecutionRecord,
    apply_delivery,
    apply_execution,
)
from ledger.rows import delivery_from_row, delivery_row, execution_from_row, execution_row
from opledger.workload import Workload
from projections.writer import ROW_CACHE_LIMIT


def folded(operation: list[Any]) -> tuple[ExecutionRecord | None, dict[str, DeliveryRecord]]:
    record: ExecutionRecord | None = None
    deliveries: dict[str, DeliveryRecord] = {}
    for event in operation:
        if isinstance(event, ExecutionTransitioned):
            outcome = apply_execution(record, event)
            if isinstance(outcome, Applied):
                record = outcome.record
        elif isinstance(event, DeliveryTransitioned):
            delivered = apply_delivery(deliveries.get(event.destination), event, record)
            if isinstance(delivered, Applied):
                deliveries[event.destination] = delivered.record
    return record, deliveries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    operations = [list(op) for op in Workload(seed=args.seed).operations(args.n)]
    finals = [folded(op) for op in operations]
    codec = default_codec()
    wire = sum(len(codec.encode(e)) for op in operations for e in op)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    operations_cache: dict[str, ExecutionRecord] = {}
    deliveries_cache: dict[str, dict[str, DeliveryRecord]] = {}
    for record, deliveries in finals:
        if record is not None:
            operations_cache[record.operation_id] = execution_from_row(execution_row(record))
        if deliveries:
            first = next(iter(deliveries.values()))
            deliveries_cache[first.operation_id] = {
                name: delivery_from_row(delivery_row(r)) for name, r in deliveries.items()
            }
    after = tracemalloc.take_snapshot()
    held = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_operation = held / max(1, len(operations_cache))
    print(f"operations {len(operations_cache):,}, with deliveries {len(deliveries_cache):,}")
    print(f"cache, bytes per operation          {per_operation:>10,.0f}")
    print(f"encoded events, bytes per operation {wire / len(operations):>10,.0f}  (baseline)")
    print(f"ratio cache / wire                  {per_operation / (wire / len(operations)):>10.1f}")
    at_limit = per_operation * ROW_CACHE_LIMIT / 1e6
    print(f"at ROW_CACHE_LIMIT ({ROW_CACHE_LIMIT:,})         {at_limit:>10.1f} MB")


if __name__ == "__main__":
    main()
