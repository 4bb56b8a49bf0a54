"""Projector throughput (topics -> PostgreSQL) against the fastest raw PostgreSQL write of the same
rows, measured in the same run. Not a test; needs the local stack (``opledger stack up``).

1. Untimed: N events from ``opledger.workload.Workload`` are appended to a private topic prefix,
   and folded in memory into the rows the projection must end up with (the history rows, one per
   event, and the final current-state rows of ``agent_operations`` and ``deliveries``).
2. Timed, projector: ``BatchProjector`` + ``PostgresProjection`` in this process drain both topics
   into a fresh database (``run_once()`` until the stored offsets reach the end offsets).
3. Timed, baseline: no Kafka, no decode, no fold - into a second fresh database with the same
   migrations, one ``COPY`` of the history rows into ``operation_history``, then a staged ``COPY``
   + ``INSERT ... ON CONFLICT (pk) DO UPDATE`` of the final rows into ``agent_operations`` and
   ``deliveries``; text and binary COPY are both tried and the faster counts.

    raw rate = events / (history COPY seconds + upsert seconds)
    ratio    = projector events/s / raw rate          (project goal >= 0.5; target >= 20,000/s)

    PYTHONPATH=. python bench/bench_projector.py [-n 200000] [--batch 5000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry

from benchenv import isolated, produce_all
from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned, Transition
from ledger.domain.fold import (
    Applied,
    DeliveryRecord,
    Duplicate,
    ExecutionRecord,
    apply_delivery,
    apply_execution,
)
from ledger.log import end_offsets
from ledger.metrics import Metrics
from ledger.records import Coordinates, SourcedEvent

# The projector's own row builders, so the baseline writes byte-for-byte the same rows.
from ledger.rows import DELIVERY_COLUMNS as _DELIVERY_COLUMNS
from ledger.rows import OP_COLUMNS as _OP_COLUMNS
from ledger.rows import delivery_row as _delivery_row
from ledger.rows import execution_row as _op_row
from ledger.settings import Settings
from opledger.workload import Workload
from processors.batch_reader import BatchProjector
from projections.schema import apply_migrations
from projections.writer import _HISTORY_COLUMNS, PostgresProjection, _history_row


@dataclass(frozen=True, slots=True)
class Rows:
    """What the projection must contain after the drain, computed without it."""

    history: list[tuple[Any, ...]]
    operations: list[tuple[Any, ...]]
    deliveries: list[tuple[Any, ...]]


def workload_events(count: int, seed: int) -> list[Transition]:
    """Whole operations from the seeded workload until at least ``count`` events."""
    events: list[Transition] = []
    workload = Workload(seed=seed)
    while len(events) < count:
        events.extend(workload.operation())
    return events


def fold_in_memory(events: Sequence[Transition], coords: Sequence[tuple[str, int, int]]) -> Rows:
    """The sequential fold (events are in per-operation order, as on their partitions)."""
    ops: dict[str, ExecutionRecord] = {}
    deliveries: dict[tuple[str, str], DeliveryRecord] = {}
    history: list[tuple[Any, ...]] = []
    for event, (topic, partition, offset) in zip(events, coords, strict=True):
        outcome: Any
        if isinstance(event, ExecutionTransitioned):
            outcome = apply_execution(ops.get(event.operation_id), event)
            if isinstance(outcome, Applied):
                ops[event.operation_id] = outcome.record
        else:
            key = (event.operation_id, event.destination)
            outcome = apply_delivery(deliveries.get(key), event, ops.get(event.operation_id))
            if isinstance(outcome, Applied):
                deliveries[key] = outcome.record
        label = (
            "applied"
            if isinstance(outcome, Applied)
            else "duplicate"
            if isinstance(outcome, Duplicate)
            else "anomaly"
        )
        item = SourcedEvent(Coordinates(topic, partition, offset), event, 0)
        history.append(_history_row(item, label))
    return Rows(
        history,
        [_op_row(r) for r in ops.values()],
        [_delivery_row(r) for r in deliveries.values()],
    )


# --- the projector ------------------------------------------------------------------------------


def drain(settings: Settings, batch: int, profiler: cProfile.Profile | None) -> tuple[float, int]:
    """(seconds, events) for the in-process projector to reach the topics' end offsets."""
    settings = settings.with_(projector_batch=batch)
    topics = (settings.execution_topic, settings.delivery_topic)
    ends = end_offsets(settings, topics)
    total = sum(ends.values())
    sink = PostgresProjection.connect(settings.dsn)
    projector = BatchProjector(settings, sink, default_codec(), Metrics.create(CollectorRegistry()))
    projector._consumer = projector._open()  # drive the loop step by step
    projected = 0
    try:
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        while True:
            report = projector.run_once()
            if report is None:
                continue
            projected += sum(report.applied.values()) + sum(report.duplicates.values())
            projected += sum(report.anomalies.values()) + report.dead_letters
            stored = sink.positions(settings.projector_group, topics)
            if all(stored.get(k, 0) >= high for k, high in ends.items()):
                break
        if profiler:
            profiler.disable()
        elapsed = time.perf_counter() - started
    finally:
        projector.close()
        sink.close()
    if projected != total:
        raise SystemExit(f"projector folded {projected} records but the topics hold {total}")
    return elapsed, total


