"""The reference receiver: ``POST /events`` with deduplication, ``/metrics`` and ``/healthz``,
served by :mod:`consumers.server` (HTTP/1.1 on asyncio protocols and ``httptools``).

Every request is checked from the outside in, and the first failed check answers (RFC 9457
``application/problem+json``): 503 until the key view is restored; 415 unless the body is
``application/json`` (UTF-8); 400 without a usable ``Idempotency-Key``; 413 above
:data:`~consumers.contract.MAX_BODY_BYTES` (refused on ``Content-Length`` before reading, a
chunked body as soon as it passes the bound; the connection is closed after either); 401
unless the Standard Webhooks signature over the raw body is valid and fresh; 400 for a body that
is not a JSON object, 422 for one that is not a valid event or not the one its key and
``webhook-id`` name. Then deduplication: a known key with the same body is answered 202 again
(``Idempotent-Replayed: true``) and counted as a duplicate, with another body 422; a key another
request of this process is still recording is answered 409; a new key is committed with its
change, and only then answered 202. A new key whose result came by reference (decision 015) is
fetched first (:mod:`consumers.fetch`): 503 if it cannot be now, 422 if the bytes are not it.
Nothing is logged of a body or a secret.

202 means receipt: ``{"operation_id": ..., "delivery": "accepted"}`` says the delivery is
recorded, never what the change did (``opledger_consumer_changes_total`` says that).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from consumers.contract import (
    IDEMPOTENCY_HEADER,
    MAX_BODY_BYTES,
    Event,
    ProblemError,
    accepted_document,
    in_progress,
    key_reused,
    not_ready,
    parse_event,
    parse_idempotency_key,
    unavailable,
    unsupported_media_type,
)
from consumers.dedup import Decision
from consumers.fetch import ResultFetcher
from consumers.inbox import Inbox, Recorded, Verdict
from consumers.runtime import ConsumerRuntime
from consumers.server import (
    JSON_CONTENT_TYPE,
    KEEPALIVE_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_CLIENT,
    REQUEST_TIMEOUT_S,
    Deferred,
    HttpServer,
    Request,
    Response,
    Route,
    json_response,
    problem_response,
)
from consumers.signatures import SignatureVerifier
from ledger.heap import freeze_startup_heap
from ledger.pg import DatabaseUnavailableError

__all__ = ["BatchWriter", "Receiver", "problem_response", "serve"]

log = logging.getLogger("opledger.consumer.receiver")

_METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.partition("; charset")[0]
_IDEMPOTENCY_FIELD = IDEMPOTENCY_HEADER.lower()
REPLAYED_HEADER = "Idempotent-Replayed"
_Done = Callable[[Recorded | Exception], None]


class BatchWriter:
    """Commits the receiver's new keys in batches, on the event loop: each of ``writers`` tasks
    takes whatever queued while its previous transaction ran (at most ``max_batch``) and records
    it in one inbox transaction (:meth:`consumers.inbox.Inbox.record_many`); a request is
    answered once the transaction holding its key has committed: the callback given to
    :meth:`submit` is called then, with what the transaction found or did (or its exception),
    in the writer's task: no further turn of the event loop before the answer is written."""

    def __init__(self, inbox: Inbox, via: str, *, writers: int = 1, max_batch: int = 256) -> None:
        self._inbox = inbox
        self._via = via
        self._writers = writers
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[Event, _Done]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._serve()) for _ in range(self._writers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def submit(self, event: Event, done: _Done) -> None:
        """Queue ``event``; ``done`` is called once its transaction committed (or failed)."""
        self._queue.put_nowait((event, done))

    async def _serve(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            outcomes: Sequence[Recorded | Exception]
            try:
                outcomes = await self._inbox.record_many([e for e, _ in batch], self._via)
            except Exception as exc:
                outcomes = [exc] * len(batch)
            for (_event, done), outcome in zip(batch, outcomes, strict=True):
                try:
                    done(outcome)
                except Exception:  # one answer's failure must not cost the others theirs
                    log.exception("answering a recorded delivery failed")


class Receiver:
    """The routes of one consumer instance, on a :class:`~consumers.server.HttpServer`;
    ``keepalive_timeout_s`` and ``request_timeout_s`` are that server's timeouts."""

    def __init__(
        self,
        runtime: ConsumerRuntime,
        verifier: SignatureVerifier,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        writers: int = 1,
        keepalive_timeout_s: float = KEEPALIVE_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
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
        self._fetcher = ResultFetcher(verifier.secrets)
        self._fetches: set[asyncio.Task[None]] = set()
        self._in_flight: set[str] = set()
        #: when recording last failed for want of the database (None: it answered last)
        self._database_down_since: float | None = None
        self._probe: asyncio.Task[None] | None = None
        self._responses: dict[tuple[int, str], Any] = {}
        self._latency = runtime.metrics.request_seconds.labels(runtime.name)
        self._server = HttpServer(
            {
                ("POST", "/events"): Route(self.events, check=self.check_events, read_body=True),
                ("GET", "/metrics"): Route(self.metrics),
                ("GET", "/healthz"): Route(self.healthz),
            },
            max_body=max_body_bytes,
            observe=self._observe,
            keepalive_timeout_s=keepalive_timeout_s,
            request_timeout_s=request_timeout_s,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
        )

    async def start(self, host: str, port: int) -> int:
        """Open the inbox, start the batch writer, listen; the bound port."""
        self._inbox = await self.runtime.open_inbox(self._writers + 1)
        self._writer = BatchWriter(self._inbox, "http", writers=self._writers)
        self._writer.start()
        await self._fetcher.start()
        return await self._server.start(host, port)

    async def stop(self) -> None:
        """Stop listening, answer what is owed (5 s at most), then close the inbox."""
        await self._server.close(timeout=5.0)
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        for fetch in list(self._fetches):
            fetch.cancel()
        await asyncio.gather(*self._fetches, return_exceptions=True)
        await self._fetcher.close()
        if self._writer is not None:
            await self._writer.stop()
            self._writer = None
        if self._inbox is not None:
            await self._inbox.close()
            self._inbox = None

    def _observe(self, request: Request | None, response: Response) -> None:
        # Answers given before a request could be read (None) count among /events': that is
        # the only route a sender posts to.
        if request is None or request.path == "/events":
            if request is not None:
                self._latency.observe(time.perf_counter() - request.started)
            child = self._responses.get((response.status, response.reason))
            if child is None:  # a bounded set: statuses and fixed reason words
                child = self._metrics.responses.labels(
                    self._name, str(response.status), response.reason
                )
                self._responses[(response.status, response.reason)] = child
            child.inc()

    def check_events(self, request: Request) -> None:
        """``POST /events`` before its body is read: readiness, media type, key. (The server
        then refuses a ``Content-Length`` over the bound.)"""
        if not self.runtime.ready:
            raise not_ready("the key view is being restored from the key store")
        media_type, charset = request.content_type()
        if media_type != "application/json":
            raise unsupported_media_type("send the event as Content-Type: application/json")
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise unsupported_media_type("the event is UTF-8 JSON")
        request.state = parse_idempotency_key(request.values(_IDEMPOTENCY_FIELD))

    def events(self, request: Request) -> Response | Deferred:
        """``POST /events`` once its body is read; see the module docstring for every answer."""
        key: str = request.state
        raw = request.body
        webhook_id = self._verifier.verify(request.headers, raw)
        event = parse_event(raw, key, webhook_id, by_reference=True)

        decision = self._dedup.known(event)
        if decision is not None:
            return self._settle(event, key, decision, None)
        if key in self._in_flight:
            raise in_progress(key)
        assert self._writer is not None  # started before listening
        self._in_flight.add(key)
        answer = Deferred()
        if event.result is None:  # by reference: fetched first, then recorded like any other
            fetch = asyncio.ensure_future(self._fetch_then_record(event, key, answer))
            self._fetches.add(fetch)
            fetch.add_done_callback(self._fetches.discard)
        else:
            self._writer.submit(event, functools.partial(self._recorded, event, key, answer))
        return answer

    async def _fetch_then_record(self, event: Event, key: str, answer: Deferred) -> None:
        fetches = self._metrics.result_fetches
        try:
            fetched = await self._fetcher.fetch(event)
        except BaseException as exc:  # cancelled at shutdown too: the key must not stay held
            self._in_flight.discard(key)
            answer.fail(exc if isinstance(exc, Exception) else not_ready("shutting down"))
            if not isinstance(exc, Exception):
                raise
            refused = isinstance(exc, ProblemError) and exc.problem.status == 422
            fetches.labels(self._name, "refused" if refused else "unavailable").inc()
            return
        fetches.labels(self._name, "fetched").inc()
        assert self._writer is not None
        self._writer.submit(fetched, functools.partial(self._recorded, fetched, key, answer))

    def _recorded(
        self, event: Event, key: str, answer: Deferred, outcome: Recorded | Exception
    ) -> None:
        self._in_flight.discard(key)
        if isinstance(outcome, DatabaseUnavailableError):
            if self._database_down_since is None:
                self._database_down_since = time.monotonic()
            answer.fail(unavailable("the consumer's database does not answer; retry"))
            return
        self._database_down_since = None
        if isinstance(outcome, Exception):
            answer.fail(outcome)  # 500
            return
        verdict = outcome.verdict
        decision = Decision(verdict, "new" if verdict is Verdict.ACCEPTED else "inbox")
        try:
            response = self._settle(event, key, decision, outcome)
        except Exception as exc:  # the key reused (422), or a failure (500)
            answer.fail(exc)
            return
        answer.resolve(response)

    def _settle(
        self, event: Event, key: str, decision: Decision, recorded: Recorded | None
    ) -> Response:
        self._dedup.settle(event, decision, recorded, "http")
        if decision.verdict is Verdict.CONFLICT:
            raise key_reused(key)
        if decision.verdict is Verdict.DUPLICATE:
            return Response(
                202,
                json.dumps(accepted_document(key)).encode(),
                JSON_CONTENT_TYPE,
                {REPLAYED_HEADER: "true"},
                "duplicate",
            )
        return json_response(accepted_document(key), 202, reason="accepted")

    def metrics(self, _request: Request) -> Response:
        return Response(200, generate_latest(self.runtime.registry), _METRICS_CONTENT_TYPE)

    def healthz(self, _request: Request) -> Response:
        """200 when the key view is restored and the database answered the last write; 503
        otherwise. While the database is down, each probe here also asks it (in the
        background): a receiver a load balancer took out of rotation gets no writes to learn
        from that it is back."""
        health = self.runtime.health()
        down_since = self._database_down_since
        if down_since is not None:
            health["database"] = f"not answering for {time.monotonic() - down_since:.0f}s"
            if self._probe is None or self._probe.done():
                self._probe = asyncio.ensure_future(self._ask_database())
        ready = health["ready"] and down_since is None
        return json_response(health, 200 if ready else 503)

    async def _ask_database(self) -> None:
        if self._inbox is not None and await self._inbox.answers():
            self._database_down_since = None


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
    settings = runtime.settings
    receiver = Receiver(
        runtime,
        verifier,
        keepalive_timeout_s=settings.consumer_keepalive_timeout_s,
        request_timeout_s=settings.consumer_request_timeout_s,
        max_connections=settings.consumer_max_connections,
        max_connections_per_client=settings.consumer_max_connections_per_client,
    )
    try:
        bound = await receiver.start(host, port)
        log.info("consumer %s listening on http://%s:%d", runtime.name, host, bound)
        if on_listening is not None:
            on_listening(bound)
        starting = asyncio.ensure_future(asyncio.to_thread(runtime.start))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start ends the process with its error
            frozen = freeze_startup_heap()
            log.info("start-up heap frozen: %d objects out of the collector's reach", frozen)
            await stopping
        else:
            starting.cancel()
    finally:
        await receiver.stop()
        runtime.close()
