"""Delivery worker throughput: SUCCEEDED executions -> signed webhook POSTs, acknowledged.

Setup (untimed): ``-n`` operations are appended SUCCEEDED (INTENT, DISPATCHED, SUCCEEDED on the
execution topic, results in the result store), a grant and one webhook destination are written,
and ``opledger projector run`` (a subprocess, as deployed) projects them. The receiver is a
separate process: an aiohttp app that answers 202 at once and counts requests and distinct keys.

Timed, opledger: a ``DeliveryWorker`` in this process, from the moment its consumer group
assigns it the partitions (the seconds of joining the group are printed beside) to the last
acknowledgement: the outbox reads the SUCCEEDED records and appends one PENDING each, then every
delivery is recorded SENT, POSTed (signed), and recorded ACKED. The projector keeps running.

Timed, baseline ("the same HTTP client posting the same bodies without opledger"): the worker's
own ``WebhookSender`` with the same concurrency posts the same bodies with the same signed
headers, in batches of the worker's pass size, to the same receiver.

Prints deliveries/s of both and their ratio; the receiver's counts prove each was delivered
exactly once.

    .venv/bin/python bench/bench_delivery.py [-n 20000] [--concurrency 256]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry

from benchenv import cpu_seconds, isolated, machine_seconds, produce_all, stack_cpu_seconds
from ledger.codec import default_codec
from ledger.destinations import DestinationStore, Kind, new_secret
from ledger.domain.events import ExecutionTransitioned, PolicyChange, PolicyChanged
from ledger.domain.ids import content_ref, event_id, operation_id, request_hash
from ledger.domain.states import ExecutionState
from ledger.heap import freeze_startup_heap
from ledger.history import HistoryReader
from ledger.log import KafkaTransport, end_offsets
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_keys import ensure_local_keys
from ledger.policy_store import PolicyStore
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.delivery.payload import Delivery, webhook_headers
from processors.delivery.senders import WebhookSend, WebhookSender
from processors.delivery.worker import SEND_BATCH, DeliveryWorker

REPO = Path(__file__).resolve().parents[1]
TENANT = "bench"
ACTOR = "agent-1"
TOOL = "send_email"
DESTINATION = "bench-hooks"
CORES = os.cpu_count() or 1

#: The aiohttp app the first measurements used (``--receiver aiohttp``).
AIOHTTP_RECEIVER = r"""
import sys
from aiohttp import web
count = 0
keys = set()
async def events(request):
    global count
    await request.read()
    count += 1
    keys.add(request.headers.get("Idempotency-Key"))
    return web.json_response({"delivery": "accepted"}, status=202)
async def stats(request):
    return web.json_response({"count": count, "keys": len(keys)})
async def reset(request):
    global count
    count = 0
    keys.clear()
    return web.json_response({})
app = web.Application()
app.router.add_post("/events", events)
app.router.add_get("/stats", stats)
app.router.add_post("/reset", reset)
import uvloop
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

#: The default receiver: the same three routes as an asyncio protocol on uvloop with httptools
#: parsing each request (keep-alive, Content-Length or chunked bodies read through), about a
#: quarter of aiohttp's CPU per request: on a 2-core box every microsecond the receiver spends
#: is one the worker does not get.
LEAN_RECEIVER = r"""
import asyncio, json, sys
import httptools, uvloop
count = 0
keys = set()
class Receiver(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.key = None
    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
            self.transport.close()
    def on_message_begin(self):
        self.url = b""
        self.key = None
    def on_url(self, url):
        self.url += url
    def on_header(self, name, value):
        if name.lower() == b"idempotency-key":
            self.key = value
    def on_message_complete(self):
        global count
        route = (self.parser.get_method(), self.url)
        if route == (b"POST", b"/events"):
            count += 1
            keys.add(self.key)
            status, body = b"202 Accepted", b'{"delivery":"accepted"}'
        elif route == (b"GET", b"/stats"):
            status, body = b"200 OK", json.dumps({"count": count, "keys": len(keys)}).encode()
        elif route == (b"POST", b"/reset"):
            count = 0
            keys.clear()
            status, body = b"200 OK", b"{}"
        else:
            status, body = b"404 Not Found", b"{}"
        keep = self.parser.should_keep_alive()
        self.transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, len(body), b"" if keep else b"Connection: close\r\n", body)
        )
        if not keep:
            self.transport.close()
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Receiver, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    await server.serve_forever()
uvloop.run(main())
"""

