"""The two ways a delivery leaves: an HTTP POST to a webhook, an append to a Kafka topic.

Webhook sends run on one uvloop loop in a thread of their own, many at once; the worker hands
over a batch and waits for all the answers. A send never raises: whatever happens (an answer, a
timeout, a refused connection) is a :class:`SendResult`. The sender has ``connections`` of its
own (its pool): one request in flight on each. A batch no larger than that starts every send at
once; the worker never hands over more, since each send it hands over is recorded SENT first
(decision 026). A larger batch (a caller that records nothing) queues for the connections, and
a send that finds none before its deadline comes back not sent (``no_connection``).

Redirects are not followed: a delivery goes where it was configured to go, or fails. Nothing is
sent but the delivery's own headers and the two that frame the request (``Host``,
``Content-Length``): no cookies, no user agent.

A sender given an :class:`~ledger.destinations.AddressGuard` (the delivery worker always gives
one, from its settings) connects only to addresses the guard accepts: every address the host
resolves to is checked when a connection is opened, and the connection goes to the address
checked, so a name that resolves elsewhere a moment later (DNS rebinding) gains nothing. A
refused address is an :class:`AddressRefused` result: no connection is made (decision 019).
Connections are kept alive and reused, so this costs once per connection, not per request.

The HTTP/1.1 client is our own, small one (asyncio protocols, ``httptools`` to parse answers):
a webhook POST needs one request shape and three things from the answer (status, reason,
``Retry-After``), and a general client (aiohttp) spent about twice the CPU of the receiver per
request on everything else (``bench/bench_delivery.py``; the bench's baseline uses this client
too, so the ratio measures the worker alone).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast
from urllib.parse import quote, urlsplit

import httptools
import uvloop

from ledger.destinations import Address, AddressGuard, literal_address, refused_text
from ledger.domain.delivery import SendResult, parse_retry_after
from ledger.metrics import Metrics
from ledger.secrets import cut_tokens

#: Bytes of an answer's body read (and dropped) to keep its connection reusable; past this the
#: answer counts as complete and the connection is closed rather than drained.
DRAIN_BYTES = 64 * 1024
#: Bytes of a destination's HTTP reason phrase kept (the rest is dropped as it arrives).
MAX_REASON_BYTES = 128
#: An idle connection older than this is closed rather than reused: servers drop idle
#: keep-alive connections after a few seconds (aiohttp 75 s, nginx 75 s, Node 5 s).
IDLE_S = 4.0
#: Headers the client writes itself; a delivery may not set them.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})
#: Characters of a path and query sent as they are (RFC 3986 reserved and unreserved, and '%'
#: so that an already percent-encoded URL is not encoded twice).
_URL_SAFE = "/?:@!$&'()*+,;=-._~%"


@dataclass(frozen=True, slots=True)
class WebhookSend:
    url: str
    headers: dict[str, str]
    body: bytes
    timeout_s: float


@dataclass(frozen=True, slots=True)
class AddressRefused(SendResult):
    """Not sent, and no connection made: the destination's address is in a network the
    sender's guard refuses. Lasting: every send would meet the same refusal until the network
    is allowed (``detail`` says which rule and how)."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a URL's requests go, and the start of every request to it."""

    key: tuple[str, str, int]
    host: str
    port: int
    tls: bool
    request_line_and_host: bytes
    #: the host when it is an IP address (checked without a name lookup)
    literal: Address | None = None


class _RequestError(Exception):
    """A request that cannot be made as configured (a bad URL or header)."""


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _RequestError(f"not an http(s) URL: {url!r}")
    if parts.username is not None or parts.password is not None:
        raise _RequestError("a webhook URL must not carry credentials")
    tls = parts.scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError as exc:
        raise _RequestError(f"not a URL: {exc}") from None
    host = parts.hostname
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise _RequestError(f"not a host name: {host!r} ({exc})") from None
    shown = f"[{ascii_host}]" if ":" in ascii_host else ascii_host
    if port != (443 if tls else 80):
        shown += f":{port}"
    target = quote(parts.path or "/", safe=_URL_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_URL_SAFE)
    _check_header_text(target, shown)
    start = f"POST {target} HTTP/1.1\r\nHost: {shown}\r\n"
    return _Target(
        (parts.scheme, ascii_host, port),
        host,
        port,
        tls,
        start.encode("ascii"),
        literal_address(host),
    )


