"""HTTP/1.1 GETs many at a time on raw kept-alive sockets: what ``HttpToolProvider.lookup_many``
is made of.

``http.client`` costs a thread per request in flight, and its parsing and the thread hand-offs
cost several times the exchange itself (decision 008). Here one thread keeps up to ``in_flight``
requests going over non-blocking sockets and reads each answer with :class:`ResponseReader`.

Only for requests that change nothing (lookups): an answer that cannot be read, a timeout or a
reset is reported as such, and a request that met a pooled connection the server had closed is
asked again once on a new one. One request at a time per connection (no pipelining), and a
connection is reused only when its answer ended exactly where the bytes did and nothing arrived
on it while it was idle, so an answer is never read as another request's.
"""

from __future__ import annotations

import errno
import os
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: Larger heads or bodies are refused (the connection is dropped) rather than buffered.
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")


class BadResponseError(Exception):
    """The bytes on the connection are not one well-formed HTTP/1.x response."""


class ResponseReader:
    """One HTTP/1.x response to a GET, from the bytes as they arrive (no I/O of its own).

    Bodies framed by Content-Length, chunked, or (without either) by the end of the stream;
    interim 1xx answers are skipped. Bytes beyond the end of the response are an error: one
    request is in flight per connection, so they can belong to no request.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._head_read = False
        self._chunked = False
        #: body bytes announced by Content-Length; None: chunked, or until the stream ends
        self._length: int | None = None
        #: bytes left in the current chunk; None: a chunk-size line is next; -1: trailers
        self._chunk_left: int | None = None
        self._chunks = bytearray()
        self.received = 0
        self.complete = False
        self.status = 0
        self.keep_alive = True
        self.body = b""

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True once the whole response is in."""
        self.received += len(data)
        if self.complete:
            if data:
                raise BadResponseError("bytes after the end of the response")
            return True
        self._buffer += data
        if not self._head_read and not self._read_head():
            return False
        if self._chunked:
            return self._read_chunks()
        if self._length is None:
            if len(self._buffer) > MAX_BODY_BYTES:
                raise BadResponseError("response body too large")
            return False
        if len(self._buffer) < self._length:
            return False
        if len(self._buffer) > self._length:
            raise BadResponseError("more bytes than the response announced")
        return self._finish(bytes(self._buffer))

    def end_of_stream(self) -> bool:
        """The peer closed the connection: True if that ends the response (a body without
        length), else :class:`BadResponseError`."""
        if self.complete:
            return True
        if self._head_read and not self._chunked and self._length is None:
            self.keep_alive = False
            return self._finish(bytes(self._buffer))
        raise BadResponseError("the connection closed before the whole response")

    def _finish(self, body: bytes) -> bool:
        self.body = body
        self._buffer.clear()
        self.complete = True
        return True

    def _read_head(self) -> bool:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise BadResponseError("response head too large")
                return False
            lines = bytes(self._buffer[:end]).split(b"\r\n")
            del self._buffer[: end + 4]
            version, status = _status_line(lines[0])
            if 100 <= status < 200 and status != 101:
                continue  # interim: the answer follows
            break
        fields = _fields(lines[1:])
        connection = _tokens(fields, b"connection")
        self.keep_alive = (
            b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
        )
        self.status = status
        codings = _tokens(fields, b"transfer-encoding")
        lengths = set(fields.get(b"content-length", []))
        if status in (204, 304):
            self._length = 0
        elif codings:
            if codings[-1] != b"chunked" or not set(codings) <= {b"chunked", b"identity"}:
                raise BadResponseError(f"unsupported transfer coding {codings!r}")
            self._chunked = True
        elif lengths:
            if len(lengths) != 1 or not (value := lengths.pop().strip()).isdigit():
                raise BadResponseError("invalid Content-Length")
            self._length = int(value)
            if self._length > MAX_BODY_BYTES:
                raise BadResponseError("response body too large")
        else:
            self.keep_alive = False  # the body ends with the stream
        self._head_read = True
        return True

    def _read_chunks(self) -> bool:
        while True:
            if self._chunk_left is None:
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEAD_BYTES:
                        raise BadResponseError("chunk size line too long")
                    return False
                size = bytes(self._buffer[:end]).split(b";", 1)[0].strip()
                del self._buffer[: end + 2]
                if not size or not set(size) <= _HEX:
                    raise BadResponseError("invalid chunk size")
                self._chunk_left = int(size, 16) or -1
                if len(self._chunks) + max(self._chunk_left, 0) > MAX_BODY_BYTES:
                    raise BadResponseError("response body too large")
            if self._chunk_left == -1:  # the last chunk: trailers (ignored), then an empty line
                if self._buffer.startswith(b"\r\n"):
                    end = 0
                else:
                    end = self._buffer.find(b"\r\n\r\n")
                    if end < 0:
                        if len(self._buffer) > MAX_HEAD_BYTES:
                            raise BadResponseError("trailers too large")
                        return False
                    end += 2
                del self._buffer[: end + 2]
                if self._buffer:
                    raise BadResponseError("bytes after the end of the response")
                return self._finish(bytes(self._chunks))
            if len(self._buffer) < self._chunk_left + 2:
                return False
            if self._buffer[self._chunk_left : self._chunk_left + 2] != b"\r\n":
                raise BadResponseError("chunk not followed by CRLF")
            self._chunks += self._buffer[: self._chunk_left]
            del self._buffer[: self._chunk_left + 2]
            self._chunk_left = None


