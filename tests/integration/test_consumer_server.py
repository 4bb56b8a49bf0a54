"""The receiver's HTTP/1.1 server (``consumers.server``) on real sockets on 127.0.0.1, on both
event loops it runs on (uvloop in ``opledger consumer run``, asyncio's own in the tests'
receivers): keep-alive and pipelining in order, bodies in pieces and chunked, the 413 before a
body is read, malformed and oversized input refused with a problem document and the connection
closed, 100-continue, HEAD, 404/405, the idle and request timeouts (and a slow handler cut by
neither). No Kafka or PostgreSQL: the routes here are stand-ins; the receiver's own routes over
this server are ``test_consumer.py``'s."""

from __future__ import annotations

import asyncio
import hashlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from consumers.contract import (
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_PREFIX,
    malformed_key,
)
from consumers.server import (
    LINGER_S,
    MAX_HEAD_BYTES,
    MAX_PIPELINED,
    Deferred,
    HttpServer,
    Request,
    Response,
    Route,
    json_response,
)

MAX_BODY = 64 * 1024
BIG_BODY = b"x" * (1024 * 1024)
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


class Served:
    """An :class:`HttpServer` with stand-in routes, on its own loop in a thread.

    - ``POST /echo``: 200, the body's length and sha256 (and the ``X-N`` header back).
    - ``POST /later``: answered by a :class:`Deferred` that the test resolves (:meth:`release`).
    - ``POST /checked``: refused by its check (400) unless ``X-Ok: 1``; then like ``/echo``.
    - ``POST /boom``: the handler raises.
    - ``GET /ping``: 200 ``{"pong": true}``.
    - ``GET /big``: 200 with :data:`BIG_BODY`.
    """

    def __init__(
        self, loop_factory: Callable[[], asyncio.AbstractEventLoop], **timeouts: float
    ) -> None:
        self.loop = loop_factory()
        self.pending: list[Deferred] = []
        self.seen: list[tuple[str, str, int]] = []  # (method, path, status) as observed
        self.clients: list[Client] = []
        self.server = HttpServer(
            {
                ("POST", "/echo"): Route(self._echo, read_body=True),
                ("POST", "/later"): Route(self._later, read_body=True),
                ("POST", "/checked"): Route(self._echo, check=self._check, read_body=True),
                ("POST", "/boom"): Route(self._boom, read_body=True),
                ("GET", "/ping"): Route(lambda _r: json_response({"pong": True})),
                ("GET", "/big"): Route(lambda _r: Response(200, BIG_BODY, "text/plain")),
            },
            max_body=MAX_BODY,
            observe=lambda r, a: self.seen.append(
                (r.method, r.path, a.status) if r is not None else ("", "", a.status)
            ),
            **timeouts,
        )
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.call(self.server.start("127.0.0.1", 0))

    def client(self, source: str | None = None) -> Client:
        """A new connection to the server (from the loopback address ``source``, if given);
        :meth:`close` closes it, so a test need not."""
        self.clients.append(Client(self.port, source))
        return self.clients[-1]

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def wait_pending(self, count: int) -> None:
        """Wait until ``count`` requests are waiting on ``/later``."""
        deadline = time.monotonic() + 10
        while len(self.pending) < count:
            assert time.monotonic() < deadline, "the requests did not reach /later"
            time.sleep(0.01)

    def release(self, count: int, error: Exception | None = None) -> None:
        """Answer the first ``count`` requests waiting on ``/later``: 202 ``later``, or fail
        them with ``error``."""
        self.wait_pending(count)

        async def answer() -> None:
            for deferred in self.pending[:count]:
                if error is None:
                    deferred.resolve(Response(202, b"later", "text/plain"))
                else:
                    deferred.fail(error)
            del self.pending[:count]

        self.call(answer())

    def close(self) -> None:
        # The clients first, as when each test closed its own: the server's close then ends
        # only connections their clients have already left.
        for client in self.clients:
            client.close()
        self.call(self.server.close(timeout=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @staticmethod
    def _echo(request: Request) -> Response:
        document = {
            "length": len(request.body),
            "sha256": hashlib.sha256(request.body).hexdigest(),
            "n": request.headers.get("x-n"),
        }
        return json_response(document)

    def _later(self, _request: Request) -> Deferred:
        deferred = Deferred()
        self.pending.append(deferred)
        return deferred

    @staticmethod
    def _check(request: Request) -> None:
        if request.headers.get("x-ok") != "1":
            raise malformed_key("stand-in refusal")

    @staticmethod
    def _boom(_request: Request) -> Response:
        raise RuntimeError("handler bug")


@pytest.fixture(params=sorted(LOOPS))
def serve_with(request: pytest.FixtureRequest) -> Iterator[Callable[..., Served]]:
    """Starts a :class:`Served` with the given timeouts (``HttpServer``'s arguments); each is
    closed, with its clients, when the test ends."""
    started: list[Served] = []

    def start(**timeouts: float) -> Served:
        started.append(Served(LOOPS[request.param], **timeouts))
        return started[-1]

    try:
        yield start
    finally:
        for running in started:
            running.close()


@pytest.fixture
def served(serve_with: Callable[..., Served]) -> Served:
    """A :class:`Served` with the default timeouts, on each loop (``serve_with``'s params)."""
    return serve_with()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """A raw socket: requests are written as given, answers parsed one at a time."""

    def __init__(self, port: int, source: str | None = None) -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=10, source_address=None if source is None else (source, 0)
        )
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self, *, head_only: bool = False) -> Answer:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"connection closed inside an answer: {self.buffer!r}"
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if head_only or status in (100,) else int(headers["content-length"])
        while len(self.buffer) < length:
            assert self._fill(), "connection closed inside a body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Answer(status, headers, body)

    def trickle(self, data: bytes, interval: float = 0.05) -> float:
        """Send ``data`` a byte every ``interval`` until the server writes or closes; the
        seconds that took. Fails if all of ``data`` went without an answer."""
        started = time.monotonic()
        for byte in data:
            self.sock.sendall(bytes([byte]))
            readable, _, _ = select.select([self.sock], [], [], interval)
            if readable:
                return time.monotonic() - started
        raise AssertionError(f"no answer to {len(data)} bytes sent over {interval * len(data)} s")

    def quiet(self, seconds: float) -> bool:
        """True if the server writes nothing (and does not close) for ``seconds``."""
        readable, _, _ = select.select([self.sock], [], [], seconds)
        return not readable

    def closed(self) -> bool:
        """True once the server has closed its side (EOF), with nothing left unread."""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return True
            if not chunk:
                return not self.buffer
            self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