def check_projection(dsn: str, rows: Rows) -> None:
    """The projector's tables hold the rows the in-memory fold predicts (counts and versions)."""
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT (SELECT count(*) FROM operation_history), "
            "(SELECT count(*) FROM agent_operations), (SELECT count(*) FROM deliveries), "
            "(SELECT coalesce(sum(version), 0) FROM agent_operations), "
            "(SELECT coalesce(sum(version), 0) FROM deliveries)"
        ).fetchone()
    version = _OP_COLUMNS.index("version")
    want = (
        len(rows.history),
        len(rows.operations),
        len(rows.deliveries),
        sum(r[version] for r in rows.operations),
        sum(r[_DELIVERY_COLUMNS.index("version")] for r in rows.deliveries),
    )
    if got != want:
        raise SystemExit(f"projection differs from the in-memory fold: {got} != {want}")


# --- the raw baseline ---------------------------------------------------------------------------


def _quoted(columns: Sequence[str]) -> str:
    return ", ".join(f'"{c}"' for c in columns)


def _type_oids(conn: psycopg.Connection[Any], table: str, columns: Sequence[str]) -> list[int]:
    rows = conn.execute(
        "SELECT attname, atttypid::int FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
        (table,),
    ).fetchall()
    types = dict(rows)
    return [types[c] for c in columns]


def _copy(
    cur: psycopg.Cursor[Any],
    table: str,
    columns: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    oids: list[int] | None,
) -> None:
    fmt = " (FORMAT BINARY)" if oids else ""
    with cur.copy(f"COPY {table} ({_quoted(columns)}) FROM STDIN{fmt}") as copy:
        if oids:
            copy.set_types(oids)
        for row in rows:
            copy.write_row(row)


def _upsert(
    cur: psycopg.Cursor[Any],
    table: str,
    keys: Sequence[str],
    columns: Sequence[str],
    *,
    rows: Sequence[tuple[Any, ...]],
    oids: list[int] | None,
) -> None:
    stage = f"stage_{table}"
    cur.execute(f"CREATE TEMP TABLE {stage} (LIKE {table}) ON COMMIT DROP")
    _copy(cur, stage, columns, rows, oids)
    updates = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in columns if c not in keys)
    cur.execute(
        f"INSERT INTO {table} ({_quoted(columns)}) SELECT {_quoted(columns)} FROM {stage} "
        f"ON CONFLICT ({_quoted(keys)}) DO UPDATE SET {updates}"
    )
    if cur.rowcount != len(rows):
        raise SystemExit(f"{table}: upsert wrote {cur.rowcount} of {len(rows)} rows")


