"""Append -> row-visible latency through the real projector at a steady rate, against the raw
broker round trip (produce -> plain confluent consumer) measured in the same run. Not a test;
needs the local stack (``opledger stack up``).

Projector phase: ``opledger projector run`` starts as a subprocess on a private topic prefix and
database. A paced producer appends whole ``Workload`` operations at ``--rate`` events/s in small
batches (every ``--tick-ms``: produce what is due, then ``flush()`` for the acks, as an SDK call
does). Each event's append time is ``time.time()`` taken just before its ``produce()``. A poller
reads ``SELECT event_id, projected_at FROM operation_history WHERE projected_at > last`` every
``--poll-ms``.

    latency = projected_at - append time      (projected_at: the DB's now() at the start of the
                                              projector's transaction, same machine clock; it is
                                              a little before the commit makes the row visible)
    seen    = when the poller saw the row - append time  (an upper bound: + up to one poll period)

Baseline phase: the same paced producer, same events and sizes, onto another private prefix,
read by a plain confluent consumer; latency = consume time - append time.

    ratio = projector p99 / broker round-trip p99          (target: projector p99 <= 250 ms)

    PYTHONPATH=. python bench/bench_latency.py [--rate 2000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

from benchenv import isolated, producer
from ledger.codec import default_codec
from ledger.domain.events import Transition
from ledger.kafka import connection_config
from ledger.settings import Settings
from opledger.workload import Workload

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Encoded:
    """One event ready to append: its machine (which topic), key, bytes, and the id the poller
    sees. The topic is resolved per phase, so each phase writes only to its own prefix."""

    machine: str
    key: bytes
    value: bytes
    event_id: str


@dataclass(slots=True)
class Clocks:
    """Append time per event (keyed by event_id), filled by the producer, read by the waiter."""

    appended: dict[str, float] = field(default_factory=dict)
    acked: dict[str, float] = field(default_factory=dict)


def operations(events: int, seed: int) -> list[list[Encoded]]:
    """Whole operations, pre-encoded (not timed), until at least ``events`` events."""
    codec = default_codec()
    out: list[list[Encoded]] = []
    total = 0
    workload = Workload(seed=seed)
    while total < events:
        op: list[Transition] = workload.operation()
        out.append(
            [Encoded(e.kind, e.operation_id.encode(), codec.encode(e), e.event_id) for e in op]
        )
        total += len(op)
    return out


def paced_append(
    settings: Settings,
    p: Producer,
    ops: Sequence[list[Encoded]],
    *,
    rate: float,
    tick_s: float,
    clocks: Clocks,
) -> float:
    """Append ``ops`` at ``rate`` events/s, flushing every tick; returns the achieved rate."""
    if not settings.topic_prefix.startswith("bench"):
        raise SystemExit(f"refusing to append to non-benchmark topics {settings.topic_prefix}.*")
    sent = 0
    i = 0
    started = time.perf_counter()
    next_tick = started
    while i < len(ops):
        due = rate * (time.perf_counter() - started)
        batch: list[Encoded] = []
        while i < len(ops) and sent < due:
            batch.extend(ops[i])
            sent += len(ops[i])
            i += 1
        for e in batch:

            def acked(err: object, _msg: object, event_id: str = e.event_id) -> None:
                if err is None:
                    clocks.acked[event_id] = time.time()

            topic = (
                settings.execution_topic if e.machine == "execution" else settings.delivery_topic
            )
            clocks.appended[e.event_id] = time.time()
            p.produce(topic, key=e.key, value=e.value, on_delivery=acked)
        if batch and p.flush(30):
            raise SystemExit("broker did not acknowledge a batch within 30 s")
        next_tick += tick_s
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    return sent / (time.perf_counter() - started)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": ordered[-1]}


def show(label: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = {k: v * 1000 for k, v in percentiles(seconds).items()}
    print(
        f"{label:44} p50 {ms['p50']:7.1f}  p90 {ms['p90']:7.1f}  p99 {ms['p99']:7.1f}  "
        f"max {ms['max']:7.1f} ms  (n={len(seconds):,})"
    )
    return ms


# --- the projector phase ------------------------------------------------------------------------


class HistoryPoller(threading.Thread):
    """Reads newly projected history rows every ``period`` seconds."""

    def __init__(self, dsn: str, period: float) -> None:
        super().__init__(daemon=True)
        self._dsn = dsn
        self._period = period
        self._halt = threading.Event()
        self.projected: dict[str, float] = {}
        self.seen: dict[str, float] = {}

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            # One projector, one transaction at a time: projected_at (its transaction's start)
            # grows from commit to commit, so "> last" misses nothing.
            last = conn.execute(
                "SELECT coalesce(max(projected_at), '-infinity') FROM operation_history"
            ).fetchone()[0]  # type: ignore[index]  # an aggregate always returns one row
            while not self._halt.is_set():
                rows = conn.execute(
                    "SELECT event_id, projected_at FROM operation_history WHERE projected_at > %s",
                    (last,),
                ).fetchall()
                now = time.time()
                for event_id, projected_at in rows:
                    self.projected[event_id] = projected_at.timestamp()
                    self.seen[event_id] = now
                    last = max(last, projected_at)
                self._halt.wait(self._period)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_projector(
    settings: Settings, workdir: Path, batch: int | None
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OPLEDGER_TOPIC_PREFIX": settings.topic_prefix,
        "OPLEDGER_PG_DSN": settings.dsn,
        "OPLEDGER_PROJECTOR_WEB_PORT": str(free_port()),
        "OPLEDGER_LOG_LEVEL": "WARNING",
    }
    if batch:
        env["OPLEDGER_PROJECTOR_BATCH"] = str(batch)
    log = (workdir / "projector.log").open("wb")
    # cwd: faust keeps a <app>-data directory in the working directory.
    return subprocess.Popen(
        [sys.executable, "-m", "opledger.cli", "projector", "run"],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop_projector(proc: subprocess.Popen[bytes], workdir: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def projector_phase(
    base: Settings, ops: Sequence[list[Encoded]], warmup: list[Encoded], args: argparse.Namespace
) -> tuple[Clocks, HistoryPoller, float]:
    with isolated(base, "lat") as env, tempfile.TemporaryDirectory() as tmp:
        settings = env.settings
        workdir = Path(tmp)
        proc = start_projector(settings, workdir, args.batch)
        try:
            # Warm-up: one operation must come through before timing starts (faust start-up,
            # partition assignment, migrations).
            # One producer per phase, warmed up too (an idempotent producer's first batch waits
            # for its producer id and metadata).
            p = producer(settings, linger_ms=1)
            paced_append(
                settings, p, [warmup], rate=args.rate, tick_s=args.tick_ms / 1000, clocks=Clocks()
            )
            with psycopg.connect(settings.dsn, autocommit=True) as conn:

                def visible() -> bool:
                    if proc.poll() is not None:
                        tail = (workdir / "projector.log").read_text(errors="replace")[-3000:]
                        raise SystemExit(f"projector exited with {proc.returncode}:\n{tail}")
                    try:
                        row = conn.execute("SELECT count(*) FROM operation_history").fetchone()
                    except psycopg.errors.UndefinedTable:
                        return False
                    return row is not None and row[0] >= len(warmup)

                wait_for(visible, 90, "the projector to start")
            poller = HistoryPoller(settings.dsn, args.poll_ms / 1000)
            poller.start()
            clocks = Clocks()
            achieved = paced_append(
                settings, p, ops, rate=args.rate, tick_s=args.tick_ms / 1000, clocks=clocks
            )
            wait_for(
                lambda: poller.projected.keys() >= clocks.appended.keys(),
                60,
                "every appended event to be projected",
            )
            poller.stop()
            poller.join()
        finally:
            stop_projector(proc, workdir)
        return clocks, poller, achieved


# --- the broker round-trip baseline -------------------------------------------------------------


class RawReader(threading.Thread):
    """A plain confluent consumer on both topics from their ends, timing each record's arrival."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True)
        self._halt = threading.Event()
        self.arrived: dict[bytes, float] = {}
        self.ready = threading.Event()
        self._consumer = Consumer(
            {
                **connection_config(settings),
                "group.id": "bench-latency-raw",
                "enable.auto.commit": False,
            }
        )
        meta = self._consumer.list_topics(timeout=10)
        self._consumer.assign(
            [
                TopicPartition(topic, p, OFFSET_END)
                for topic in (settings.execution_topic, settings.delivery_topic)
                for p in meta.topics[topic].partitions
            ]
        )

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                # poll(), not consume(n, timeout): consume waits to fill its batch, which would
                # add up to the timeout to the round trip being measured.
                m = self._consumer.poll(0.05)
                self.ready.set()
                if m is not None and m.error() is None and (value := m.value()) is not None:
                    self.arrived[value] = time.time()
        finally:
            self._consumer.close()