def _status_line(line: bytes) -> tuple[bytes, int]:
    parts = line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadResponseError(f"not an HTTP/1.x status line: {line[:80]!r}")
    if len(parts[1]) != 3 or not parts[1].isdigit():
        raise BadResponseError(f"invalid status code in {line[:80]!r}")
    return parts[0], int(parts[1])


def _tokens(fields: dict[bytes, list[bytes]], name: bytes) -> list[bytes]:
    """The comma-separated tokens of every ``name`` field, lower-cased, empty ones dropped."""
    tokens = (t.strip().lower() for value in fields.get(name, []) for t in value.split(b","))
    return [t for t in tokens if t]


def _fields(lines: Sequence[bytes]) -> dict[bytes, list[bytes]]:
    fields: dict[bytes, list[bytes]] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadResponseError(f"invalid header line {line[:80]!r}")
        fields.setdefault(name.lower(), []).append(value.strip())
    return fields


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the request at ``index``, or why there is none (``error``)."""

    index: int
    status: int = 0
    body: bytes = b""
    error: str | None = None


class _Flight:
    """One request on one connection."""

    __slots__ = (
        "connecting",
        "deadline",
        "done",
        "index",
        "may_resend",
        "out",
        "reader",
        "request",
        "reused",
        "sock",
    )

    def __init__(
        self,
        sock: socket.socket,
        index: int,
        request: bytes,
        deadline: float,
        *,
        connecting: bool,
        reused: bool,
        may_resend: bool,
    ) -> None:
        self.sock = sock
        self.index = index
        self.request = request
        self.out = memoryview(request)
        self.deadline = deadline
        self.connecting = connecting
        #: the connection carried an earlier request: the server may have closed it since
        self.reused = reused
        self.may_resend = may_resend
        self.reader = ResponseReader()
        self.done = False


class Wires:
    """Kept-alive connections to one ``host:port`` for read-only GETs, many at a time.

    Thread-safe: each :meth:`get_many` uses connections of its own, taken from and given back to
    one pool. A pooled connection idle longer than ``max_idle_s`` is closed instead of reused.
    """

    def __init__(self, host: str, port: int, *, max_idle: int = 64, max_idle_s: float = 2.0):
        self._host = host
        self._port = port
        self._max_idle = max_idle
        self._max_idle_s = max_idle_s
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []
        #: connections opened so far (a measure of reuse, for tests and benchmarks)
        self.connections_opened = 0

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def get_many(
        self, requests: Sequence[bytes], *, timeout_s: float, in_flight: int
    ) -> Iterator[Reply]:
        """Send each request (a whole GET request's bytes) and yield one :class:`Reply` per
        request as the answers come, at most ``in_flight`` at once; each request gets
        ``timeout_s`` from the moment it starts (connect, send, answer)."""
        todo = deque((index, request, True) for index, request in enumerate(requests))
        selector = selectors.DefaultSelector()
        #: requests in the order they started, hence of their deadlines (one timeout for all)
        started: deque[_Flight] = deque()
        address: tuple[int, int, int, object] | None = None
        flying = 0
        try:
            while todo or flying:
                while todo and flying < in_flight:
                    index, request, may_resend = todo.popleft()
                    sock = self._pooled()
                    reused = sock is not None
                    if sock is None:
                        if address is None:
                            address = self._address()
                        sock, error = self._connect(address)
                        if sock is None:
                            yield Reply(index, error=error)
                            continue
                    flight = _Flight(
                        sock, index, request, time.monotonic() + timeout_s,
                        connecting=not reused, reused=reused, may_resend=may_resend,
                    )  # fmt: skip
                    started.append(flight)
                    flying += 1
                    selector.register(sock, selectors.EVENT_WRITE, flight)
                while started and started[0].done:
                    started.popleft()
                wait = max(started[0].deadline - time.monotonic(), 0.0) if started else 0.0
                for key, events in selector.select(wait):
                    flight = key.data
                    reply, resend = self._progress(flight, events, selector)
                    if reply is None and not resend:
                        continue
                    flight.done = True
                    flying -= 1
                    if resend:
                        self._drop(flight.sock, selector)
                        todo.appendleft((flight.index, flight.request, False))
                        continue
                    assert reply is not None
                    if reply.error is None and flight.reader.keep_alive and todo:
                        # The next request goes out on this connection at once, if still quiet.
                        if readable(flight.sock):
                            self._drop(flight.sock, selector)
                        else:
                            index, request, may_resend = todo.popleft()
                            following = _Flight(
                                flight.sock, index, request, time.monotonic() + timeout_s,
                                connecting=False, reused=True, may_resend=may_resend,
                            )  # fmt: skip
                            started.append(following)
                            flying += 1
                            selector.modify(flight.sock, selectors.EVENT_WRITE, following)
                    elif reply.error is None and flight.reader.keep_alive:
                        selector.unregister(flight.sock)
                        self._put_back(flight.sock)
                    else:
                        self._drop(flight.sock, selector)
                    yield reply
                now = time.monotonic()
                while started and (started[0].done or started[0].deadline <= now):
                    flight = started.popleft()
                    if not flight.done:
                        flight.done = True
                        flying -= 1
                        self._drop(flight.sock, selector)
                        yield Reply(flight.index, error=f"no answer within {timeout_s:g}s")
        finally:
            for flight in started:
                if not flight.done:
                    flight.sock.close()
            selector.close()

    @staticmethod
    def _drop(sock: socket.socket, selector: selectors.BaseSelector) -> None:
        selector.unregister(sock)
        sock.close()

    def _progress(
        self, flight: _Flight, events: int, selector: selectors.BaseSelector
    ) -> tuple[Reply | None, bool]:
        """Move ``flight`` on; returns its reply once there is one, or True to send the request
        again on a new connection (a reused one the server had closed)."""
        try:
            if events & selectors.EVENT_WRITE:
                if flight.connecting:
                    error = flight.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if error:
                        raise OSError(error, os.strerror(error))
                    flight.connecting = False
                flight.out = flight.out[flight.sock.send(flight.out) :]
                if not flight.out:
                    selector.modify(flight.sock, selectors.EVENT_READ, flight)
                return None, False
            data = flight.sock.recv(65536)
            done = flight.reader.feed(data) if data else flight.reader.end_of_stream()
        except (OSError, BadResponseError) as exc:
            # Reset, or closed before a byte of the answer: what a reused connection the server
            # had closed looks like (a BadResponseError with nothing received is that close).
            closed = isinstance(exc, ConnectionError | BadResponseError)
            if flight.reused and flight.may_resend and closed and flight.reader.received == 0:
                return None, True
            return Reply(flight.index, error=f"{type(exc).__name__}: {exc}"), False
        if not done:
            return None, False
        return Reply(flight.index, flight.reader.status, flight.reader.body), False

    def _address(self) -> tuple[int, int, int, object]:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM
        )[0]
        return family, kind, proto, sockaddr

    def _connect(
        self, address: tuple[int, int, int, object]
    ) -> tuple[socket.socket | None, str | None]:
        family, kind, proto, sockaddr = address
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        code = sock.connect_ex(sockaddr)  # type: ignore[arg-type]  # getaddrinfo's own address
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            return None, f"connect: {os.strerror(code)}"
        with self._lock:
            self.connections_opened += 1
        return sock, None

    def _pooled(self) -> socket.socket | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                sock, idle_since = self._idle.pop()
            if time.monotonic() - idle_since <= self._max_idle_s and not readable(sock):
                return sock
            sock.close()  # too old, closed by the server, or holding bytes nobody asked for

    def _put_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()


def readable(sock: socket.socket) -> bool:
    """Whether an idle socket polls readable: the server closed it, or sent bytes unasked.
    Either way it must not carry another request."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))