def raw_write(dsn: str, rows: Rows, binary: bool) -> tuple[float, float]:
    """(history COPY seconds, upsert seconds), each a committed transaction into empty tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        apply_migrations(conn)
        conn.execute("TRUNCATE operation_history, agent_operations, deliveries")
        oids = {
            t: _type_oids(conn, t, c) if binary else None
            for t, c in (
                ("operation_history", _HISTORY_COLUMNS),
                ("agent_operations", _OP_COLUMNS),
                ("deliveries", _DELIVERY_COLUMNS),
            )
        }
        started = time.perf_counter()
        with conn.transaction(), conn.cursor() as cur:
            _copy(
                cur, "operation_history", _HISTORY_COLUMNS, rows.history, oids["operation_history"]
            )
        history_s = time.perf_counter() - started
        started = time.perf_counter()
        with conn.transaction(), conn.cursor() as cur:
            _upsert(
                cur,
                "agent_operations",
                ("operation_id",),
                _OP_COLUMNS,
                rows=rows.operations,
                oids=oids["agent_operations"],
            )
            _upsert(
                cur,
                "deliveries",
                ("operation_id", "destination"),
                _DELIVERY_COLUMNS,
                rows=rows.deliveries,
                oids=oids["deliveries"],
            )
        upsert_s = time.perf_counter() - started
    return history_s, upsert_s


# --- main ---------------------------------------------------------------------------------------


def print_profile(profiler: cProfile.Profile, top: int) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    print(out.getvalue())
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-n", "--events", type=int, default=200_000, help="events to project")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="projector batch (default: settings.projector_batch)",
    )
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also drain once more under cProfile and print the top",
    )
    parser.add_argument("--top", type=int, default=15, help="profile lines to print")
    args = parser.parse_args()

    base = Settings.from_env()
    batch = args.batch or base.projector_batch
    with isolated(base, "proj", extra_databases=2) as env:
        settings = env.settings
        raw_dsn, profile_dsn = env.extra_dsns
        t0 = time.perf_counter()
        events = workload_events(args.events, args.seed)
        coords = produce_all(settings, events)
        rows = fold_in_memory(events, coords)
        n = len(events)
        print(
            f"prepared {n:,} events ({len(rows.operations):,} operations, "
            f"{len(rows.deliveries):,} deliveries) on {settings.topic_prefix}.* "
            f"in {time.perf_counter() - t0:.1f}s (not timed)",
            flush=True,
        )

        seconds, drained = drain(settings, batch, None)
        check_projection(settings.dsn, rows)
        projector_rate = drained / seconds
        print(
            f"projector: {drained:,} events in {seconds:.2f}s = {projector_rate:,.0f} events/s "
            f"(batch {batch})",
            flush=True,
        )

        results = {}
        for binary in (False, True):
            history_s, upsert_s = raw_write(raw_dsn, rows, binary)
            results["binary" if binary else "text"] = (history_s, upsert_s)
            print(
                f"raw {'binary' if binary else 'text  '} COPY: history {history_s:.2f}s, "
                f"upserts {upsert_s:.2f}s",
                flush=True,
            )
        fmt, (history_s, upsert_s) = min(results.items(), key=lambda kv: sum(kv[1]))
        upserts = len(rows.operations) + len(rows.deliveries)
        raw_rate = n / (history_s + upsert_s)

        if args.profile:
            profiler = cProfile.Profile()
            prof_settings = settings.with_(pg_dsn=profile_dsn)
            p_seconds, _ = drain(prof_settings, batch, profiler)
            print(f"\nprofiled drain (cProfile overhead included): {n / p_seconds:,.0f} events/s")
            print_profile(profiler, args.top)

    print()
    print(f"events                       {n:,}")
    print(f"projector                    {projector_rate:,.0f} events/s  (target >= 20,000)")
    print(f"raw history COPY ({fmt:6})    {len(rows.history) / history_s:,.0f} rows/s")
    print(f"raw upserts ({fmt:6})         {upserts / upsert_s:,.0f} rows/s  ({upserts:,} rows)")
    print(f"raw rate = events / (history + upsert s) = {raw_rate:,.0f} events/s")
    print(f"ratio = projector / raw rate = {projector_rate / raw_rate:.2f}  (goal >= 0.5)")


if __name__ == "__main__":
    main()