def baseline_phase(
    base: Settings, ops: Sequence[list[Encoded]], warmup: list[Encoded], args: argparse.Namespace
) -> tuple[list[float], float]:
    with isolated(base, "latraw") as env:
        settings = env.settings
        reader = RawReader(settings)
        reader.start()
        reader.ready.wait(30)
        time.sleep(0.5)  # let the OFFSET_END positions resolve before the first append
        p = producer(settings, linger_ms=1)
        paced_append(
            settings, p, [warmup], rate=args.rate, tick_s=args.tick_ms / 1000, clocks=Clocks()
        )
        wait_for(lambda: all(e.value in reader.arrived for e in warmup), 30, "the raw consumer")
        clocks = Clocks()
        achieved = paced_append(
            settings, p, ops, rate=args.rate, tick_s=args.tick_ms / 1000, clocks=clocks
        )
        appended = {e.value: clocks.appended[e.event_id] for op in ops for e in op}
        wait_for(lambda: reader.arrived.keys() >= appended.keys(), 30, "every raw record")
        reader.stop()
        reader.join()
        return [reader.arrived[v] - t for v, t in appended.items()], achieved


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000, help="events/s appended")
    parser.add_argument("--seconds", type=float, default=20, help="length of each phase")
    parser.add_argument("--tick-ms", type=float, default=10, help="producer flush period")
    parser.add_argument("--poll-ms", type=float, default=20, help="history poll period")
    parser.add_argument(
        "--batch", type=int, default=None, help="OPLEDGER_PROJECTOR_BATCH of the projector"
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    base = Settings.from_env()
    count = int(args.rate * args.seconds)
    ops = operations(count, args.seed)
    warmup = operations(1, args.seed + 1)[0]
    n = sum(len(op) for op in ops)
    print(
        f"{n:,} events in {len(ops):,} operations at {args.rate:,.0f}/s "
        f"(tick {args.tick_ms:.0f} ms, poll {args.poll_ms:.0f} ms)",
        flush=True,
    )

    raw, raw_rate = baseline_phase(base, ops, warmup, args)
    clocks, poller, proj_rate = projector_phase(base, ops, warmup, args)

    latency = [poller.projected[k] - t for k, t in clocks.appended.items()]
    seen = [poller.seen[k] - t for k, t in clocks.appended.items()]
    from_ack = [poller.projected[k] - clocks.acked[k] for k in clocks.appended if k in clocks.acked]
    print()
    print(f"achieved append rate: baseline {raw_rate:,.0f}/s, projector phase {proj_rate:,.0f}/s")
    r = show("raw broker round trip (produce -> consume)", raw)
    p = show("projector: projected_at - append", latency)
    show("projector: projected_at - broker ack", from_ack)
    show("projector: seen by poller - append", seen)
    print(
        f"ratio = projector p99 / raw p99 = {p['p99'] / r['p99']:.1f}  "
        f"(target p99 <= 250 ms: {'met' if p['p99'] <= 250 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
