"""The receiver's HTTP/1.1 server: asyncio protocols, ``httptools`` to parse the requests.

Served: keep-alive connections and pipelined requests (answered in the order they came), bodies
framed by ``Content-Length`` or ``Transfer-Encoding: chunked``, both bounded by ``max_body``,
``Expect: 100-continue``, ``HEAD`` on every ``GET`` route. Refused, each with an RFC 9457
problem document: a request the parser rejects (400, then the connection is closed), HTTP/1.1
without ``Host`` (400), a request head over :data:`MAX_HEAD_BYTES` (431, closed), an unknown
path (404), another method (405 with ``Allow``), an ``Expect`` other than ``100-continue``
(417), a body over ``max_body`` (413, closed: refused on ``Content-Length`` before any of it is
read, or as soon as a chunked body passes the bound), an ``Upgrade`` request with a body (400,
closed: ``Upgrade`` is otherwise ignored, as RFC 9110 7.8 allows). A connection that is closed
after an answer is half-closed first and its remaining input read and dropped for up to
:data:`LINGER_S`, so the client reads the answer instead of a reset.

Two timeouts, both on the client's bytes, never on the server's work (:class:`HttpServer`'s
``keepalive_timeout_s`` and ``request_timeout_s``): a connection with no request being read and
no answer owed is closed once it has been so for ``keepalive_timeout_s`` (default
:data:`KEEPALIVE_S`, 75 s, as aiohttp's ``keepalive_timeout``); a request whose head and body
have not all arrived ``request_timeout_s`` (default :data:`REQUEST_TIMEOUT_S`, 30 s) after its
first byte is answered 408 and the connection closed, after the answers owed before it, in
order. A handler may take as long as it needs: a request that has arrived is not timed, nor is
one the server itself holds back (its pipeline full of unanswered requests, or its
``Expect: 100-continue`` not yet answered); its clock restarts when the server reads on or
sends the 100. The second also bounds a client that stops reading: once the answers written to
it have gone unread over the transport's buffer limit for ``request_timeout_s``, the connection
is reset, and a connection closed at a deadline with answers still unread is reset too (a plain
close would wait for that client for ever). One timer per connection checks the deadlines when
they may be due; reading a request only notes the time.

A route may check the request head before its body is read (``Route.check``): an answer there
leaves the body unread (dropped as it arrives). A handler answers with a :class:`Response`, or
with a :class:`Deferred` one when it must wait (the receiver's inbox commit): no task per
request, and a deferred answer is written the moment it is given, not a turn or two of the
event loop later as a future's callbacks would be (under load, a turn first serves every
connection with data ready).

Why not aiohttp: the receiver needs three routes of it, and it spent about twice this server's
CPU per request (``bench/bench_consumer_receiver.py``; bench/README.md has the runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.parser import HeaderParser
from email.policy import HTTP
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

from consumers.contract import (
    PROBLEM_CONTENT_TYPE,
    Problem,
    ProblemError,
    body_too_large,
    http_problem,
)

log = logging.getLogger("opledger.consumer.server")

#: Bytes of a request line and headers; a webhook request's are well under 2 KiB.
MAX_HEAD_BYTES = 32 * 1024
#: Unanswered requests of one connection before it is read no further (pipelining).
MAX_PIPELINED = 16
#: Default idle keep-alive timeout: no request being read, no answer owed (aiohttp's default).
KEEPALIVE_S = 75.0
#: Default time from a request's first byte until its head and body must have arrived.
REQUEST_TIMEOUT_S = 30.0
#: Default bound on open connections: past it a new one is answered 503 and closed at once
#: (each costs a file descriptor, and the process has a bounded number of those).
MAX_CONNECTIONS = 512
#: Connections one client address may hold of them: one client cannot take every place. As
#: many as a delivery worker opens to one destination by default (OPLEDGER_DELIVERY_CONCURRENCY).
MAX_CONNECTIONS_PER_CLIENT = 256
#: How long a connection closed after an answer keeps reading (and dropping) what still comes.
LINGER_S = 5.0
JSON_CONTENT_TYPE = "application/json; charset=utf-8"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


@dataclass(slots=True)
class Response:
    """An answer: ``reason`` is the metrics label (a problem's slug, or what the route says)."""

    status: int
    body: bytes = b""
    content_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    reason: str = "ok"


def problem_response(problem: Problem) -> Response:
    headers = {}
    if problem.retry_after_s is not None:
        headers["Retry-After"] = str(problem.retry_after_s)
    return Response(problem.status, problem.body(), PROBLEM_CONTENT_TYPE, headers, problem.slug)


def json_response(document: Any, status: int = 200, **options: Any) -> Response:
    """``document`` as ``json.dumps`` writes it by default, as aiohttp's ``json_response`` did."""
    return Response(status, json.dumps(document).encode(), JSON_CONTENT_TYPE, **options)


def _http_refusal(status: int, detail: str | None = None) -> Response:
    problem = http_problem(status, HTTPStatus(status).phrase)
    if detail is not None:
        problem = Problem(problem.status, problem.slug, problem.title, detail)
    return problem_response(problem)


class _OctetStreamDefault(EmailMessage):
    """What aiohttp parses ``Content-Type`` with (``aiohttp.helpers.EnsureOctetStream``), so a
    media type reads the same as before: lower-cased, ``application/octet-stream`` unless it
    has exactly one ``/``."""

    def __init__(self) -> None:
        super().__init__()
        self.set_default_type("application/octet-stream")

    def get_content_type(self) -> str:
        media_type = self.get("content-type", "").lower().partition(";")[0].strip()
        return media_type if media_type.count("/") == 1 else self.get_default_type()


@functools.lru_cache(maxsize=64)
def parse_content_type(raw: str | None) -> tuple[str, str | None]:
    """(media type, charset parameter) of a ``Content-Type`` value, read by the standard
    library's MIME parser as aiohttp reads it; cached, as senders repeat one value."""
    if raw is None:
        return "application/octet-stream", None  # RFC 9110 8.3
    message = HeaderParser(_OctetStreamDefault, policy=HTTP).parsestr(f"Content-Type: {raw}")
    params = dict(message.get_params((), header="content-type")[1:])
    charset = params.get("charset")
    return message.get_content_type(), None if charset is None else str(charset)


class Request:
    """One request: header names lower-cased; ``headers`` holds each name's first value."""

    __slots__ = ("body", "fields", "headers", "method", "path", "started", "state", "version")

    def __init__(self, method: str, path: str, version: str, fields: list[tuple[str, str]]) -> None:
        self.method = method
        self.path = path
        self.version = version
        self.fields = fields
        headers: dict[str, str] = {}
        for name, value in fields:
            headers.setdefault(name, value)
        self.headers = headers
        self.body = b""
        #: what a route's check found, for its handler (the receiver: the idempotency key)
        self.state: Any = None
        self.started = time.perf_counter()

    def values(self, name: str) -> list[str]:
        """Every value of header ``name`` (lower case), in order."""
        return [value for field_name, value in self.fields if field_name == name]

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("content-length")
        return None if raw is None else int(raw)  # the parser accepts only digits there

    def content_type(self) -> tuple[str, str | None]:
        return parse_content_type(self.headers.get("content-type"))


class Deferred:
    """An answer given later, on the event loop's thread: :meth:`resolve` with the response, or
    :meth:`fail` with the exception the handler would have raised (a
    :class:`~consumers.contract.ProblemError` is answered with its problem, anything else 500).
    """

    __slots__ = ("_deliver", "_outcome")

    def __init__(self) -> None:
        self._deliver: Callable[[Response | BaseException], None] | None = None
        self._outcome: Response | BaseException | None = None

    def resolve(self, response: Response) -> None:
        self._give(response)

    def fail(self, error: BaseException) -> None:
        self._give(error)

    def _give(self, outcome: Response | BaseException) -> None:
        if self._outcome is not None:
            raise RuntimeError("a deferred answer is given once")
        self._outcome = outcome
        if self._deliver is not None:
            self._deliver(outcome)

    def _attach(self, deliver: Callable[[Response | BaseException], None]) -> None:
        self._deliver = deliver
        if self._outcome is not None:
            deliver(self._outcome)


Answer = Response | Deferred


@dataclass(frozen=True, slots=True)
class Route:
    """``handle`` answers a request once its body is read. ``check``, when given, sees the head
    first and may refuse by raising :class:`~consumers.contract.ProblemError`; the body is then
    not read. Only routes that ``read_body`` keep it; others drop it as it arrives."""

    handle: Callable[[Request], Answer]
    check: Callable[[Request], None] | None = None
    read_body: bool = False


class _Exchange:
    """One request and, once known, its answer."""

    __slots__ = (
        "body_size",
        "close",
        "complete",
        "continued",
        "expects_continue",
        "head_only",
        "parts",
        "request",
        "response",
        "route",
    )

    def __init__(self, request: Request | None, close: bool) -> None:
        self.request = request
        self.route: Route | None = None
        self.response: Response | None = None
        self.close = close
        self.head_only = request is not None and request.method == "HEAD"
        self.expects_continue = False
        self.continued = False
        self.complete = False
        self.parts: list[bytes] | None = None
        self.body_size = 0


#: Called with each answer and its request; ``None`` for an answer given before a request could
#: be read (a 408 or 400 inside a request head, a 503 to a connection over the bound).
_Observer = Callable[[Request | None, Response], None]


class HttpServer:
    """Serves ``routes`` (keyed by method and path; a ``GET`` route answers ``HEAD`` too)."""

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Route],
        *,
        max_body: int,
        observe: _Observer | None = None,
        keepalive_timeout_s: float = KEEPALIVE_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
    ) -> None:
        if not (keepalive_timeout_s > 0 and request_timeout_s > 0):
            raise ValueError("the keep-alive and request timeouts must be positive")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if max_connections_per_client < 1:
            raise ValueError("max_connections_per_client must be at least 1")
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        #: client address -> connections it holds
        self.clients: dict[str, int] = {}
        self._routes = dict(routes)
        for (method, path), route in routes.items():
            if method == "GET":
                self._routes.setdefault(("HEAD", path), route)
        # 405's Allow, as aiohttp wrote it: the path's methods, sorted, comma-separated.
        self._allowed = {
            path: ",".join(sorted(m for m, p in self._routes if p == path))
            for _method, path in self._routes
        }
        self.max_body = max_body
        self.observe = observe
        self.keepalive_timeout_s = keepalive_timeout_s
        self.request_timeout_s = request_timeout_s
        # No deadline can become due sooner than this after a connection's timer fired, so it
        # is the longest the timer may wait when none is pending.
        self.timer_horizon_s = min(keepalive_timeout_s, request_timeout_s)
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0 picks one); the bound port."""
        loop = self.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=1024)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening, give the answers owed up to ``timeout`` seconds, close the rest."""
        if self._server is None:
            return
        self._server.close()
        deadline = time.monotonic() + timeout
        while any(c.owes_answers for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None

    def route(self, method: str, path: str) -> Route | Response:
        """The route, or the 404/405 answer."""
        route = self._routes.get((method, path))
        if route is not None:
            return route
        allowed = self._allowed.get(path)
        if allowed is None:
            return _http_refusal(404)
        refusal = _http_refusal(405)
        refusal.headers["Allow"] = allowed
        return refusal


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    __slots__ = ("second", "value")

    def __init__(self) -> None:
        self.second = 0
        self.value = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self.second:
            self.second, self.value = second, formatdate(second, usegmt=True).encode()
        return self.value


_DATE = _Date()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests as they arrive, answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        assert server.loop is not None  # connections come once it listens
        self._server = server
        self._loop = server.loop
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._client: str | None = None  # the address counted against its bound, while held
        self._exchanges: deque[_Exchange] = deque()
        self._current: _Exchange | None = None  # head parsed, body still coming
        self._url: list[bytes] = []
        self._fields: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._in_head = True
        self._last_request = False  # the current request closes the connection after it
        self._closing = False  # a final answer is queued: nothing more is parsed
        self._eof = False  # the client sent all it will
        # The one timer: the deadlines' check while the connection is open, then the linger's end.
        self._timer: asyncio.TimerHandle | None = None
        self._request_started: float | None = None  # loop time of the current request's 1st byte
        self._idle_since = 0.0  # loop time the last answer owed was written
        self._held = False  # input not read because MAX_PIPELINED answers are owed
        self._writes_paused = False
        self._writes_paused_at = 0.0  # loop time the transport's buffer went over its limit
        self._reading = True

    @property
    def owes_answers(self) -> bool:
        return bool(self._exchanges) and self._transport is not None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        if len(server.connections) >= server.max_connections:
            self._turn_away(self._transport, _BUSY)
            return
        client = _client_address(self._transport)
        if client is not None:
            if server.clients.get(client, 0) >= server.max_connections_per_client:
                self._turn_away(self._transport, _BUSY_CLIENT)
                return
            server.clients[client] = server.clients.get(client, 0) + 1
            self._client = client
        server.connections.add(self)
        now = self._idle_since = self._loop.time()
        self._timer = self._loop.call_at(now + self._server.timer_horizon_s, self._check_deadlines)

    def _turn_away(self, transport: asyncio.Transport, problem: Problem) -> None:
        """Answer ``problem`` before any request is read, and close: the server, or this
        client, holds as many connections as it may."""
        self._closing = True
        self._transport = None  # never served: nothing else is written nor timed
        response = problem_response(problem)
        exchange = _Exchange(None, close=True)
        transport.write(self._encode(exchange, response))
        transport.close()
        if self._server.observe is not None:
            self._server.observe(None, response)

    def connection_lost(self, exc: Exception | None) -> None:
        server = self._server
        server.connections.discard(self)
        client, self._client = self._client, None
        if client is not None:
            left = server.clients[client] - 1
            if left:
                server.clients[client] = left
            else:
                del server.clients[client]
        self._transport = None
        self._exchanges.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool | None:
        # The client sends no more: the answers owed are still written (the transport stays
        # half-open for them) and the last one closes; a request cut short is answered 400.
        self._eof = True
        if not self._closing:
            current = self._current
            if current is not None and current.response is None:
                self._refuse(_http_refusal(400, "the connection ended inside a request"))
            else:
                self._stop_parsing()
                if self._exchanges:
                    self._exchanges[-1].close = True
        return True if self._exchanges else None

    def pause_writing(self) -> None:
        self._writes_paused = True
        self._writes_paused_at = self._loop.time()
        self._update_reading()

    def resume_writing(self) -> None:
        self._writes_paused = False
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # lingering: dropped
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # the request was answered as if without Upgrade, and closes the connection
        except httptools.HttpParserCallbackError:
            log.exception("reading a request failed")
            self._refuse(problem_response(_INTERNAL))
        except httptools.HttpParserError as exc:
            self._refuse(_http_refusal(400, f"not an HTTP/1.1 request: {_first_line(exc)}"))
        else:
            # Counted per read, so a head may pass the bound by one read before it is refused.
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self._closing:
                detail = f"the request head exceeds {MAX_HEAD_BYTES} bytes"
                self._refuse(_http_refusal(431, detail))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._request_started = self._loop.time()
        self._in_head = True
        self._url = []
        self._fields = []

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Values as aiohttp decoded them; names are tokens (ASCII), checked by the parser.
        self._fields.append(
            (name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._closing:
            return
        parser = self._parser
        target = b"".join(self._url).decode("utf-8", "surrogateescape")
        path = target.partition("?")[0]
        if "%" in path:
            path = unquote(path, errors="surrogateescape")
        request = Request(
            parser.get_method().decode("ascii"), path, parser.get_http_version(), self._fields
        )
        # After an Upgrade request the parser reads no further HTTP: answered, then closed.
        upgrade = parser.should_upgrade()
        exchange = _Exchange(request, close=upgrade or not parser.should_keep_alive())
        self._last_request = exchange.close
        self._exchanges.append(exchange)
        self._current = exchange
        headers = request.headers
        length = request.content_length
        has_body = bool(length) or "transfer-encoding" in headers
        if upgrade and has_body:  # the parser does not frame that body
            exchange.close = True
            self._answer(exchange, _http_refusal(400, "an Upgrade request with a body"))
            self._stop_parsing()
        elif request.version == "1.1" and "host" not in headers:
            exchange.close = True
            self._answer(exchange, _http_refusal(400, "an HTTP/1.1 request needs a Host header"))
            self._stop_parsing()
        else:
            self._route(exchange, request, length)
            if exchange.response is not None and exchange.expects_continue and has_body:
                # Refused before the body was asked for: the client may not send it, so the
                # connection cannot be read on (RFC 9110 10.1.1).
                exchange.close = True
                self._stop_parsing()
        self._flush()

    def _route(self, exchange: _Exchange, request: Request, length: int | None) -> None:
        expect = request.headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            self._answer(exchange, _http_refusal(417, "only Expect: 100-continue is supported"))
        else:
            exchange.expects_continue = expect is not None
            found = self._server.route(request.method, request.path)
            if isinstance(found, Response):
                self._answer(exchange, found)
            else:
                exchange.route = found
                if found.check is not None:
                    try:
                        found.check(request)
                    except ProblemError as refused:
                        self._answer(exchange, problem_response(refused.problem))
                    except Exception:
                        log.exception("%s %s failed", request.method, request.path)
                        self._answer(exchange, problem_response(_INTERNAL))
        if length is not None and length > self._server.max_body:
            # Not read: answered now (the route's refusal, or 413) and the connection closed.
            exchange.close = True
            if exchange.response is None:
                self._answer(exchange, self._too_large())
            self._stop_parsing()
        elif exchange.response is None and exchange.route is not None and exchange.route.read_body:
            exchange.parts = []

    def _too_large(self) -> Response:
        return problem_response(body_too_large(self._server.max_body).problem)

    def on_body(self, body: bytes) -> None:
        exchange = self._current
        if exchange is None or self._closing:
            return
        exchange.body_size += len(body)
        if exchange.body_size > self._server.max_body:  # chunked: no length to refuse on first
            exchange.close = True
            if exchange.response is None:
                self._answer(exchange, self._too_large())
            self._stop_parsing()
            if exchange in self._exchanges:
                self._flush()  # answered with Connection: close, then lingers
            elif self._transport is not None:
                self._linger(self._transport)  # answered already: the connection ends here
        elif exchange.parts is not None and exchange.response is None:
            exchange.parts.append(body)

    def on_message_complete(self) -> None:
        exchange, self._current = self._current, None
        self._request_started = None
        self._in_head = True
        self._head_bytes = 0
        if exchange is None or (self._closing and exchange.response is None):
            return
        exchange.complete = True
        if not self._exchanges:  # answered from its head and written: idle from now on
            self._idle_since = self._loop.time()
        if self._last_request:
            self._stop_parsing()
        if exchange.response is None:
            parts = exchange.parts
            request = exchange.request
            assert request is not None and exchange.route is not None
            if parts:
                request.body = parts[0] if len(parts) == 1 else b"".join(parts)
            exchange.parts = None
            self._dispatch(exchange, exchange.route, request)
        self._update_reading()
        self._flush()

    # -- answers -------------------------------------------------------------------------------

    def _dispatch(self, exchange: _Exchange, route: Route, request: Request) -> None:
        try:
            answer = route.handle(request)
        except ProblemError as refused:
            self._answer(exchange, problem_response(refused.problem))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            self._answer(exchange, problem_response(_INTERNAL))
        else:
            if isinstance(answer, Response):
                self._answer(exchange, answer)
            else:
                answer._attach(functools.partial(self._answered, exchange))

    def _answered(self, exchange: _Exchange, outcome: Response | BaseException) -> None:
        if isinstance(outcome, Response):
            response = outcome
        elif isinstance(outcome, ProblemError):
            response = problem_response(outcome.problem)
        else:
            request = exchange.request
            assert request is not None
            # The exception's text could quote the request: the trace only (RedactingFilter
            # scrubs it too).
            log.error("%s %s failed", request.method, request.path, exc_info=outcome)
            response = problem_response(_INTERNAL)
        self._answer(exchange, response)
        self._flush()

    def _answer(self, exchange: _Exchange, response: Response) -> None:
        exchange.response = response
        observe = self._server.observe
        if observe is not None:
            observe(exchange.request, response)

    def _refuse(self, response: Response) -> None:
        """Answer the request being read (or a new one) with ``response``, then close."""
        exchange = self._current
        if exchange is None or exchange.response is not None:
            exchange = _Exchange(None, close=True)
            self._exchanges.append(exchange)
        exchange.close = True
        self._answer(exchange, response)
        self._stop_parsing()
        self._flush()

    def _stop_parsing(self) -> None:
        self._closing = True
        self._current = None
        self._request_started = None

    def _flush(self) -> None:
        transport = self._transport
        exchanges = self._exchanges
        while transport is not None and exchanges:
            exchange = exchanges[0]
            response = exchange.response
            if response is None:
                if exchange.expects_continue and not (
                    exchange.continued or exchange.body_size or exchange.complete
                ):
                    exchange.continued = True
                    transport.write(_CONTINUE)
                    # The body is asked for only now: its time starts now.
                    self._request_started = self._loop.time()
                break
            exchanges.popleft()
            transport.write(self._encode(exchange, response))
            if exchange.close:
                exchanges.clear()
                self._linger(transport)
                return
            if not exchanges:
                self._idle_since = self._loop.time()
        self._update_reading()

    def _encode(self, exchange: _Exchange, response: Response) -> bytes:
        lines = [_STATUS_LINES[response.status]]
        for name, value in response.headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if response.content_type is not None:
            lines.append(b"Content-Type: %s\r\n" % response.content_type.encode("latin-1"))
        lines.append(b"Content-Length: %d\r\nDate: %s\r\n" % (len(response.body), _DATE.now()))
        if exchange.close:
            lines.append(b"Connection: close\r\n")
        elif exchange.request is not None and exchange.request.version == "1.0":
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"\r\n")
        if not exchange.head_only:
            lines.append(response.body)
        return b"".join(lines)

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after the last answer: send FIN once it is written, drop what the client still
        sends until it closes too, or ``LINGER_S`` passes."""
        self._stop_parsing()
        self._update_reading()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._eof:
            transport.close()  # after what is buffered is written
        elif transport.can_write_eof():
            transport.write_eof()
            self._timer = self._loop.call_at(
                self._loop.time() + LINGER_S, self._close_unread, transport
            )
        else:
            transport.close()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None:
            return
        held = not self._closing and len(self._exchanges) >= MAX_PIPELINED
        if held != self._held:
            self._held = held
            if not held and self._request_started is not None:
                # The request's rest waited on the server's answers, not on the client.
                self._request_started = self._loop.time()
        reading = self._closing or not (held or self._writes_paused)
        if reading != self._reading:
            self._reading = reading
            if reading:
                transport.resume_reading()
            else:
                transport.pause_reading()

    # -- timeouts ------------------------------------------------------------------------------

    def _check_deadlines(self) -> None:
        """The timer: close an idle connection, refuse a request that is late, or wait again.

        Reads only note times, so the timer often fires early (the client went on, or a request
        began): it then waits until the deadline now due, or the horizon, whichever is sooner.
        """
        self._timer = None
        transport = self._transport
        if transport is None or self._closing:
            return  # lingering, or the last answers are owed: the linger's timer follows
        server = self._server
        now = self._loop.time()
        wake = now + server.timer_horizon_s
        if self._writes_paused:
            # The client does not read its answers: its connection is given up, not kept
            # open (with the answers buffered) for as long as it likes.
            deadline = self._writes_paused_at + server.request_timeout_s
            if now >= deadline:
                log.info(
                    "closing a connection whose client read no answer for %gs",
                    now - self._writes_paused_at,
                )
                _reset(transport)
                return
            wake = min(wake, deadline)
        started = self._request_started
        if started is not None:
            if self._awaits_client():
                deadline = started + server.request_timeout_s
                if now >= deadline:
                    self._request_timed_out(transport)
                    return
                wake = min(wake, deadline)
        elif not self._exchanges:
            deadline = self._idle_since + server.keepalive_timeout_s
            if now >= deadline:
                self._close_unread(transport)
                return
            wake = min(wake, deadline)
        self._timer = self._loop.call_at(wake, self._check_deadlines)

    @staticmethod
    def _close_unread(transport: asyncio.Transport) -> None:
        """Close at a deadline: what is still buffered was not read in time, and ``close()``
        would wait for the client to read it, for ever if it never does."""
        if transport.get_write_buffer_size():
            _reset(transport)
        else:
            transport.close()

    def _awaits_client(self) -> bool:
        """Whether the request being read waits on the client's bytes rather than the server."""
        if self._held:
            return False
        current = self._current
        return current is None or not (
            current.expects_continue and not current.continued and not current.body_size
        )

    def _request_timed_out(self, transport: asyncio.Transport) -> None:
        exchange = self._current
        if exchange is not None and exchange.response is not None:
            # Answered from its head (a check refused it), its body still coming: that answer
            # is the last, or was, and the connection closes.
            exchange.close = True
            self._stop_parsing()
            if exchange in self._exchanges:
                self._flush()
            else:
                self._linger(transport)
            return
        timeout = self._server.request_timeout_s
        self._refuse(_http_refusal(408, f"the request did not arrive within {timeout:g} s"))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _reset(transport: asyncio.Transport) -> None:
    """Drop the connection with a reset: ``abort()`` alone closes the socket, and the kernel
    would go on offering the unread answers to a client that reads nothing, on either loop. A
    zero linger makes the close discard them and send RST."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


_INTERNAL = Problem(500, "internal", "Internal error", "the receiver failed; retry")
_BUSY = Problem(
    503,
    "too-many-connections",
    "Too many connections",
    "the receiver holds as many connections as it may; retry, or reuse a connection",
    retry_after_s=1,
)
_BUSY_CLIENT = Problem(
    429,
    "too-many-connections-from-client",
    "Too many connections from this client",
    "this client address holds as many connections as it may; reuse a connection",
    retry_after_s=1,
)


def _client_address(transport: asyncio.BaseTransport) -> str | None:
    """The peer's host, or None when there is none to count by (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


def _first_line(error: Exception) -> str:
    text = str(error).splitlines()
    return text[0][:120] if text else type(error).__name__
