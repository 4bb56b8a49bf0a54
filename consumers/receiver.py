"""The reference receiver: ``POST /events`` with deduplication, ``/metrics`` and ``/healthz``.

Every request is checked from the outside in, and the first failed check answers (RFC 9457
``application/problem+json``): 503 until the key view is restored; 415 unless the body is
``application/json`` (UTF-8); 400 without a usable ``Idempotency-Key``; 413 above
:data:`~consumers.contract.MAX_BODY_BYTES` (refused on ``Content-Length`` before reading); 401
unless the Standard Webhooks signature over the raw body is valid and fresh; 400 for a body that
is not a JSON object, 422 for one that is not a valid event or not the one its key and
``webhook-id`` name. Then deduplication: a known key with the same body is answered 202 again
(``Idempotent-Replayed: true``) and counted as a duplicate, with another body 422; a key another
request of this process is still recording is answered 409; a new key is committed with its
change, and only then answered 202. Nothing is logged of a body or a secret.

202 means receipt: ``{"operation_id": ..., "delivery": "accepted"}`` says the delivery is
recorded, never what the change did (``opledger_consumer_changes_total`` says that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from consumers.contract import (
    IDEMPOTENCY_HEADER,
    MAX_BODY_BYTES,
    PROBLEM_CONTENT_TYPE,
    Event,
    Problem,
    ProblemError,
    accepted_document,
    body_too_large,
    http_problem,
    in_progress,
    key_reused,
    not_ready,
    parse_event,
    parse_idempotency_key,
    unavailable,
    unsupported_media_type,
)
from consumers.dedup import Decision
from consumers.inbox import Inbox, Recorded, Verdict
from consumers.runtime import ConsumerRuntime
from consumers.signatures import SignatureVerifier
from ledger.pg import DatabaseUnavailableError

log = logging.getLogger("opledger.consumer.receiver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.partition("; charset")[0]
REPLAYED_HEADER = "Idempotent-Replayed"
#: The metrics reason of a successful answer, set by the handler for the middleware.
_REASON = web.RequestKey("opledger.reason", str)


class BatchWriter:
    """Commits the receiver's new keys in batches, on the event loop: each of ``writers`` tasks
    takes whatever queued while its previous transaction ran (at most ``max_batch``) and records
    it in one inbox transaction (:meth:`consumers.inbox.Inbox.record_many`); a request is
    answered once the transaction holding its key has committed."""

    def __init__(self, inbox: Inbox, via: str, *, writers: int = 1, max_batch: int = 256) -> None:
        self._inbox = inbox
        self._via = via
        self._writers = writers
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Event, asyncio.Future[Recorded]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._serve()) for _ in range(self._writers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def record(self, event: Event) -> Recorded:
        future: asyncio.Future[Recorded] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((event, future))
        return await future

    async def _serve(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                results = await self._inbox.record_many([e for e, _ in batch], self._via)
            except Exception as exc:
                for _event, future in batch:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_event, future), result in zip(batch, results, strict=True):
                    if not future.done():  # else the request was cancelled (client gone)
                        future.set_result(result)


def problem_response(problem: Problem) -> web.Response:
    headers = {}
    if problem.retry_after_s is not None:
        headers["Retry-After"] = str(problem.retry_after_s)
    return web.Response(
        body=problem.body(),
        status=problem.status,
        content_type=PROBLEM_CONTENT_TYPE,
        headers=headers,
    )


class Receiver:
    """The aiohttp application of one consumer instance."""

    def __init__(
        self,
        runtime: ConsumerRuntime,
        verifier: SignatureVerifier,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        writers: int = 1,
    ) -> None:
        self.runtime = runtime
        self._verifier = verifier
        self._max_body = max_body_bytes
        self._dedup = runtime.dedup
        self._metrics = runtime.metrics
        self._name = runtime.name
        # One writer by default: the largest batches, so the fewest statements and commits per
        # request; CPU, not the wait for a commit, is what runs out first on two cores.
        self._writers = writers
        self._inbox: Inbox | None = None
        self._writer: BatchWriter | None = None
        self._in_flight: set[str] = set()
        self._responses: dict[tuple[int, str], Any] = {}
        self._latency = runtime.metrics.request_seconds.labels(runtime.name)

    def app(self) -> web.Application:
        # client_max_size a little above the bound: a body without Content-Length is cut by
        # aiohttp there (HTTPRequestEntityTooLarge), which the middleware answers as 413.
        app = web.Application(client_max_size=self._max_body + 1, middlewares=[self._problems])
        app.router.add_post("/events", self.events)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._shutdown)
        return app

    async def _startup(self, _app: web.Application) -> None:
        self._inbox = await self.runtime.open_inbox(self._writers + 1)
        self._writer = BatchWriter(self._inbox, "http", writers=self._writers)
        self._writer.start()

    async def _shutdown(self, _app: web.Application) -> None:
        if self._writer is not None:
            await self._writer.stop()
        if self._inbox is not None:
            await self._inbox.close()

    def _count(self, status: int, reason: str) -> None:
        child = self._responses.get((status, reason))
        if child is None:  # a bounded set: statuses and fixed reason words
            child = self._metrics.responses.labels(self._name, str(status), reason)
            self._responses[(status, reason)] = child
        child.inc()

    @web.middleware
    async def _problems(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            response = await handler(request)
        except ProblemError as exc:
            response = problem_response(exc.problem)
            reason = exc.problem.slug
        except web.HTTPRequestEntityTooLarge:
            problem = body_too_large(self._max_body).problem
            response, reason = problem_response(problem), problem.slug
        except web.HTTPException as exc:  # the router's 404/405 and the like
            if exc.status < 400:
                raise
            problem = http_problem(exc.status, exc.reason)
            response, reason = problem_response(problem), problem.slug
            if "Allow" in exc.headers:  # a 405 says which methods the path has
                response.headers["Allow"] = exc.headers["Allow"]
        except Exception:
            # The exception's text could quote the request; log the type and trace only
            # (RedactingFilter scrubs the trace too).
            log.exception("POST %s failed", request.path)
            problem = Problem(500, "internal", "Internal error", "the receiver failed; retry")
            response, reason = problem_response(problem), problem.slug
        else:
            reason = request.get(_REASON, "ok")
        if request.path == "/events":
            self._latency.observe(time.perf_counter() - started)
            self._count(response.status, reason)
        return response

    async def events(self, request: web.Request) -> web.Response:
        """``POST /events``; see the module docstring for every answer."""
        if not self.runtime.ready:
            raise not_ready("the key view is being restored from the key store")
        if request.content_type != "application/json":
            raise unsupported_media_type("send the event as Content-Type: application/json")
        charset = request.charset
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise unsupported_media_type("the event is UTF-8 JSON")
        key = parse_idempotency_key(request.headers.getall(IDEMPOTENCY_HEADER, []))
        length = request.content_length
        if length is not None and length > self._max_body:
            raise body_too_large(self._max_body)
        raw = await request.read()
        if len(raw) > self._max_body:
            raise body_too_large(self._max_body)
        webhook_id = self._verifier.verify(request.headers, raw)
        event = parse_event(raw, key, webhook_id)

        decision = self._dedup.known(event)
        recorded: Recorded | None = None
        if decision is None:
            if key in self._in_flight:
                raise in_progress(key)
            self._in_flight.add(key)
            try:
                assert self._writer is not None  # started with the application
                recorded = await self._writer.record(event)
            except DatabaseUnavailableError:
                raise unavailable("the consumer's database does not answer; retry") from None
            finally:
                self._in_flight.discard(key)
            decision = Decision(
                recorded.verdict, "new" if recorded.verdict is Verdict.ACCEPTED else "inbox"
            )
        self._dedup.settle(event, decision, recorded, "http")
        if decision.verdict is Verdict.CONFLICT:
            raise key_reused(key)
        duplicate = decision.verdict is Verdict.DUPLICATE
        request[_REASON] = "duplicate" if duplicate else "accepted"
        headers = {REPLAYED_HEADER: "true"} if duplicate else {}
        return web.json_response(accepted_document(key), status=202, headers=headers)

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.runtime.registry), content_type=_METRICS_CONTENT_TYPE
        )

    async def healthz(self, _request: web.Request) -> web.Response:
        health = self.runtime.health()
        return web.json_response(health, status=200 if health["ready"] else 503)


async def serve(
    runtime: ConsumerRuntime,
    verifier: SignatureVerifier,
    host: str,
    port: int,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[int], None] | None = None,
) -> None:
    """Listen at once (``/healthz`` says 503 and ``/events`` answers 503 while restoring),
    start the runtime (migrations, publisher, restore), then serve until SIGTERM/SIGINT or
    ``stop``. The runtime is closed on the way out."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, stop.set)
    receiver = Receiver(runtime, verifier)
    runner = web.AppRunner(receiver.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = int(runner.addresses[0][1])
        log.info("consumer %s listening on http://%s:%d", runtime.name, host, bound)
        if on_listening is not None:
            on_listening(bound)
        starting = asyncio.ensure_future(asyncio.to_thread(runtime.start))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start ends the process with its error
            await stopping
        else:
            starting.cancel()
    finally:
        await runner.cleanup()
        runtime.close()
