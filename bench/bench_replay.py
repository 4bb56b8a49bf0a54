"""``opledger replay`` throughput against a raw ``consume()`` plus ``COPY`` of the same rows,
measured in the same run (issue 20's goal: >= 50,000 events/s and >= 0.5x the raw path). Not a
test; needs the local stack (``opledger stack up``).

1. Untimed: N events of ``opledger.workload.Workload`` appended under a private prefix, and
   projected by the projector into the prefix's database: the live projections.
2. Timed, replay: ``opledger.replay.replay`` as the command runs it (a fresh database, the
   projector's fold with ``rebuild=True`` up to the cut, then the comparison with the live one).
   Its fold and its comparison are reported apart.
3. Timed, audits: ``opledger.audit.audit`` of operations sampled from the live projection,
   in this process (the log's part and the whole call), and ``opledger audit`` as a command
   (Python's start included) for a few of them (issue 20's goal: under 1 s among 1,000,000).
4. Timed, the floor: the same events' bytes decoded and validated, then folded in memory, in
   this process with neither Kafka nor PostgreSQL: what a one-process rebuild cannot go below.
5. Timed, baseline: a raw confluent-kafka ``consume(5000, 0.05)`` of every record from offset 0
   (no decode), then the same rows ``COPY``-ed into a fresh database (``bench_projector``'s
   ``raw_write``, the faster of text and binary).

    ratio = replay fold events/s / (events / (consume s + COPY s))

    PYTHONPATH=. python bench/bench_replay.py [-n 200000] [--seed 7]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from bench_projector import drain, fold_in_memory, raw_write, workload_events
from benchenv import isolated, produce_all
from ledger.log import end_offsets, new_consumer
from ledger.settings import Settings
from opledger.audit import audit
from opledger.replay import replay

ROOT = Path(__file__).resolve().parents[1]


def time_audits(settings: Settings, samples: int, seed: int) -> None:
    """Audits of sampled operations: in process, then as the command."""
    from ledger import pg  # noqa: PLC0415

    with pg.connect(settings.dsn, name="bench-audit", read_only=True) as conn:
        ops = conn.execute("SELECT operation_id, tenant_id FROM agent_operations").fetchall()
    picked = random.Random(seed).sample(ops, min(samples, len(ops)))
    reads, calls, events = [], [], []
    for op, tenant in picked:
        started = time.perf_counter()
        result = audit(settings, op, tenant)
        calls.append(time.perf_counter() - started)
        assert result is not None and not result.disagreements, (op, result)
        reads.append(result.read_seconds)
        events.append(len(result.lines))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OPLEDGER_TOPIC_PREFIX": settings.topic_prefix,
        "OPLEDGER_PG_DATABASE": settings.pg_database,
    }
    commands = []
    for op, tenant in picked[:5]:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "opledger.cli", "audit", op, "--tenant", tenant],
            env=env,
            capture_output=True,
            check=False,
        )
        commands.append(time.perf_counter() - started)
        assert done.returncode == 0, done.stderr
    print(
        f"audit: {len(picked)} operations ({statistics.median(events):.0f} events median): "
        f"the log's part p50 {statistics.median(reads) * 1000:.0f} ms, max "
        f"{max(reads) * 1000:.0f} ms; the call p50 {statistics.median(calls) * 1000:.0f} ms, "
        f"max {max(calls) * 1000:.0f} ms; the command (Python's start included) p50 "
        f"{statistics.median(commands):.2f} s, max {max(commands):.2f} s (goal < 1 s)",
        flush=True,
    )


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


def cpu_floor(events: list[Any], coords: list[tuple[str, int, int]]) -> tuple[float, float]:
    """Seconds to decode and validate the events' bytes (what every rebuild does to every
    record, so a bad one is dead-lettered as the live projector would) and to fold them in
    memory: the work of a rebuild with the log and the database taken away. Each decoded event
    is dropped as the rebuild drops a folded batch (a million kept alive would time the
    garbage collector's passes over them instead)."""
    from ledger.codec import default_codec  # noqa: PLC0415

    codec = default_codec()
    values = [codec.encode(event) for event in events]
    started = time.perf_counter()
    for value in values:
        codec.decode(value)
    decode_s = time.perf_counter() - started
    started = time.perf_counter()
    fold_in_memory(events, coords)
    return decode_s, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-n", "--events", type=int, default=200_000, help="events to replay")
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    parser.add_argument("--audits", type=int, default=20, help="operations to audit")
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

        time_audits(settings, args.audits, args.seed)

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
        decode_s, fold_s = cpu_floor(events, coords)
        n_events = len(events)
        per_event_us = {
            "decode and validate": decode_s,
            "fold": fold_s,
            "consume": consume_s,
            "COPY": history_s + upsert_s,
        }
        parts = ", ".join(f"{k} {v / n_events * 1e6:.1f}" for k, v in per_event_us.items())
        cpu_us = sum(per_event_us.values()) / n_events * 1e6
        client_us = cpu_us - per_event_us["COPY"] / n_events * 1e6
        cores = os.cpu_count() or 1
        print(
            f"floor: per event, each part measured alone in this run (us): {parts}; "
            f"{cpu_us:.1f} us in all (COPY's time counted whole). One process decoding, "
            f"folding and consuming: at most {1e6 / client_us:,.0f} events/s; all of it on "
            f"{cores} cores shared perfectly: at most {cores * 1e6 / cpu_us:,.0f} events/s "
            "(goal 50,000)",
            flush=True,
        )
        print(
            f"ratio replay fold / raw: {fold_rate / raw_rate:.2f}x (goal >= 0.5x); "
            f"fold {fold_rate:,.0f} events/s (goal >= 50,000); "
            f"whole command / raw: {report.records / total_s / raw_rate:.2f}x"
        )


if __name__ == "__main__":
    main()
