"""Receiver latency: p99 of ``POST /events`` at a steady rate with deduplication on, against the
same HTTP server answering 202 without deduplication, measured in the same run. Not a test;
needs the local stack (``opledger stack up``).

Both servers run as subprocesses on 127.0.0.1, on uvloop: the receiver is ``opledger consumer
run`` on a private topic prefix and database (inbox + change committed per request, key
published to the compacted key store); the baseline is this file's ``--serve-baseline`` mode:
the receiver's server (``consumers.server.HttpServer``) with one route that reads the body and
answers the same 202 JSON, and no checks.

Requests are built before the clock starts (distinct operation ids, Standard Webhooks headers
signed with ``standardwebhooks``; ``--duplicates`` of them resend an earlier key with its body).
The load is open-loop: request ``i`` is due at ``t0 + i / rate`` and is sent then whatever the
earlier ones are doing, so a slow answer cannot hide the requests queued behind it:

    latency = answer received - due time        (includes any wait in the client)

Printed per server: p50 / p90 / p99 / max in ms, the achieved rate, non-2xx answers by status
(409s are resends of keys still in flight), the server process's CPU per request and how
busy the machine's cores were (other work on a shared box shows there); then
``ratio = receiver p99 / baseline p99`` and the goal ``receiver p99 <= 10 ms``. After the receiver
phase the consumer's tables are checked: one applied change per distinct key.

Beside the receiver phase a probe thread commits one row every 5 ms to the same PostgreSQL
(``--no-probe`` leaves it out): its latencies are the durable-commit floor each 202 stands on,
and the receiver's requests over 10 ms are matched against the probe's commits over 20 ms (a
request in flight while such a commit was). A second probe ``fdatasync``s 8 KiB every 5 ms to a
file beside the database (the same filesystem), without PostgreSQL: a disk whose fsync stalls
shows in both; stalls in the commit probe alone would be the database's.

    PYTHONPATH=. .venv/bin/python bench/bench_consumer_receiver.py [--rate 1000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import uvloop
from standardwebhooks import Webhook

from benchenv import isolated
from consumers import server as http
from consumers.contract import MAX_BODY_BYTES
from ledger.domain.ids import canonical_json, content_ref, operation_id
from ledger.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
DESTINATION = "webhook:bench"


@dataclass(frozen=True, slots=True)
class Request:
    op: str
    body: bytes
    headers: dict[str, str]


def build_requests(count: int, duplicates: float, seed: int) -> list[Request]:
    """``count`` signed requests; a ``duplicates`` share resends an earlier one's key and body."""
    rng = random.Random(seed)
    hook = Webhook(SECRET)
    now = int(time.time())
    out: list[Request] = []
    for _ in range(count):
        if out and rng.random() < duplicates:
            out.append(rng.choice(out))
            continue
        op = operation_id(int(time.time() * 1000), rng.randbytes(10))
        result = canonical_json({"status": "sent", "n": rng.randrange(10**9)})
        body = canonical_json(
            {
                "operation_id": op,
                "tenant_id": "acme",
                "tool_name": "send_email",
                "destination": DESTINATION,
                "result_ref": content_ref(result),
                "content_type": "application/json",
                "result_b64": base64.b64encode(result).decode(),
            }
        )
        webhook_id = f"{op}:{DESTINATION}"
        signature = hook.sign(webhook_id, datetime.fromtimestamp(now, tz=UTC), body.decode())
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": f'"{op}"',
            "webhook-id": webhook_id,
            "webhook-timestamp": str(now),
            "webhook-signature": signature,
        }
        out.append(Request(op, body, headers))
    return out