RECEIVERS = {"lean": LEAN_RECEIVER, "aiohttp": AIOHTTP_RECEIVER}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def receiver_stats(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as answer:
        stats: dict[str, int] = json.loads(answer.read())
        return stats


def wait_for(check: object, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def setup(settings: Settings, n: int, url: str) -> tuple[str, list[Delivery]]:
    """N SUCCEEDED operations with stored results, a grant, a destination."""
    now = datetime.now(UTC)
    ms = int(now.timestamp() * 1000)
    events: list[ExecutionTransitioned] = []
    deliveries: list[Delivery] = []
    results: list[tuple[str, str, str, bytes, int]] = []
    for i in range(n):
        op = operation_id(ms, os.urandom(10))
        payload = json.dumps({"message_id": f"m-{i}", "pad": "x" * 200}).encode()
        ref = content_ref(payload)
        rhash = request_hash(TOOL, {"n": i})
        for state, attempt in (
            (ExecutionState.INTENT_RECORDED, 0),
            (ExecutionState.DISPATCHED, 1),
            (ExecutionState.SUCCEEDED, 1),
        ):
            events.append(
                ExecutionTransitioned(
                    event_id=event_id(ms, os.urandom(10)),
                    operation_id=op,
                    tenant_id=TENANT,
                    actor_id=ACTOR,
                    occurred_at=now,
                    attempt=attempt,
                    state=state,
                    tool_name=TOOL,
                    request_hash=rhash,
                    result_ref=ref if state is ExecutionState.SUCCEEDED else None,
                )
            )
        results.append((TENANT, ref, "application/json", payload, len(payload)))
        deliveries.append(Delivery(op, TENANT, TOOL, DESTINATION, ref, "application/json", payload))
    with (
        psycopg.connect(settings.dsn) as conn,
        conn.cursor() as cur,
        cur.copy(
            "COPY results (tenant_id, result_ref, content_type, payload, size_bytes) FROM STDIN"
        ) as copy,
    ):
        for row in results:
            copy.write_row(row)
    grant = PolicyChanged(
        event_id=event_id(ms, os.urandom(10)),
        tenant_id=TENANT,
        actor_id="bench",
        occurred_at=now,
        change=PolicyChange.GRANT,
        principal=ACTOR,
        tool_name=TOOL,
        destinations=(DESTINATION,),
    )
    grant = ensure_local_keys(settings).sign(grant)  # as `opledger policy grant` signs it
    produce_all(settings, events)
    from benchenv import producer  # noqa: PLC0415

    p = producer(settings)
    p.produce(settings.policy_topic, key=grant.subject_key(), value=default_codec().encode(grant))
    assert p.flush(30) == 0
    secret = new_secret()
    with open_pool(settings.dsn, name="bench-setup", max_size=1) as pool:
        DestinationStore(pool, settings).add(
            tenant_id=TENANT,
            name=DESTINATION,
            kind=Kind.WEBHOOK,
            target=url,
            tools=[TOOL],
            changed_by="bench",
            secret=secret,
        )
    return secret, deliveries


def projected_everything(settings: Settings) -> bool:
    ends = end_offsets(settings, [settings.execution_topic, settings.delivery_topic])
    with psycopg.connect(settings.dsn) as conn:
        stored = dict(
            ((t, p), o)
            for t, p, o in conn.execute(
                "SELECT topic, partition, next_offset FROM projector_offsets"
            ).fetchall()
        )
    return all(stored.get(k, 0) >= v for k, v in ends.items())


#: Seconds from the worker's first pass to its partitions' assignment (the group join).
JOIN_SECONDS: list[float] = []


def timed_worker(settings: Settings, n: int, concurrency: int) -> tuple[float, float]:
    """(seconds from the partitions' assignment to the n-th acknowledgement, CPU of this thread
    from the first pass)."""
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    pool = open_pool(settings.dsn, name="bench-delivery", max_size=8)
    transport = KafkaTransport(settings)
    history = HistoryReader(settings, pool)
    webhooks = WebhookSender(concurrency=concurrency, metrics=metrics)
    worker = DeliveryWorker(
        settings,
        pool=pool,
        transport=transport,
        history=history,
        results=ResultStore(pool),
        destinations=DestinationStore(pool, settings),
        policy=PolicyStore(pool, settings).evaluate_many,
        webhooks=webhooks,
        metrics=metrics,
    )
    # A deployed worker joins its consumer group once and then runs for days: the timer starts
    # when the group hands it its partitions (nothing can be read before), and the seconds
    # spent joining are reported beside it.
    assigned_at: list[float] = []
    on_assign = worker.outbox._on_assign

    def noting_assignment(consumer: Any, partitions: Any) -> None:
        if not assigned_at:
            assigned_at.append(time.perf_counter())
        on_assign(consumer, partitions)

    worker.outbox._on_assign = noting_assignment  # type: ignore[method-assign]
    freeze_startup_heap()  # as the worker's host does once it has started (processors/host.py)
    try:
        worker.join()
        acked = metrics.deliveries.labels(DESTINATION, "acked")
        started, cpu = time.perf_counter(), time.thread_time()
        while acked._value.get() < n:
            worker.run_once(timeout=0.05)
            if time.perf_counter() - started > 600:
                raise SystemExit(f"worker acknowledged only {acked._value.get()} of {n}")
        JOIN_SECONDS.append(assigned_at[0] - started)
        return time.perf_counter() - assigned_at[0], time.thread_time() - cpu
    finally:
        worker.close()
        webhooks.close()
        history.close()
        transport.close()
        pool.close()


def timed_baseline(
    url: str, secret: str, deliveries: list[Delivery], concurrency: int
) -> tuple[float, float]:
    sender = WebhookSender(concurrency=concurrency)
    try:
        started, cpu = time.perf_counter(), time.thread_time()
        for start in range(0, len(deliveries), SEND_BATCH):
            now = datetime.now(UTC)
            sends = []
            for delivery in deliveries[start : start + SEND_BATCH]:
                body = delivery.body()
                sends.append(
                    WebhookSend(url, webhook_headers(delivery, body, secret, now), body, 10.0)
                )
            answers = sender.send_many(sends)
            bad = [a for a in answers if a.status != 202]
            if bad:
                raise SystemExit(f"baseline: {len(bad)} sends failed, e.g. {bad[0]}")
        return time.perf_counter() - started, time.thread_time() - cpu
    finally:
        sender.close()


def start(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass(frozen=True, slots=True)
class Phase:
    """One timed phase: its wall seconds and the CPU seconds each process used meanwhile."""

    seconds: float
    cpu: dict[str, float]
    #: the share of all cores' time that was not idle
    busy: float


def measured(
    settings: Settings, pids: dict[str, int], run: Callable[[], tuple[float, float]]
) -> Phase:
    """``run()`` (which returns its own timed seconds and its thread's CPU seconds), with the
    CPU of this whole process (every thread: the worker's, the sender loop's, librdkafka's),
    of ``pids``, of the broker and of PostgreSQL around it, and how busy the machine was."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    before.update(stack_cpu_seconds(settings))
    own = time.process_time()
    all_before, idle_before = machine_seconds()
    seconds, main_thread = run()
    all_after, idle_after = machine_seconds()
    cpu = {"this process": time.process_time() - own, "main thread": main_thread}
    cpu.update({name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})
    cpu.update({name: used - before[name] for name, used in stack_cpu_seconds(settings).items()})
    total = all_after - all_before
    busy = (total - (idle_after - idle_before)) / total if total else 0.0
    return Phase(seconds, cpu, busy)


def report(args: argparse.Namespace, worker: Phase, baseline: Phase) -> None:
    n = args.n
    worker_rate, raw_rate = n / worker.seconds, n / baseline.seconds
    print(f"deliveries             {n}, concurrency {args.concurrency}, receiver {args.receiver}")
    print(
        f"opledger worker        {worker_rate:9.0f} deliveries/s  ({worker.seconds:.2f} s: "
        "outbox + SENT + signed POST + ACKED, each acknowledged)"
    )
    if JOIN_SECONDS:
        join = JOIN_SECONDS[-1]
        print(
            f"  before that, joining the consumer group took {join:.2f} s (not timed; "
            f"with it: {n / (worker.seconds + join):.0f} deliveries/s)"
        )
    print(f"raw client baseline    {raw_rate:9.0f} deliveries/s  ({baseline.seconds:.2f} s)")
    print(f"ratio                  {worker_rate / raw_rate:9.2f}  (opledger / raw)")
    print("receiver: every delivery arrived exactly once (distinct keys == requests == n)")
    names = list(worker.cpu)
    # The main thread is a part of this process; the rest are separate processes.
    parts = [k for k in names if k != "main thread"]
    print(
        "CPU per delivery, us   "
        + "".join(f"{name:>13}" for name in names)
        + f"{'all':>8}{'ceiling/s':>11}{'busy':>6}"
    )
    for label, phase in (("opledger worker", worker), ("raw client baseline", baseline)):
        total = sum(phase.cpu[k] for k in parts) / n
        print(
            f"{label:<23}"
            + "".join(f"{1e6 * phase.cpu[k] / n:13.0f}" for k in names)
            + f"{1e6 * total:8.0f}{CORES / total:11.0f}{100 * phase.busy:5.0f}%"
        )
    print(
        f"all = this process + receiver + projector + broker + PostgreSQL; ceiling = {CORES} "
        "cores / all: the deliveries/s this machine allows with every core busy"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f} (2 cores, shared)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20_000, help="deliveries (default 20000)")
    parser.add_argument("--concurrency", type=int, default=256, help="sends in flight")
    parser.add_argument(
        "--receiver", choices=sorted(RECEIVERS), default="lean", help="the receiving process"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the worker phase (cProfile, top 30)"
    )
    args = parser.parse_args()
    base = Settings.from_env()
    with isolated(base, "delivery") as env, tempfile.TemporaryDirectory() as tmp:
        # The receiver listens on loopback, which webhooks may not reach unless allowed
        # (decision 019), as the local stack's delivery worker allows it.
        settings = env.settings.with_(delivery_allow_networks="127.0.0.0/8")
        workdir = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}/events"
        child_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OPLEDGER_TOPIC_PREFIX": settings.topic_prefix,
            "OPLEDGER_PG_DSN": settings.dsn,
            "OPLEDGER_PROJECTOR_WEB_PORT": str(free_port()),
            "OPLEDGER_LOG_LEVEL": "WARNING",
        }
        receiver = start(
            [sys.executable, "-c", RECEIVERS[args.receiver], str(port)],
            child_env,
            workdir / "rx.log",
            workdir,
        )
        projector = start(
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            child_env,
            workdir / "projector.log",
            workdir,
        )
        pids = {"receiver": receiver.pid, "projector": projector.pid}
        try:
            wait_for(lambda: receiver_stats(port) is not None, "the receiver")
            print(f"setup: {args.n} SUCCEEDED operations, one webhook destination ...", flush=True)
            secret, deliveries = setup(settings, args.n, url)
            wait_for(lambda: projected_everything(settings), "the projector", 300)

            if args.profile:
                import cProfile  # noqa: PLC0415
                import pstats  # noqa: PLC0415

                profiler = cProfile.Profile()
                profiler.enable()
            worker = measured(
                settings, pids, lambda: timed_worker(settings, args.n, args.concurrency)
            )
            if args.profile:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            stats = receiver_stats(port)
            if stats != {"count": args.n, "keys": args.n}:
                raise SystemExit(f"receiver saw {stats}, expected {args.n} distinct deliveries")
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{port}/reset", method="POST"),
                timeout=10,
            ).read()
            baseline = measured(
                settings, pids, lambda: timed_baseline(url, secret, deliveries, args.concurrency)
            )
            stats = receiver_stats(port)
            if stats["count"] != args.n:
                raise SystemExit(f"baseline: receiver saw {stats}")
        finally:
            stop(projector)
            stop(receiver)
        report(args, worker, baseline)


if __name__ == "__main__":
    main()