def _check_header_text(*texts: str) -> None:
    for text in texts:
        if "\r" in text or "\n" in text or "\x00" in text:
            raise _RequestError(f"a line break or NUL in the request line: {text!r}")


def _request(target: _Target, send: WebhookSend) -> bytes:
    """The request's bytes, built once (a retry on a fresh connection sends the same)."""
    headers = send.headers
    for name in headers:
        if name.lower() in _FRAMING:
            raise _RequestError(f"the {name} header is the client's to write")
    head = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # Every CR and LF must be one this function wrote: a header cannot smuggle in another.
    lines = len(headers)
    if head.count("\r") != lines or head.count("\n") != lines or "\x00" in head:
        raise _RequestError("a line break or NUL in a header")
    return b"".join(
        (
            target.request_line_and_host,
            b"Content-Length: %d\r\n" % len(send.body),
            head.encode("utf-8"),
            b"\r\n",
            send.body,
        )
    )


class _TimedOutError(Exception):
    """No (complete) answer before the send's deadline."""


class _RefusedError(Exception):
    """The destination's host is (or resolves to) an address the guard refuses."""


class _ExchangeError(Exception):
    """A request on one connection that ended without a (complete) answer."""

    def __init__(self, detail: str, *, before_any_byte: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        #: nothing of an answer arrived: the request can be made again on a fresh connection
        self.before_any_byte = before_any_byte


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    reason: str
    retry_after: str | None


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, its answer parsed as it
    arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[_Answer] | None = None
        self.lost = False
        #: the connection may carry another request once this answer is complete
        self.reusable = True
        self.idle_since = 0.0
        #: the guard this connection's address was checked against when it was opened
        self.guard: AddressGuard | None = None
        self._any_byte = False
        self._headers_done = False
        self._body_bytes = 0
        self._status = 0
        self._reason = b""
        self._retry_after: bytes | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (a late answer, a server's goodbye): not reusable.
            self.close()
            return
        self._any_byte = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"not an HTTP/1.1 answer: {exc}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        if self._waiter is None or self._waiter.done():
            return
        if self._headers_done and self._status >= 200:
            # An answer without a length ends where the connection does (RFC 9112 6.3).
            self._complete()
            return
        if self._any_byte:
            self._fail("the connection closed before the answer was complete")
        else:
            reason = f" ({exc})" if exc is not None else ""
            self._fail(f"the connection closed before any answer{reason}", before_any_byte=True)

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers_done = False
        self._body_bytes = 0
        self._reason = b""
        self._retry_after = None

    def on_status(self, status: bytes) -> None:
        # The destination writes the reason phrase: keep what a person needs ("Service
        # Unavailable"), not kilobytes that every later step (the scrub first) would carry.
        room = MAX_REASON_BYTES + 1 - len(self._reason)  # one more: tells a cut phrase
        if room > 0:
            self._reason += status[:room]

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 11 and name.lower() == b"retry-after":
            self._retry_after = value

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > DRAIN_BYTES and self._status >= 200:
            # Enough of a body nobody reads: answered, and the connection is given up.
            self.reusable = False
            self._complete()

    def on_message_complete(self) -> None:
        if self._status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        if not self._parser.should_keep_alive():
            self.reusable = False  # Connection: close, or HTTP/1.0 without keep-alive
        self._complete()

    # -- one exchange --------------------------------------------------------------------------

    def exchange(self, request: bytes) -> asyncio.Future[_Answer]:
        """Write ``request``; the future is its answer, or fails with :class:`_ExchangeError`."""
        waiter: asyncio.Future[_Answer] = self._loop.create_future()
        self._waiter = waiter
        self._any_byte = False
        self._headers_done = False
        self._status = 0
        if self.lost or self._transport is None or self._transport.is_closing():
            self._fail("the connection was closed", before_any_byte=True)
        else:
            self._transport.write(request)
        return waiter

    def _complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            retry_after = self._retry_after
            waiter.set_result(
                _Answer(
                    self._status,
                    cut_tokens(self._reason.decode("latin-1").strip(), MAX_REASON_BYTES),
                    None if retry_after is None else retry_after.decode("latin-1"),
                )
            )

    def _fail(self, detail: str, *, before_any_byte: bool = False) -> None:
        self.reusable = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(_ExchangeError(detail, before_any_byte=before_any_byte))

    def abandon(self) -> None:
        """The request timed out: its answer, if any, comes to nobody."""
        self._waiter = None
        self.close()

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None:
            self._transport.close()


class WebhookSender:
    """POSTs batches of webhook sends concurrently, up to ``concurrency`` in flight, on
    keep-alive connections pooled per (scheme, host, port)."""

    def __init__(self, *, concurrency: int, metrics: Metrics | None = None) -> None:
        self._concurrency = concurrency
        self._observe = (
            None if metrics is None else metrics.delivery_send_seconds.labels("webhook").observe
        )
        self._metrics = metrics
        if metrics is not None:
            metrics.delivery_pool_connections_max.set(concurrency)
        # uvloop: the sends' loop does nothing but HTTP, and libuv does it with far less Python.
        self._loop = uvloop.new_event_loop()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._batches: asyncio.Lock | None = None
        self._tls: ssl.SSLContext | None = None
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="opledger-webhooks", daemon=True
        )
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()

    async def _open(self) -> None:
        self._batches = asyncio.Lock()

    def send_many(
        self, sends: Sequence[WebhookSend], *, guard: AddressGuard | None = None
    ) -> list[SendResult]:
        """Send all of ``sends`` at once; their results, in order. With a ``guard``, only to
        addresses it accepts; without one (a caller that vouches for its URLs), anywhere."""
        if not sends:
            return []
        return self.start_many(sends, guard=guard).result()

    @property
    def connections(self) -> int:
        """The pool's size: requests in flight at once, each on a connection of its own."""
        return self._concurrency

    def start_many(
        self, sends: Sequence[WebhookSend], *, guard: AddressGuard | None = None
    ) -> Future[list[SendResult]]:
        """:meth:`send_many` without waiting: the future's result is theirs. Batches go out
        one after the other, in the order they were started. A batch of at most
        :attr:`connections` sends, started when the one before it is answered, starts every
        send at once; in a larger one a send may wait for a connection, and one that finds none
        before its deadline is a ``no_connection`` result, never sent."""
        return asyncio.run_coroutine_threadsafe(self._send_all(sends, guard), self._loop)

    async def _send_all(
        self, sends: Sequence[WebhookSend], guard: AddressGuard | None
    ) -> list[SendResult]:
        assert self._batches is not None
        results: list[SendResult | None] = [None] * len(sends)
        queue = iter(enumerate(sends))

        # Each send's timeout counts from here, the hand-over, not from when a lane takes it:
        # the worker recorded the batch SENT just before, and a SENT older than its timeout
        # (plus a margin) is taken for one whose answer was lost.
        handed_over = self._loop.time()

        in_use = None if self._metrics is None else self._metrics.delivery_pool_connections_in_use

        async def lane() -> None:
            for index, send in queue:  # the lanes share one iterator: each send once
                if in_use is not None:
                    in_use.inc()  # a lane is one connection's turns
                try:
                    results[index] = await self._send(send, handed_over + send.timeout_s, guard)
                finally:
                    if in_use is not None:
                        in_use.dec()

        # One batch at a time, ``concurrency`` lanes: never more requests in flight (or
        # connections open) than that, with one task per lane rather than per send.
        async with self._batches:
            lanes = min(self._concurrency, len(sends))
            await asyncio.gather(*(lane() for _ in range(lanes)))
        return [r if r is not None else SendResult(None, "not sent") for r in results]

    async def _send(
        self, send: WebhookSend, deadline: float, guard: AddressGuard | None
    ) -> SendResult:
        try:
            target = _target(send.url)
            request = _request(target, send)
        except _RequestError as exc:
            return SendResult(None, f"not sent: {exc}")
        if self._loop.time() >= deadline:
            return SendResult(
                None,
                f"not sent: no connection came free within {send.timeout_s:g} s",
                no_connection=True,
            )
        started = time.monotonic()
        try:
            return await self._post(target, request, deadline, send, guard)
        except _TimedOutError:
            return SendResult(None, f"no answer within {send.timeout_s:g} s")
        finally:
            if self._observe is not None:
                self._observe(time.monotonic() - started)

    async def _post(
        self,
        target: _Target,
        request: bytes,
        deadline: float,
        send: WebhookSend,
        guard: AddressGuard | None,
    ) -> SendResult:
        connection = self._reuse(target, guard)
        if connection is not None:
            try:
                return await self._on(connection, target, request, deadline, send)
            except _ExchangeError as failed:
                if not failed.before_any_byte:
                    return SendResult(None, failed.detail)
                # The server closed the idle connection as we wrote to it: the request can
                # only have been lost, and a delivery is idempotent by its key anyway.
        try:
            connection = await self._connect(target, deadline, guard)
        except TimeoutError:
            raise _TimedOutError from None
        except _RefusedError as refused:
            return AddressRefused(None, f"not sent: {refused}")
        except (OSError, ssl.SSLError) as exc:
            return SendResult(None, f"could not connect: {_os_reason(exc)}")
        try:
            return await self._on(connection, target, request, deadline, send)
        except _ExchangeError as failed:
            return SendResult(None, failed.detail)

    async def _on(
        self,
        connection: _Connection,
        target: _Target,
        request: bytes,
        deadline: float,
        send: WebhookSend,
    ) -> SendResult:
        answer_future = connection.exchange(request)
        timer = self._loop.call_at(deadline, _expire, answer_future)
        try:
            answer = await answer_future
        except _TimedOutError:
            connection.abandon()
            raise
        except _ExchangeError:
            connection.close()
            raise
        finally:
            timer.cancel()
        if connection.reusable and not connection.lost:
            connection.idle_since = self._loop.time()
            self._idle.setdefault(target.key, []).append(connection)
        else:
            connection.close()
        retry_after = (
            None
            if answer.retry_after is None
            else parse_retry_after(answer.retry_after, datetime.now(UTC))
        )
        return SendResult(answer.status, answer.reason, retry_after)

    def _reuse(self, target: _Target, guard: AddressGuard | None) -> _Connection | None:
        idle = self._idle.get(target.key)
        now = self._loop.time()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be dropped
            if (
                not connection.lost
                and now - connection.idle_since < IDLE_S
                # Opened under another guard (or none): its address was not checked by this one.
                and connection.guard is guard
            ):
                return connection
            connection.close()
        return None

    async def _connect(
        self, target: _Target, deadline: float, guard: AddressGuard | None
    ) -> _Connection:
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        # The Host header and TLS (SNI, the certificate's name) keep the URL's host, whatever
        # address the connection goes to.
        server_hostname = target.host if tls is not None else None
        async with asyncio.timeout_at(deadline):
            if guard is None:
                _transport, connection = await self._loop.create_connection(
                    lambda: _Connection(self._loop),
                    target.host,
                    target.port,
                    ssl=tls,
                    server_hostname=server_hostname,
                )
                return connection
            failure: OSError | None = None
            for family, address in await self._vetted(target, guard):
                try:
                    _transport, connection = await self._loop.create_connection(
                        lambda: _Connection(self._loop),
                        address,  # the address checked, never the name again
                        target.port,
                        family=family,
                        ssl=tls,
                        server_hostname=server_hostname,
                    )
                except ssl.SSLError:
                    raise  # the address answered: not one to pass over for the next
                except OSError as exc:
                    failure = exc  # as create_connection does: try the next address
                    continue
                connection.guard = guard
                return connection
            assert failure is not None
            raise failure

    async def _vetted(self, target: _Target, guard: AddressGuard) -> list[tuple[int, str]]:
        """Every address of ``target``'s host, in the resolver's order, as (family, address
        to connect to); _RefusedError if ``guard`` refuses any of them."""
        if target.literal is not None:
            rule = guard.refusal(target.literal)
            if rule is not None:
                raise _RefusedError(refused_text(target.literal, rule))
            family = socket.AF_INET if target.literal.version == 4 else socket.AF_INET6
            return [(family, str(target.literal))]
        infos = await self._loop.getaddrinfo(
            target.key[1], target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        vetted: list[tuple[int, str]] = []
        for family, _type, _proto, _name, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = literal_address(str(sockaddr[0]))
            if address is None:
                continue
            if family == socket.AF_INET6 and len(sockaddr) >= 4 and sockaddr[3]:
                # A scoped (link-local) address: keep its interface, by number.
                address = literal_address(f"{address}%{sockaddr[3]}") or address
            rule = guard.refusal(address)
            if rule is not None:
                # One refused address refuses the host: which one a connection gets is the
                # resolver's (or an attacker's) choice.
                raise _RefusedError(refused_text(address, rule, target.host))
            if (family, str(address)) not in vetted:
                vetted.append((family, str(address)))
        if not vetted:
            raise OSError(f"{target.host} has no IPv4 or IPv6 address")
        return vetted

    def close(self) -> None:
        def shut() -> None:
            for idle in self._idle.values():
                for connection in idle:
                    connection.close()
            self._idle.clear()

        if self._loop.is_running():
            self._loop.call_soon_threadsafe(shut)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _expire(future: asyncio.Future[_Answer]) -> None:
    if not future.done():
        future.set_exception(_TimedOutError())


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