class Connection:
    """One persistent HTTP/1.1 connection, raw asyncio streams: with aiohttp's client the load
    generator itself fell behind at 1,000 requests/s on two cores (bench/README.md)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, request: Request) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{name}: {value}" for name, value in request.headers.items()]
        head.append(f"Content-Length: {len(request.body)}")
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + request.body)
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        length = 0
        close = False
        for line in header.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            lowered = name.strip().lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and value.strip().lower() == b"close":
                close = True
        await self.reader.readexactly(length)
        if close:
            self.writer.close()
            self.writer = None
        return status


async def load(
    port: int,
    requests: list[Request],
    rate: float,
    connections: int = 64,
    timeline: list[tuple[float, float]] | None = None,
) -> tuple[list[float], Counter[int], float]:
    """Open-loop load; returns latencies (s), non-2xx answers by status (0: the connection
    failed), and the achieved send rate. ``timeline`` (if given) gets (due, latency) pairs."""
    latencies: list[float] = []
    failures: Counter[int] = Counter()
    queue: asyncio.Queue[tuple[Request, float] | None] = asyncio.Queue()

    async def worker() -> None:
        connection = Connection("127.0.0.1", port)
        while (item := await queue.get()) is not None:
            request, due = item
            try:
                status = await connection.post("/events", request)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                connection = Connection("127.0.0.1", port)
                status = 0
            if status // 100 != 2:
                failures[status] += 1
            latencies.append(time.perf_counter() - due)
            if timeline is not None:
                timeline.append((due, latencies[-1]))
        if connection.writer is not None:
            connection.writer.close()

    workers = [asyncio.ensure_future(worker()) for _ in range(connections)]
    t0 = time.perf_counter() + 0.05
    for i, request in enumerate(requests):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((request, due))
    sent_rate = len(requests) / (time.perf_counter() - t0)
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    return latencies, failures, sent_rate


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (
        f"p50 {at(0.50):7.2f}  p90 {at(0.90):7.2f}  p99 {at(0.99):7.2f}  "
        f"max {ordered[-1] * 1000:7.2f} ms  (n={len(ordered)})"
    )


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def serve_baseline(port: int) -> None:
    """The receiver's server stack and loop answering 202 at once: no checks, no deduplication."""

    def events(request: http.Request) -> http.Response:
        key = request.headers.get("idempotency-key", "").strip('"')  # the body was read
        return http.json_response({"operation_id": key, "delivery": "accepted"}, 202)

    def healthz(_request: http.Request) -> http.Response:
        return http.json_response({"ready": True})

    async def main() -> None:
        routes = {
            ("POST", "/events"): http.Route(events, read_body=True),
            ("GET", "/healthz"): http.Route(healthz),
        }
        server = http.HttpServer(routes, max_body=MAX_BODY_BYTES)
        await server.start("127.0.0.1", port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.close()

    uvloop.run(main())


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(port: int, process: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        with (
            suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer,
        ):
            if answer.status == 200:
                return
        if time.monotonic() > deadline:
            raise SystemExit("server did not become healthy")
        time.sleep(0.2)


def _clock(epoch: float) -> str:
    moment = datetime.fromtimestamp(epoch, tz=UTC)
    return moment.strftime("%H:%M:%S.%f")[:-3]


class Probe:
    """One small durable write every 5 ms, in a thread of this process, while a phase runs; its
    latencies, its stalls (writes over 20 ms) with their wall-clock times, and the receiver's
    requests over 10 ms that were in flight during one of them."""

    STALL_S = 0.020
    label = ""

    def __init__(self) -> None:
        self.writes: list[tuple[float, float]] = []  # (start, seconds)
        # perf_counter has no epoch: this offset turns a start into wall-clock time, so a stall
        # can be matched with the server's own log (a checkpoint, an autovacuum) by its time.
        self._wall_offset = time.time() - time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        raise NotImplementedError

    def _timed(self, write: Callable[[], object]) -> None:
        while not self._stop.wait(0.005):
            started = time.perf_counter()
            write()
            self.writes.append((started, time.perf_counter() - started))

    def report(self, timeline: list[tuple[float, float]]) -> None:
        seconds = [c for _start, c in self.writes]
        stalls = [(start, start + c) for start, c in self.writes if c > self.STALL_S]
        print(
            f"{self.label:<34} {percentiles(seconds)}; "
            f"{len(stalls)} over {self.STALL_S * 1000:.0f} ms"
        )
        if stalls:
            at = ", ".join(
                f"{_clock(start + self._wall_offset)} ({(end - start) * 1000:.0f} ms)"
                for start, end in stalls
            )
            print(f"{'':<34} stalls began (UTC): {at}")
        slow = [(due, latency) for due, latency in timeline if latency > 0.010]
        # A request slowed by a stall was due before it ended and answered after it began.
        overlapping = sum(
            1
            for due, latency in slow
            if any(due <= end and due + latency >= start for start, end in stalls)
        )
        share = overlapping / len(slow) if slow else 0.0
        print(
            f"{'':<34} requests over 10 ms: {len(slow)}; of them, in flight during one of "
            f"these stalls: {overlapping} ({share:.0%})"
        )


class CommitProbe(Probe):
    """A single-row commit on the same PostgreSQL server: the floor every ``202`` of the
    receiver stands on (it answers after its inbox commit)."""

    label = "PostgreSQL commit probe (1/5 ms)"

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self._dsn = dsn

    def _run(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (at float8)")
            self._timed(
                lambda: conn.execute(
                    "INSERT INTO bench_commit_probe VALUES (%s)", (time.perf_counter(),)
                )
            )


class SyncProbe(Probe):
    """8 KiB written and ``fdatasync``ed to a file beside the database's data directory (the
    same filesystem), without PostgreSQL: the disk's own floor under any durable commit. Its
    stalls where the commit probe has them say the disk stalls, not the database."""

    label = "disk fdatasync probe (8 KiB/5 ms)"
    BLOCK = 8192
    SPAN = 16 * 1024 * 1024  # rewritten in place: the probe neither grows nor allocates

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self._path = directory / f"bench-sync-probe-{os.getpid()}.bin"

    def _run(self) -> None:
        block = os.urandom(self.BLOCK)
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        offset = 0

        def write() -> None:
            nonlocal offset
            os.pwrite(fd, block, offset)
            os.fdatasync(fd)
            offset = (offset + self.BLOCK) % self.SPAN

        try:
            self._timed(write)
        finally:
            os.close(fd)
            self._path.unlink(missing_ok=True)


def phase(
    name: str,
    argv: list[str],
    env: dict[str, str],
    port: int,
    args: argparse.Namespace,
    *,
    probes: Callable[[], list[Probe]] = list,
) -> list[float]:
    process = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_healthy(port, process)
        warm = build_requests(int(args.rate * args.warmup), args.duplicates, args.seed + 1)
        asyncio.run(load(port, warm, args.rate))
        requests = build_requests(int(args.rate * args.seconds), args.duplicates, args.seed)
        # The prepared requests are out of the generator's collector's reach: a full
        # collection walking them paused the load itself (counted as latency, as it is
        # measured from each request's due time) for tens of milliseconds.
        gc.collect()
        gc.freeze()
        cpu_before, busy_before = process_cpu_s(process.pid), machine_busy()
        timeline: list[tuple[float, float]] = []
        running = probes()
        try:
            with contextlib.ExitStack() as stack:
                for probe in running:
                    stack.enter_context(probe)
                latencies, failures, sent = asyncio.run(
                    load(port, requests, args.rate, timeline=timeline)
                )
        finally:
            gc.unfreeze()
        cpu = (process_cpu_s(process.pid) - cpu_before) / len(requests) * 1e6
        busy_after = machine_busy()
        busy = (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(failures.items()))
        refused = f" ({statuses})" if failures else ""
        print(
            f"{name:<34} {percentiles(latencies)}  sent {sent:7.0f}/s  "
            f"non-2xx {failures.total()}{refused}"
        )
        print(f"{'':<34} server CPU {cpu:5.0f} us/request; all cores {busy:.0%} busy")
        for probe in running:
            probe.report(timeline)
        return latencies
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s (default 1000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds (20)")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first (3)")
    parser.add_argument("--duplicates", type=float, default=0.1, help="share of resends (0.1)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="no PostgreSQL commit probe and no disk sync probe beside the receiver",
    )
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_baseline is not None:
        serve_baseline(args.serve_baseline)
        return

    base = Settings.from_env()
    with isolated(base, "recv") as iso:
        settings = iso.settings
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPLEDGER_")}
        env.update(
            PYTHONPATH=str(REPO),
            OPLEDGER_HOME=str(settings.home),
            OPLEDGER_KAFKA_BOOTSTRAP=settings.bootstrap_servers,
            OPLEDGER_KAFKA_SECURITY=settings.kafka_security_protocol,
            OPLEDGER_TOPIC_PREFIX=settings.topic_prefix,
            OPLEDGER_PARTITIONS=str(settings.partitions),
            OPLEDGER_PG_DSN=settings.dsn,
            OPLEDGER_CONSUMER_PG_DSN=settings.dsn,
            OPLEDGER_CONSUMER_SECRETS=SECRET,
            OPLEDGER_LOG_LEVEL="INFO",
        )
        print(
            f"{args.rate:.0f} requests/s for {args.seconds:.0f} s (after {args.warmup:.0f} s of "
            f"warm-up), {args.duplicates:.0%} resends; latency from each request's due time"
        )
        port = free_port()
        baseline = phase(
            "baseline: same server 202, no dedup",
            [sys.executable, __file__, "--serve-baseline", str(port)],
            env,
            port,
            args,
        )
        port = free_port()
        receiver = phase(
            "receiver: opledger consumer run",
            [sys.executable, "-m", "opledger.cli", "consumer", "run", "--port", str(port)],
            env | {"OPLEDGER_CONSUMER_WEB_PORT": str(port)},
            port,
            args,
            probes=list
            if args.no_probe
            else lambda: [CommitProbe(settings.dsn), SyncProbe(base.home)],
        )
        with psycopg.connect(settings.dsn) as conn:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT operation_id) FROM consumer_applied_changes"
            ).fetchone()
        assert row is not None
        print(f"applied changes: {row[0]} for {row[1]} distinct keys (must be equal)")
        ratio = p99(receiver) / p99(baseline)
        print(f"ratio receiver p99 / baseline p99: {ratio:.2f}")
        verdict = "met" if p99(receiver) <= 0.010 else "missed"
        print(f"goal receiver p99 <= 10 ms: {verdict} ({p99(receiver) * 1000:.2f} ms)")


if __name__ == "__main__":
    main()