def request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def assert_problem(answer: Answer, status: int, slug: str) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["content-type"] == PROBLEM_CONTENT_TYPE
    document = answer.json()
    assert document["type"] == PROBLEM_TYPE_PREFIX + slug, document
    assert document["status"] == status and document["detail"]


def assert_last_answer_is_problem(
    client: Client, status: int, slug: str, *, retry_after: str | None = None
) -> None:
    """The next answer is the problem ``slug``, marked ``Connection: close`` (and with
    ``Retry-After: retry_after`` when given), and the server closes the connection after it
    with nothing more written."""
    answer = client.answer()
    assert_problem(answer, status, slug)
    assert answer.headers["connection"] == "close"
    if retry_after is not None:
        assert answer.headers.get("retry-after") == retry_after
    assert client.closed()


def assert_serves(client: Client) -> None:
    """The connection still answers a request (or, on a new one, the server still does)."""
    client.send(request("GET", "/ping"))
    assert client.answer().status == 200


def echo_of(body: bytes, n: str | None = None) -> dict[str, Any]:
    return {"length": len(body), "sha256": hashlib.sha256(body).hexdigest(), "n": n}


# A request whose answer waits on /later, then one answered at once: the second's answer must
# not overtake the first's.
WAITING_THEN_READY = b"".join(
    [request("POST", "/later", b"first"), request("POST", "/echo", b"second", {"X-N": "2"})]
)


