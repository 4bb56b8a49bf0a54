"""Delivery tests' parts: a webhook receiver (a real HTTP server on 127.0.0.1 that answers with a
script: statuses, Retry-After, or no answer at all; checks each request's Standard Webhooks
signature, and keeps every request it received, so a test counts what the outside saw), a raw
listener that answers bytes of the test's choosing and counts every connection offered to it,
and a delivery worker driven in-process with a projector stepped alongside it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from standardwebhooks import Webhook, WebhookVerificationError

from ledger.codec import default_codec
from ledger.destinations import DestinationStore, Kind
from ledger.domain.fold import DeliveryRecord
from ledger.domain.schedule import RetryPolicy
from ledger.domain.states import DeliveryState
from ledger.history import HistoryReader
from ledger.log import KafkaTransport
from ledger.metrics import Metrics
from ledger.pg import open_pool
from ledger.policy_store import PolicyStore
from ledger.results import ResultStore
from ledger.settings import Settings
from processors.batch_reader import BatchProjector
from processors.delivery.senders import WebhookSender
from processors.delivery.worker import DeliveryWorker
from producers import TransitionRecorder
from projections.writer import PostgresProjection
from tests.support import free_port

ACCEPTED = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class Received:
    at: float
    headers: dict[str, str]
    body: bytes
    signature_ok: bool


@dataclass(frozen=True)
class Answer:
    status: int = 202
    retry_after: str | None = None
    #: seconds to wait before answering (longer than the sender's timeout: no answer)
    delay: float = 0.0


class ScriptedReceiver:
    """``POST /events`` answered by ``script`` in order, then by ``then`` for ever."""

    def __init__(self, secret: str, script: Iterable[Answer] = (), then: Answer = Answer()):
        self.secret = secret
        self.script: deque[Answer] = deque(script)
        self.then = then
        self.received: list[Received] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/events"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "receiver did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/events", self._events)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    async def _events(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        try:
            Webhook(self.secret).verify(body, headers)
            ok = True
        except WebhookVerificationError:
            ok = False
        self.received.append(Received(time.monotonic(), headers, body, ok))
        answer = self.script.popleft() if self.script else self.then
        if answer.delay:
            await asyncio.sleep(answer.delay)
        extra: dict[str, Any] = {}
        if answer.retry_after is not None:
            extra["Retry-After"] = answer.retry_after
        return web.json_response({"ok": answer.status < 300}, status=answer.status, headers=extra)

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class RawListener:
    """A webhook that answers every request with ``answer``, byte for byte (what a tenant's own
    receiver may send back), after reading the request; it counts every connection offered to
    it as well as the requests, so "never connected to" is counted, not assumed, and keeps each
    request's head. A connection serves requests until its client closes it, or until an answer
    that says ``Connection: close``."""

    def __init__(self, answer: bytes = ACCEPTED, host: str = "127.0.0.1") -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.heads: list[bytes] = []
        self.port = free_port()
        self.url = f"http://{host}:{self.port}/events"
        self._closes = b"connection: close" in answer.lower()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, self.port))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while not self._stop.is_set():
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, _, data = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    while len(data) < length:
                        data += conn.recv(65536)
                    data = data[length:]
                    self.heads.append(head)
                    self.requests += 1
                    conn.sendall(self.answer)
                    if self._closes:
                        return
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


class SteppedDeliveryRig:
    """A delivery worker on ``settings`` in this process (a 300 ms retry unless ``retry`` says
    otherwise, no jitter; its sender's connections are ``settings.delivery_concurrency``, as in
    the deployed worker), a projector stepped alongside it, and a service that records succeeded
    calls of ``tool``."""

    def __init__(
        self,
        settings: Settings,
        *,
        tool: str,
        actor: str,
        secret: str,
        webhook_timeout_ms: int = 5000,
        outbox_stall_s: float = 20.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.tool, self.actor, self.secret = tool, actor, secret
        self.webhook_timeout_ms = webhook_timeout_ms
        self.registry = CollectorRegistry()
        self.metrics = Metrics.create(self.registry)
        self.pool = open_pool(settings.dsn, name="stepped-delivery")
        self.transport = KafkaTransport(settings)
        self.history = HistoryReader(settings, self.pool)
        self.webhooks = WebhookSender(
            concurrency=settings.delivery_concurrency, metrics=self.metrics
        )
        self.destinations = DestinationStore(self.pool, settings)
        self.worker = DeliveryWorker(
            settings,
            pool=self.pool,
            transport=self.transport,
            history=self.history,
            results=ResultStore(self.pool),
            destinations=self.destinations,
            policy=PolicyStore(self.pool, self.settings).evaluate_many,
            webhooks=self.webhooks,
            metrics=self.metrics,
            retry=retry or RetryPolicy(schedule=(timedelta(milliseconds=300),), jitter=0.0),
            unit_random=lambda: 0.5,
            outbox_stall_s=outbox_stall_s,
        )
        self.worker.join()
        self.sink = PostgresProjection.connect(settings.dsn)
        self.projector = BatchProjector(
            settings, self.sink, default_codec(), Metrics.create(CollectorRegistry())
        )
        self.projector._consumer = self.projector._open()
        self.service = TransitionRecorder.connect(settings, owner="service")

    def close(self) -> None:
        self.service.close()
        self.projector.close()
        self.sink.close()
        self.worker.close()
        self.webhooks.close()
        self.history.close()
        self.transport.close()
        self.pool.close()

    def webhook(self, tenant: str, name: str, url: str) -> None:
        """A webhook destination of ``tenant`` for the rig's tool, written to the store as is
        (rows written before the CLI's checks, host names that resolve to anything: the worker
        is the boundary)."""
        self.destinations.add(
            tenant_id=tenant,
            name=name,
            kind=Kind.WEBHOOK,
            target=url,
            tools=[self.tool],
            changed_by="test",
            secret=self.secret,
            timeout_ms=self.webhook_timeout_ms,
        )

    def succeeded(self, tenant: str) -> str:
        op = self.service.intent(
            tenant, self.actor, self.tool, {"to": "a@example.com", "n": time.time_ns()}
        )
        self.service.dispatched(op, provider_ref=op.operation_id)
        self.service.succeeded(op, b'{"sent": true}', content_type="application/json")
        return op.operation_id

    def step(self) -> float:
        """One worker pass, then one projector batch; the seconds the worker's pass took."""
        started = time.monotonic()
        self.worker.run_once(timeout=0.05)
        took = time.monotonic() - started
        self.projector.run_once()
        return took

    def delivery(self, tenant: str, op_id: str, destination: str) -> DeliveryRecord | None:
        return self.history.load([(op_id, tenant)])[op_id].deliveries.get(destination)

    def state(self, tenant: str, op_id: str, destination: str) -> DeliveryState | None:
        record = self.delivery(tenant, op_id, destination)
        return None if record is None else record.state

    def sample(self, destination: str, outcome: str) -> float:
        """``opledger_deliveries_total`` of ``destination`` and ``outcome``, as scraped."""
        value = self.registry.get_sample_value(
            "opledger_deliveries_total", {"destination": destination, "outcome": outcome}
        )
        return value or 0.0


def step_until(rig: SteppedDeliveryRig, done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Step ``rig`` until ``done()``; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        rig.step()


def step_for(rig: SteppedDeliveryRig, seconds: float) -> None:
    """Step ``rig`` for ``seconds``: for what must *not* happen (a send while a destination is
    held), there is no event to await, only passes that had the chance to do it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rig.step()


def keys_seen(received: Iterable[Received]) -> dict[str, int]:
    """Requests per Idempotency-Key, as the receiver counted them."""
    counts: dict[str, int] = {}
    for request in received:
        key = request.headers.get("Idempotency-Key", "")
        counts[key] = counts.get(key, 0) + 1
    return counts
