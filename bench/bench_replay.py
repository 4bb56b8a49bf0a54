"""``opledger replay`` throughput against a raw ``consume()`` plus ``COPY`` of the same rows,
measured in the same run (issue 20's goal: >= 50,000 events/s and >= 0.5x the raw path). Not a
test; needs the local stack (``opledger stack up``).

1. Untimed: N events of ``opledger.workload.Workload`` appended under a private prefix, and
   projected by the projector into the prefix's database: the live projections.
2. Timed, replay: ``opledger.replay.replay`` as the command runs it (a fresh database, the
   projector's fold with ``rebuild=True`` up to the cut, then the comparison with the live one).
   Its fold and its comparison are reported apart.
3. Timed, baseline: a raw confluent-kafka ``consume(5000, 0.05)`` of every record from offset 0
   (no decode), then the same rows ``COPY``-ed into a fresh database (``bench_projector``'s
   ``raw_write``, the faster of text and binary).

    ratio = replay fold events/s / (events / (consume s + COPY s))

    PYTHONPATH=. python bench/bench_replay.py [-n 200000] [--seed 7]
"""

from __future__ import annotations

import argparse
import io
import time
from types import SimpleNamespace

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from bench_projector import drain, fold_in_memory, raw_write, workload_events
from benchenv import isolated, produce_all
from ledger.log import end_offsets, new_consumer
from ledger.settings import Settings
from opledger.replay import replay


def raw_consume(settings: Settings) -> tuple[float, int]:
    """(seconds, records) to read every record of the execution and delivery topics."""
    topics = (settings.execution_topic, settings.delivery_topic)
    ends = end_offsets(settings, topics)
    total = sum(ends.values())
    consumer = new_consumer(
        settings, group_id=settings.readers_group("bench-replay"), client_id="bench-replay"
    )
    try:
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        seen = 0
        started = time.perf_counter()
        while seen < total:
            seen += sum(1 for m in consumer.consume(5000, 0.05) if m.error() is None)
        return time.perf_counter() - started, seen
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-n", "--events", type=int, default=200_000, help="events to replay")
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    args = parser.parse_args()

    base = Settings.from_env()
    with isolated(base, "replay", extra_databases=1) as env:
        settings = env.settings
        (raw_dsn,) = env.extra_dsns
        t0 = time.perf_counter()
        events = workload_events(args.events, args.seed)
        coords = produce_all(settings, events)
        rows = fold_in_memory(events, coords)
        live_s, n = drain(settings, settings.projector_batch, None)
        print(
            f"prepared {n:,} events ({len(rows.operations):,} operations) and their live "
            f"projection in {time.perf_counter() - t0:.1f}s (not timed; the projector folded "
            f"them at {n / live_s:,.0f} events/s)",
            flush=True,
        )

        started = time.perf_counter()
        report = replay(
            settings.as_pg_role("owner"),
            SimpleNamespace(into=None, keep=False, timeout=3600.0),
            io.StringIO(),
        )
        total_s = time.perf_counter() - started
        fold_rate = report.records / report.fold_seconds
        tables_equal = all(t["mismatches"] == 0 for t in report.tables)
        print(
            f"replay: {report.records:,} records folded in {report.fold_seconds:.2f}s = "
            f"{fold_rate:,.0f} events/s; compared in {total_s - report.fold_seconds:.2f}s; "
            f"whole command {total_s:.2f}s = {report.records / total_s:,.0f} events/s; "
            f"every table equal: {'yes' if tables_equal else 'NO'} (the workload's results "
            f"are made up: {len(report.results_wrong):,} of {report.results_checked:,} "
            "references name nothing stored, as the replay reports)",
            flush=True,
        )

        consume_s, consumed = raw_consume(settings)
        copies = {binary: raw_write(raw_dsn, rows, binary) for binary in (False, True)}
        binary, (history_s, upsert_s) = min(copies.items(), key=lambda kv: sum(kv[1]))
        raw_s = consume_s + history_s + upsert_s
        raw_rate = consumed / raw_s
        print(
            f"raw: consume() {consumed:,} records in {consume_s:.2f}s, "
            f"{'binary' if binary else 'text'} COPY {history_s + upsert_s:.2f}s "
            f"= {raw_rate:,.0f} events/s",
            flush=True,
        )
        print(
            f"ratio replay fold / raw: {fold_rate / raw_rate:.2f}x (goal >= 0.5x); "
            f"fold {fold_rate:,.0f} events/s (goal >= 50,000); "
            f"whole command / raw: {report.records / total_s / raw_rate:.2f}x"
        )


if __name__ == "__main__":
    main()