def assert_waiting_then_ready_answered(client: Client) -> None:
    """The answers to :data:`WAITING_THEN_READY`, in its order (once ``/later`` is released)."""
    first, second = client.answer(), client.answer()
    assert (first.status, first.body) == (202, b"later")
    assert second.json() == echo_of(b"second", "2")


# --- keep-alive and pipelining -------------------------------------------------------------------


def test_keep_alive_serves_many_requests_on_one_connection(served: Served) -> None:
    client = served.client()
    for i in range(50):
        body = f"request {i}".encode()
        client.send(request("POST", "/echo", body, {"X-N": str(i)}))
        answer = client.answer()
        assert answer.status == 200 and "connection" not in answer.headers
        assert answer.json() == echo_of(body, str(i))
        assert answer.headers["content-type"] == "application/json; charset=utf-8"
        assert answer.headers["date"].endswith(" GMT")


def test_pipelined_requests_are_answered_in_their_order(served: Served) -> None:
    client = served.client()
    # One write; the third request, answered at once too, must not overtake the first either.
    client.send(WAITING_THEN_READY + request("GET", "/ping"))
    assert client.quiet(0.5), "an answer was written before the first one"
    served.release(1)
    assert_waiting_then_ready_answered(client)
    assert client.answer().json() == {"pong": True}


def test_a_long_pipeline_is_answered_completely_and_in_order(served: Served) -> None:
    # More than MAX_PIPELINED at once: the server stops reading and resumes as it answers.
    count = MAX_PIPELINED * 6
    client = served.client()
    client.send(b"".join(request("POST", "/echo", b"x" * i, {"X-N": str(i)}) for i in range(count)))
    for i in range(count):
        assert client.answer().json() == echo_of(b"x" * i, str(i))


def test_answers_owed_to_a_client_that_left_are_dropped(served: Served) -> None:
    client = served.client()
    client.send(request("POST", "/later", b"gone"))
    served.wait_pending(1)
    client.close()
    time.sleep(0.1)
    served.release(1)  # answered after the client left: nothing to write to, no error
    assert_serves(served.client())


# --- bodies --------------------------------------------------------------------------------------


def test_a_body_sent_slowly_in_pieces_is_read_whole(served: Served) -> None:
    body = bytes(range(256)) * 40
    client = served.client()
    head = request("POST", "/echo", body)[: -len(body)]
    client.send(head[:10])
    time.sleep(0.05)
    client.send(head[10:])
    for start in range(0, len(body), 1000):
        time.sleep(0.02)
        client.send(body[start : start + 1000])
    assert client.answer().json() == echo_of(body)
    assert_serves(client)  # and the connection is still good


def test_a_chunked_body_is_read_whole(served: Served) -> None:
    body = b"0123456789abcdef" * 300
    chunks = [body[i : i + 777] for i in range(0, len(body), 777)]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    client = served.client()
    client.send(b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n" + wire)
    assert client.answer().json() == echo_of(body)


def test_a_body_longer_than_its_content_length_is_a_malformed_next_request(
    served: Served,
) -> None:
    client = served.client()
    body = b'{"a": 1}'
    client.send(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n\r\n" + body)
    first = client.answer()
    assert first.json() == echo_of(body[:3])  # the request is what Content-Length framed
    assert_last_answer_is_problem(client, 400, "bad-request")  # the rest is not a request


def test_content_length_over_the_bound_is_refused_before_the_body_is_sent(
    served: Served,
) -> None:
    client = served.client()
    # The head only: the 413 must come without the server waiting for the body.
    client.send(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    assert_last_answer_is_problem(client, 413, "body-too-large")
    assert ("POST", "/echo", 413) in served.seen


def test_an_oversized_body_sent_anyway_still_gets_its_413(served: Served) -> None:
    # The client writes everything before it reads: the server drops the body it refused
    # instead of resetting the connection under the client's feet.
    huge = b"x" * (MAX_BODY * 4)
    client = served.client()
    client.send(request("POST", "/echo", huge))
    assert_last_answer_is_problem(client, 413, "body-too-large")


def test_a_chunked_body_over_the_bound_is_refused(served: Served) -> None:
    chunk = b"y" * 8192
    client = served.client()
    client.send(b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(MAX_BODY // len(chunk) + 4):
        client.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    client.send(b"0\r\n\r\n")
    assert_last_answer_is_problem(client, 413, "body-too-large")


def test_a_check_refuses_without_the_body_and_the_connection_goes_on(served: Served) -> None:
    client = served.client()
    client.send(request("POST", "/checked", b"z" * 5000))
    assert_problem(client.answer(), 400, "malformed-idempotency-key")
    client.send(request("POST", "/checked", b"fine", {"X-Ok": "1"}))
    assert client.answer().json() == echo_of(b"fine")


def test_expect_100_continue_gets_the_interim_answer_before_the_body(served: Served) -> None:
    body = b"after the interim answer"
    client = served.client()
    client.send(request("POST", "/echo", body, {"Expect": "100-continue"})[: -len(body)])
    assert client.answer(head_only=True).status == 100
    client.send(body)
    assert client.answer().json() == echo_of(body)
    # Refused by a check: no 100, the final answer, and the body is not waited for.
    client.send(request("POST", "/checked", body, {"Expect": "100-continue"})[: -len(body)])
    refused = client.answer()
    assert_problem(refused, 400, "malformed-idempotency-key")
    assert refused.headers["connection"] == "close"
    other = served.client()
    other.send(request("POST", "/echo", body, {"Expect": "something-else"}))
    assert_problem(other.answer(), 417, "expectation-failed")


# --- malformed and refused -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "wire",
    [
        b"BLAH\r\n\r\n",
        b"GET /ping HTTP/9.9\r\nHost: test\r\n\r\n",
        b"GET /ping HTTP/1.1\r\nHost: test\r\nBad Header\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: x\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
    ],
    ids=["request-line", "version", "header", "length", "both-framings", "chunk", "tls"],
)
def test_a_malformed_request_gets_400_and_the_connection_closed(
    served: Served, wire: bytes
) -> None:
    client = served.client()
    client.send(wire)
    assert_last_answer_is_problem(client, 400, "bad-request")
    assert_serves(served.client())


def test_a_malformed_request_after_a_good_one_leaves_the_good_answer_first(
    served: Served,
) -> None:
    client = served.client()
    client.send(request("POST", "/later", b"ok") + b"NOT HTTP AT ALL\r\n\r\n")
    served.release(1)
    assert client.answer().status == 202
    assert_last_answer_is_problem(client, 400, "bad-request")


def test_http11_without_host_is_refused(served: Served) -> None:
    client = served.client()
    client.send(b"GET /ping HTTP/1.1\r\n\r\n")
    assert_last_answer_is_problem(client, 400, "bad-request")


def test_a_head_over_the_bound_gets_431(served: Served) -> None:
    client = served.client()
    client.send(b"GET /ping HTTP/1.1\r\nHost: test\r\n")
    filler = b"X-Filler: " + b"f" * 1000 + b"\r\n"
    for _ in range(MAX_HEAD_BYTES // len(filler) + 2):
        client.send(filler)
    assert_last_answer_is_problem(client, 431, "request-header-fields-too-large")


def test_routes_unknown_paths_and_methods(served: Served) -> None:
    client = served.client()
    client.send(request("GET", "/nope"))
    assert_problem(client.answer(), 404, "not-found")
    client.send(request("GET", "/echo"))
    not_allowed = client.answer()
    assert_problem(not_allowed, 405, "method-not-allowed")
    assert not_allowed.headers["allow"] == "POST"
    client.send(request("DELETE", "/ping"))
    assert client.answer().headers["allow"] == "GET,HEAD"
    client.send(request("HEAD", "/ping"))
    head = client.answer(head_only=True)
    assert head.status == 200 and head.headers["content-length"] == str(len(b'{"pong": true}'))
    client.send(request("GET", "/ping?with=query"))  # the query is not part of the path
    assert client.answer().json() == {"pong": True}
    client.send(request("GET", "/%70ing"))  # percent-encoded: the same path
    assert client.answer().json() == {"pong": True}


def test_a_failing_handler_answers_500_and_the_connection_goes_on(served: Served) -> None:
    client = served.client()
    client.send(request("POST", "/boom", b"x"))
    assert_problem(client.answer(), 500, "internal")
    assert_serves(client)


def test_a_deferred_answer_may_fail_with_a_problem_or_anything_else(served: Served) -> None:
    client = served.client()
    client.send(request("POST", "/later", b"a") + request("POST", "/later", b"b"))
    served.release(1, malformed_key("refused later"))
    assert_problem(client.answer(), 400, "malformed-idempotency-key")
    served.release(1, RuntimeError("the database is gone"))
    assert_problem(client.answer(), 500, "internal")
    assert_serves(client)  # the connection goes on


def test_connection_close_and_http10_end_the_connection(served: Served) -> None:
    client = served.client()
    client.send(request("GET", "/ping", headers={"Connection": "close"}) + request("GET", "/ping"))
    answer = client.answer()
    assert answer.status == 200 and answer.headers["connection"] == "close"
    assert client.closed(), "the request after Connection: close was served"
    old = served.client()
    old.send(b"GET /ping HTTP/1.0\r\n\r\n")
    assert old.answer().status == 200
    assert old.closed()


def test_an_upgrade_is_ignored_without_a_body_and_refused_with_one(served: Served) -> None:
    upgrade = {"Connection": "Upgrade", "Upgrade": "h2c"}
    client = served.client()
    client.send(request("GET", "/ping", headers=upgrade))
    answer = client.answer()
    assert answer.json() == {"pong": True} and answer.headers["connection"] == "close"
    assert client.closed()
    with_body = served.client()
    with_body.send(request("POST", "/echo", b"body", upgrade))
    assert_last_answer_is_problem(with_body, 400, "bad-request")


def test_after_a_final_answer_input_is_dropped_until_the_linger_ends(served: Served) -> None:
    client = served.client()
    client.send(b"BLAH\r\n\r\n")
    assert_last_answer_is_problem(client, 400, "bad-request")  # half-closed by the server at once
    refused_at = time.monotonic()
    client.send(b"more bytes the server drops" * 100)  # not reset: it still reads
    deadline = refused_at + LINGER_S + 3
    while served.server.connections:
        assert time.monotonic() < deadline, "the lingering connection was never closed"
        time.sleep(0.05)
    assert time.monotonic() - refused_at >= LINGER_S - 0.5


def test_close_answers_what_is_owed_first(served: Served) -> None:
    client = served.client()
    client.send(request("POST", "/later", b"owed"))
    served.wait_pending(1)

    async def close_while_owed() -> None:
        closing = asyncio.ensure_future(served.server.close(timeout=5.0))
        await asyncio.sleep(0.2)
        assert not closing.done(), "closed with an answer owed"
        served.pending.pop().resolve(Response(202, b"late", "text/plain"))
        await closing

    served.call(close_while_owed())
    answer = client.answer()
    assert (answer.status, answer.body) == (202, b"late")


# --- timeouts ------------------------------------------------------------------------------------

TIMEOUT_S = 0.3
SLOW_HEAD = b"GET /ping HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"s" * 200


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(keepalive_timeout_s=TIMEOUT_S, request_timeout_s=30)
    answered, silent, busy = served.client(), served.client(), served.client()
    assert_serves(answered)
    idle_from = time.monotonic()
    # Requests more often than the timeout keep a connection: it counts from the last answer.
    for _ in range(8):
        assert_serves(busy)
        time.sleep(TIMEOUT_S / 2)
    assert answered.closed() and silent.closed()
    assert time.monotonic() - idle_from < TIMEOUT_S * 10
    assert_serves(busy)
    busy_idle_from = time.monotonic()
    assert busy.closed()
    assert time.monotonic() - busy_idle_from >= TIMEOUT_S * 0.8


def test_a_head_sent_byte_by_byte_gets_408_and_the_connection_closed(
    serve_with: Callable[..., Served],
) -> None:
    client = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S).client()
    # Each byte comes well within the timeout: the request as a whole is late.
    took = client.trickle(SLOW_HEAD)
    assert took >= TIMEOUT_S * 0.9
    assert_last_answer_is_problem(client, 408, "request-timeout")


def test_a_body_sent_byte_by_byte_gets_408_and_the_connection_closed(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S)
    client = served.client()
    body = b"b" * 200
    client.send(request("POST", "/echo", body)[: -len(body)])
    took = client.trickle(body)
    assert took < TIMEOUT_S * 10
    assert_last_answer_is_problem(client, 408, "request-timeout")
    assert ("POST", "/echo", 408) in served.seen


def test_answers_owed_before_a_late_request_are_written_first(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S)
    client = served.client()
    client.send(WAITING_THEN_READY + SLOW_HEAD[:20])
    served.wait_pending(1)
    # The third request is late while the first is still being answered: its 408 waits.
    assert client.quiet(TIMEOUT_S * 3)
    served.release(1)
    assert_waiting_then_ready_answered(client)
    assert_last_answer_is_problem(client, 408, "request-timeout")


def test_a_client_that_stops_reading_is_cut_off(serve_with: Callable[..., Served]) -> None:
    served = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, set first
    sock.settimeout(10)
    sock.connect(("127.0.0.1", served.port))
    try:
        asked = MAX_PIPELINED
        sock.sendall(request("GET", "/big") * asked)  # and then read nothing
        deadline = time.monotonic() + 10
        while not served.call(_connection_count(served.server)):  # accepted: it may not be yet
            assert time.monotonic() < deadline, "the server never took the connection"
            time.sleep(0.01)
        while served.call(_connection_count(served.server)):
            assert time.monotonic() < deadline, "the server kept a client that reads nothing"
            time.sleep(0.05)
        received, reset = 0, False
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            reset = True  # the unread answers were dropped, not left to trickle out
        assert reset and received < asked * len(BIG_BODY)  # cut off, not served
    finally:
        sock.close()
    assert_serves(served.client())


async def _connection_count(server: HttpServer) -> int:
    return len(server.connections)


def test_connections_over_the_bound_get_503_and_are_closed(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(max_connections=2)
    held = [served.client(), served.client()]
    for client in held:
        assert_serves(client)
    turned_away = served.client()
    assert_last_answer_is_problem(turned_away, 503, "too-many-connections", retry_after="1")
    assert ("", "", 503) in served.seen  # observed, though no request was read
    for client in held:
        assert_serves(client)  # the connections already held are served on
    held[0].close()
    deadline = time.monotonic() + 10
    while served.call(_connection_count(served.server)) > 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert_serves(served.client())  # a place came free


def test_one_client_cannot_hold_every_connection(serve_with: Callable[..., Served]) -> None:
    """Past its own bound a client address is answered 429 before its request is read, while
    another address is still served; a connection it closes gives its place back."""
    served = serve_with(max_connections=10, max_connections_per_client=2)
    held = [served.client(), served.client()]
    for client in held:
        assert_serves(client)
    greedy = served.client()
    assert_last_answer_is_problem(greedy, 429, "too-many-connections-from-client", retry_after="1")
    assert ("", "", 429) in served.seen
    other = served.client(source="127.0.0.2")  # another client, on the same loopback
    assert_serves(other)
    assert served.call(_clients(served.server)) == {"127.0.0.1": 2, "127.0.0.2": 1}
    held[0].close()
    deadline = time.monotonic() + 10
    while served.call(_clients(served.server)).get("127.0.0.1") != 1:
        assert time.monotonic() < deadline, "a closed connection kept its client's place"
        time.sleep(0.02)
    assert_serves(served.client())  # its place came free
    for client in [*served.clients]:
        client.close()
    while served.call(_clients(served.server)):
        assert time.monotonic() < deadline, "closed connections were still counted"
        time.sleep(0.02)


async def _clients(server: HttpServer) -> dict[str, int]:
    return dict(server.clients)


def test_an_answer_before_any_request_is_observed(serve_with: Callable[..., Served]) -> None:
    served = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S)
    client = served.client()
    client.trickle(SLOW_HEAD)
    assert_last_answer_is_problem(client, 408, "request-timeout")
    assert ("", "", 408) in served.seen


def test_a_slow_handler_is_cut_by_neither_timeout(serve_with: Callable[..., Served]) -> None:
    served = serve_with(keepalive_timeout_s=TIMEOUT_S, request_timeout_s=TIMEOUT_S)
    client = served.client()
    client.send(request("POST", "/later", b"slow") + request("GET", "/ping"))
    served.wait_pending(1)
    assert client.quiet(TIMEOUT_S * 4)  # the handler outlasts both timeouts
    served.release(1)
    answer = client.answer()
    assert (answer.status, answer.body) == (202, b"later")
    assert "connection" not in answer.headers
    assert client.answer().json() == {"pong": True}
    assert_serves(client)  # and the connection goes on


# The timer checks at least every TIMEOUT_S (the keep-alive timeout, the smaller one here), so
# each pause of the clients below, longer than that and shorter than the request timeout, meets
# a check.
HELD_REQUEST_TIMEOUT_S = 0.8
HELD_BODY = b"the rest came once the server read on"


def test_a_request_held_back_by_a_full_pipeline_is_not_timed(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(keepalive_timeout_s=TIMEOUT_S, request_timeout_s=HELD_REQUEST_TIMEOUT_S)
    full = served.client()
    # MAX_PIPELINED requests owed: the server stops reading, so the last body's rest waits
    # on the server's answers, not on the client; its clock restarts when reading does.
    waiting = MAX_PIPELINED - 1
    full.send(
        b"".join(request("POST", "/later", b"%d" % i) for i in range(waiting))
        + request("POST", "/echo", HELD_BODY)[:-10]
    )
    served.wait_pending(waiting)
    time.sleep(HELD_REQUEST_TIMEOUT_S * 1.5)
    served.release(waiting)
    for _ in range(waiting):
        assert full.answer().status == 202
    time.sleep(TIMEOUT_S * 1.5)
    full.send(HELD_BODY[-10:])
    assert full.answer().json() == echo_of(HELD_BODY)


def test_a_body_behind_an_owed_answer_is_timed_from_its_100_continue(
    serve_with: Callable[..., Served],
) -> None:
    served = serve_with(keepalive_timeout_s=TIMEOUT_S, request_timeout_s=HELD_REQUEST_TIMEOUT_S)
    expecting = served.client()
    # The client waits for the 100, which waits for the answer owed before it.
    expecting.send(
        request("POST", "/later", b"first")
        + request("POST", "/echo", HELD_BODY, {"Expect": "100-continue"})[: -len(HELD_BODY)]
    )
    served.wait_pending(1)
    assert expecting.quiet(HELD_REQUEST_TIMEOUT_S * 1.5)
    served.release(1)
    assert expecting.answer().status == 202
    assert expecting.answer(head_only=True).status == 100
    time.sleep(TIMEOUT_S * 1.5)
    expecting.send(HELD_BODY)
    assert expecting.answer().json() == echo_of(HELD_BODY)


def test_a_body_still_coming_after_its_early_answer_is_cut_without_another(
    serve_with: Callable[..., Served],
) -> None:
    client = serve_with(keepalive_timeout_s=30, request_timeout_s=TIMEOUT_S).client()
    body = b"c" * 200
    client.send(request("POST", "/checked", body)[: -len(body)])
    assert_problem(client.answer(), 400, "malformed-idempotency-key")  # from the head
    client.trickle(body)
    assert client.closed(), "a second answer to the refused request"


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeouts must be positive"):
        HttpServer({}, max_body=MAX_BODY, keepalive_timeout_s=0.0)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        HttpServer({}, max_body=MAX_BODY, request_timeout_s=-1.0)
    with pytest.raises(ValueError, match="max_connections"):
        HttpServer({}, max_body=MAX_BODY, max_connections=0)
    with pytest.raises(ValueError, match="max_connections_per_client"):
        HttpServer({}, max_body=MAX_BODY, max_connections_per_client=0)
