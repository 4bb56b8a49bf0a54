"""The reference consumer against real HTTP on 127.0.0.1, real PostgreSQL and real Kafka (the
``isolated`` fixture's topics and database): every answer of POST /events, a flood of malformed
requests that changes nothing, concurrent duplicates applied once (in one receiver and across
two), a wiped inbox that still refuses every earlier key from the key store, and the queue
consumer's deduplication."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import http.server
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumers.contract import MAX_BODY_BYTES, PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_PREFIX, Event
from consumers.keystore import decode_entry, partition_of, record_key
from consumers.queue import EVERY_TENANT, QueueConsumer, drain
from consumers.receiver import Receiver, serve
from consumers.runtime import ConsumerRuntime, migrate_database
from consumers.signatures import SignatureVerifier
from ledger.dead_letters import DLQ_INLINE_LIMIT, by_reference, dead_letter_headers
from ledger.domain.ids import canonical_json, content_ref
from ledger.kafka import connection_config
from ledger.log import end_offsets
from ledger.records import Coordinates, DeadLetter
from ledger.result_fetch import result_url
from ledger.settings import Settings
from ledger.topics import ensure_topics
from tests.consumer_support import DESTINATION, SECRET, event_body, new_op_id, signed_headers
from tests.support import assert_no_identifying_labels, env_for, read_all
from tests.tcp_proxy import TcpProxy

# --- a receiver in a thread of the test process --------------------------------------------------


class RunningReceiver:
    """``consumers.receiver.serve`` on a free port, in its own thread and event loop."""

    def __init__(self, settings: Settings, **runtime_options: Any) -> None:
        self.runtime = ConsumerRuntime(settings, **runtime_options)
        self.port = 0
        self._listening = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._listening.wait(30), f"receiver did not listen: {self._failure!r}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_ready()

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def listening(port: int) -> None:
                self.port = port
                self._listening.set()

            verifier = SignatureVerifier([SECRET])
            await serve(
                self.runtime, verifier, "127.0.0.1", 0, stop=self._stop, on_listening=listening
            )

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._failure = exc
            self._listening.set()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.runtime.ready:
            assert self._failure is None, repr(self._failure)
            assert time.monotonic() < deadline, "receiver did not become ready"
            time.sleep(0.05)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert assert_no_identifying_labels(text) > 0
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return found

    def metric(self, name: str, **labels: str) -> float:
        want = {"consumer": self.runtime.name, **labels}
        return sum(
            value
            for (sample, sample_labels), value in self.metrics().items()
            if sample == name and want.items() <= dict(sample_labels).items()
        )


@pytest.fixture
def consumer_settings(isolated: Settings) -> Settings:
    # Tests use the isolated database for the consumer's own tables too.
    return isolated.with_(consumer_pg_dsn=isolated.dsn, consumer_secrets=SECRET)


@pytest.fixture
def receiver(consumer_settings: Settings) -> Iterator[RunningReceiver]:
    running = RunningReceiver(consumer_settings)
    try:
        yield running
    finally:
        running.stop()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    url: str, body: bytes, headers: dict[str, str], path: str = "/events", method: str = "POST"
) -> Answer:
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return Answer(response.status, dict(response.getheaders()), response.read())
    finally:
        conn.close()


def send(url: str, op_id: str, body: bytes | None = None, **options: Any) -> Answer:
    body = event_body(op_id) if body is None else body
    return post(url, body, signed_headers(op_id, body, **options))


def assert_problem(answer: Answer, status: int, slug: str) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["Content-Type"].startswith(PROBLEM_CONTENT_TYPE)
    document = answer.json()
    assert set(document) == {"type", "title", "status", "detail"}
    assert document["status"] == status
    assert document["type"] == PROBLEM_TYPE_PREFIX + slug, document


def counts(settings: Settings, consumer: str = "reference") -> tuple[int, int]:
    """(inbox rows, applied changes) of ``consumer``."""
    with psycopg.connect(settings.consumer_dsn) as conn:
        inbox = conn.execute(
            "SELECT count(*) FROM consumer_inbox WHERE consumer = %s", (consumer,)
        ).fetchone()
        changes = conn.execute(
            "SELECT count(*) FROM consumer_applied_changes WHERE consumer = %s", (consumer,)
        ).fetchone()
    assert inbox is not None and changes is not None
    return int(inbox[0]), int(changes[0])


def changes_per_operation(settings: Settings) -> Counter[str]:
    with psycopg.connect(settings.consumer_dsn) as conn:
        rows = conn.execute("SELECT operation_id FROM consumer_applied_changes").fetchall()
    return Counter(row[0] for row in rows)


def wait_published(settings: Settings, expected: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(settings.consumer_dsn) as conn:
            row = conn.execute("SELECT count(*) FROM consumer_inbox WHERE published").fetchone()
        if row is not None and row[0] >= expected:
            return
        assert time.monotonic() < deadline, f"only {row} of {expected} keys published"
        time.sleep(0.1)


# --- every answer --------------------------------------------------------------------------------


def test_every_answer_of_post_events(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    url = receiver.url
    op = new_op_id()
    body = event_body(op)

    first = send(url, op, body)
    assert first.status == 202 and first.json() == {"operation_id": op, "delivery": "accepted"}
    assert "Idempotent-Replayed" not in first.headers
    again = send(url, op, body, quoted=False)  # the bare key form, a fresh signature
    assert again.status == 202 and again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert_problem(send(url, op, event_body(op, tenant="other")), 422, "key-reused")
    assert counts(consumer_settings) == (1, 1)

    fresh = new_op_id()
    good = event_body(fresh)
    headers = signed_headers(fresh, good)

    def without(*names: str) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k not in names}

    assert_problem(post(url, good, without("Idempotency-Key")), 400, "missing-idempotency-key")
    assert_problem(
        post(url, good, {**headers, "Idempotency-Key": fresh.lower()}),
        400,
        "malformed-idempotency-key",
    )
    assert_problem(post(url, good, without("webhook-signature")), 401, "missing-signature")
    assert_problem(post(url, good + b" ", headers), 401, "bad-signature")
    stale = signed_headers(fresh, good, timestamp=int(time.time()) - 301)
    assert_problem(post(url, good, stale), 401, "stale-signature")
    assert_problem(
        post(url, good, {**headers, "Content-Type": "text/plain"}), 415, "unsupported-media-type"
    )
    assert_problem(
        post(url, good, {**headers, "Content-Type": "application/json; charset=latin-1"}),
        415,
        "unsupported-media-type",
    )
    assert_problem(post(url, good, without("Content-Type")), 415, "unsupported-media-type")
    huge = b"{" + b" " * MAX_BODY_BYTES + b"}"
    assert_problem(post(url, huge, signed_headers(fresh, huge)), 413, "body-too-large")
    bad_json = b'{"operation_id": '
    assert_problem(post(url, bad_json, signed_headers(fresh, bad_json)), 400, "malformed-body")
    other = event_body(new_op_id())
    assert_problem(post(url, other, signed_headers(fresh, other)), 422, "key-mismatch")
    wrong_destination = signed_headers(fresh, good, destination="webhook:other")
    assert_problem(post(url, good, wrong_destination), 422, "key-mismatch")
    invalid = event_body(fresh, tenant="has space")
    assert_problem(post(url, invalid, signed_headers(fresh, invalid)), 422, "invalid-event")
    assert post(url, b"", {}, path="/nope").status == 404
    not_allowed = post(url, b"", {}, method="GET")
    assert_problem(not_allowed, 405, "method-not-allowed")
    assert not_allowed.headers["Allow"] == "POST"
    assert counts(consumer_settings) == (1, 1), "no refused request changed anything"

    assert send(url, fresh, good).status == 202  # everything above left the key unused
    assert counts(consumer_settings) == (2, 2)

    assert (
        receiver.metric("opledger_consumer_responses_total", status="202", reason="accepted") == 2
    )
    assert (
        receiver.metric("opledger_consumer_responses_total", status="202", reason="duplicate") == 1
    )
    assert receiver.metric("opledger_consumer_responses_total", status="401") == 3
    assert receiver.metric("opledger_consumer_accepted_total", via="http") == 2
    assert receiver.metric("opledger_consumer_duplicate_keys_total", seen_in="view") == 1
    assert receiver.metric("opledger_consumer_key_conflicts_total") == 1
    assert receiver.metric("opledger_consumer_changes_total", outcome="applied") == 2
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
        assert json.loads(response.read())["ready"] is True


def test_nothing_of_a_body_or_the_secret_reaches_the_log(
    consumer_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    marker = "MARKER-c0ffee"
    caplog.set_level(logging.DEBUG, logger="opledger")
    running = RunningReceiver(consumer_settings)
    try:
        op = new_op_id()
        body = event_body(op, tenant=f"t-{marker}", result=marker.encode())
        assert send(running.url, op, body).status == 202
        assert send(running.url, op, body).status == 202  # a duplicate
        assert send(running.url, op, event_body(op, tenant=marker)).status == 422
        assert post(running.url, body + b" ", signed_headers(op, body)).status == 401
        bad = event_body(op, tenant=f"{marker} with space")
        assert post(running.url, bad, signed_headers(op, bad)).status == 422
    finally:
        running.stop()
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert op in text, "the per-request lines were not captured at DEBUG"
    assert marker not in text
    assert SECRET not in text and SECRET.removeprefix("whsec_") not in text


def test_a_body_without_content_length_is_bounded_too(receiver: RunningReceiver) -> None:
    op = new_op_id()
    huge = event_body(op) + b" " * MAX_BODY_BYTES
    host, port = "127.0.0.1", receiver.port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.putrequest("POST", "/events")
        for name, value in signed_headers(op, huge).items():
            conn.putheader(name, value)
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for start in range(0, len(huge), 65536):
            chunk = huge[start : start + 65536]
            conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        answer = Answer(response.status, dict(response.getheaders()), response.read())
    finally:
        conn.close()
    assert_problem(answer, 413, "body-too-large")


def test_a_receiver_still_restoring_answers_503(consumer_settings: Settings) -> None:
    runtime = ConsumerRuntime(consumer_settings)  # not started: nothing restored yet

    async def scenario() -> tuple[int, dict[str, Any], int, str]:
        receiver = Receiver(runtime, SignatureVerifier([SECRET]))
        port = await receiver.start("127.0.0.1", 0)
        op = new_op_id()
        body = event_body(op)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    f"http://127.0.0.1:{port}/events", data=body, headers=signed_headers(op, body)
                ) as response:
                    document = await response.json(content_type=None)
                    retry_after = response.headers.get("Retry-After", "")
                    status = response.status
                async with session.get(f"http://127.0.0.1:{port}/healthz") as health:
                    return status, document, health.status, retry_after
        finally:
            await receiver.stop()

    try:
        status, document, health, retry_after = asyncio.run(scenario())
    finally:
        runtime.close()
    assert (status, document["type"], health, retry_after) == (
        503,
        PROBLEM_TYPE_PREFIX + "not-ready",
        503,
        "1",
    )


# --- HTTP/1.1 on one connection -----------------------------------------------------------------


class RawConnection:
    """A socket to the receiver: requests written as given, answers read in order."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> Answer:
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before an answer: {self.buffer!r}"
            self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        length = int(headers["Content-Length"])
        while len(self.buffer) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed inside an answer"
            self.buffer += chunk
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Answer(int(lines[0].split(" ")[1]), headers, body)

    def closed_by_server(self) -> bool:
        return self.sock.recv(65536) == b"" and not self.buffer

    def close(self) -> None:
        self.sock.close()


def raw_post(body: bytes, headers: dict[str, str], length: int | None = None) -> bytes:
    lines = ["POST /events HTTP/1.1", "Host: receiver"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_pipelined_deliveries_are_answered_in_order(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    ops = [new_op_id() for _ in range(4)]
    bodies = {op: event_body(op) for op in ops}
    wire = [raw_post(bodies[op], signed_headers(op, bodies[op])) for op in ops[:3]]
    forged = bodies[ops[3]] + b" "  # the signature covers other bytes
    wire.append(raw_post(forged, signed_headers(ops[3], bodies[ops[3]])))
    wire.append(raw_post(bodies[ops[3]], signed_headers(ops[3], bodies[ops[3]])))
    connection = RawConnection(receiver.port)
    try:
        connection.send(b"".join(wire))  # one write: five requests before any answer
        answers = [connection.answer() for _ in wire]
        assert [a.status for a in answers] == [202, 202, 202, 401, 202]
        assert [a.json()["operation_id"] for a in answers if a.status == 202] == [
            ops[0],
            ops[1],
            ops[2],
            ops[3],
        ]
        # Again on the same connection: a resend and a reused key, in their order too.
        other = event_body(ops[1], tenant="other")
        connection.send(
            raw_post(bodies[ops[0]], signed_headers(ops[0], bodies[ops[0]]))
            + raw_post(other, signed_headers(ops[1], other))
        )
        replayed, reused = connection.answer(), connection.answer()
        assert (replayed.status, replayed.headers.get("Idempotent-Replayed")) == (202, "true")
        assert_problem(reused, 422, "key-reused")
    finally:
        connection.close()
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))


def test_a_delivery_sent_slowly_in_pieces_is_accepted(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    op = new_op_id()
    body = event_body(op)
    wire = raw_post(body, signed_headers(op, body))
    connection = RawConnection(receiver.port)
    try:
        for start in range(0, len(wire), 97):  # the head split too, not only the body
            connection.send(wire[start : start + 97])
            time.sleep(0.02)
        answer = connection.answer()
        assert answer.status == 202 and answer.json()["operation_id"] == op
        second = new_op_id()
        connection.send(raw_post(event_body(second), signed_headers(second, event_body(second))))
        assert connection.answer().status == 202  # the connection is kept
    finally:
        connection.close()
    assert changes_per_operation(consumer_settings) == Counter({op: 1, second: 1})


def test_the_receivers_timeouts_are_its_settings(consumer_settings: Settings) -> None:
    running = RunningReceiver(
        consumer_settings.with_(consumer_keepalive_timeout_s=1, consumer_request_timeout_s=1)
    )
    idle, late = RawConnection(running.port), RawConnection(running.port)
    try:
        op = new_op_id()
        body = event_body(op)
        wire = raw_post(body, signed_headers(op, body))
        idle.send(wire)
        assert idle.answer().status == 202
        started = time.monotonic()
        late.send(wire[:-5])  # its last bytes never come
        assert_problem(late.answer(), 408, "request-timeout")
        assert late.closed_by_server()
        assert idle.closed_by_server()
        assert time.monotonic() - started < 10  # not the defaults (30 s, 75 s)
        assert running.metric("opledger_consumer_responses_total", status="408") == 1
    finally:
        idle.close()
        late.close()
        running.stop()
    assert changes_per_operation(consumer_settings) == Counter({op: 1})


def test_a_body_longer_than_its_content_length_is_refused_and_changes_nothing(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    op = new_op_id()
    body = event_body(op)
    connection = RawConnection(receiver.port)
    try:
        # Content-Length frames fewer bytes than follow: the request is those bytes (not what
        # was signed: 401), and the rest is no request at all (400, connection closed).
        connection.send(raw_post(body, signed_headers(op, body), length=len(body) - 10))
        assert_problem(connection.answer(), 401, "bad-signature")
        assert_problem(connection.answer(), 400, "bad-request")
        assert connection.closed_by_server()
    finally:
        connection.close()
    malformed = RawConnection(receiver.port)
    try:
        malformed.send(b"POST /events HTTP/1.1 trailing garbage\r\n\r\n")
        bad_line = malformed.answer()
        assert_problem(bad_line, 400, "bad-request")
        assert bad_line.headers["Connection"] == "close" and malformed.closed_by_server()
    finally:
        malformed.close()
    assert counts(consumer_settings) == (0, 0)
    assert send(receiver.url, op, body).status == 202  # the receiver is unharmed, the key unused


# --- malformed input changes nothing -------------------------------------------------------------


def _malformed(rng: random.Random, kind: str) -> tuple[bytes, dict[str, str], set[int]]:
    op = new_op_id()
    good = event_body(op)
    if kind == "bad_json":
        body = good[: rng.randrange(1, len(good) - 1)]
        return body, signed_headers(op, body), {400}
    if kind == "no_key":
        headers = signed_headers(op, good)
        del headers["Idempotency-Key"]
        return good, headers, {400}
    if kind == "malformed_key":
        key = rng.choice([op.lower(), op[:-1], f'"{op}', "op_" + "x" * 26, f"{op};a=1", "42"])
        return good, {**signed_headers(op, good), "Idempotency-Key": key}, {400}
    if kind == "wrong_signature":
        headers = signed_headers(op, good)
        mutated = bytearray(good)
        mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(7)
        return bytes(mutated), headers, {400, 401}  # a flipped bit may break UTF-8 first
    if kind == "stale":
        when = int(time.time()) + rng.choice([-1, 1]) * rng.randrange(301, 10**6)
        return good, signed_headers(op, good, timestamp=when), {401}
    if kind == "huge":
        body = good + b" " * (MAX_BODY_BYTES + rng.randrange(1, 1000))
        return body, signed_headers(op, body), {413}
    if kind == "content_type":
        value = rng.choice(["text/plain", "application/xml", "application/x-www-form-urlencoded"])
        return good, {**signed_headers(op, good), "Content-Type": value}, {415}
    if kind == "random_bytes":
        body = rng.randbytes(rng.randrange(0, 2000))
        return body, signed_headers(op, good), {400, 401}
    if kind == "random_bytes_signed":
        body = rng.randbytes(rng.randrange(1, 2000))
        headers = signed_headers(op, good)
        return body, {**headers, "webhook-signature": "v1,AAAA"}, {400, 401}
    if kind == "invalid_event":
        data = json.loads(good)
        data[rng.choice(list(data))] = rng.choice([None, 7, "", "has space", ["x"]])
        body = json.dumps(data).encode()
        return body, signed_headers(op, body), {422}
    if kind == "other_operation":
        body = event_body(new_op_id())
        return body, signed_headers(op, body), {422}
    raise AssertionError(kind)


KINDS = (
    "bad_json",
    "no_key",
    "malformed_key",
    "wrong_signature",
    "stale",
    "content_type",
    "random_bytes",
    "random_bytes_signed",
    "invalid_event",
    "other_operation",
)


def test_a_thousand_malformed_requests_get_a_clear_4xx_and_change_nothing(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    accepted = send(receiver.url, new_op_id())  # something to be left unchanged
    assert accepted.status == 202
    before = counts(consumer_settings)
    rng = random.Random(20260107)
    requests = [_malformed(rng, KINDS[i % len(KINDS)]) for i in range(1100)]
    requests += [_malformed(rng, "huge") for _ in range(20)]

    async def flood() -> list[tuple[int, str, bytes]]:
        limit = asyncio.Semaphore(8)
        async with aiohttp.ClientSession() as session:

            async def one(body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
                async with (
                    limit,
                    session.post(f"{receiver.url}/events", data=body, headers=headers) as response,
                ):
                    return response.status, response.content_type, await response.read()

            return await asyncio.gather(*(one(b, h) for b, h, _ in requests))

    answers = asyncio.run(flood())
    for (status, content_type, document), (_body, _headers, expected) in zip(
        answers, requests, strict=True
    ):
        assert status in expected, (status, document[:200], expected)
        assert content_type == PROBLEM_CONTENT_TYPE
        problem = json.loads(document)
        assert problem["status"] == status and problem["detail"]
    assert counts(consumer_settings) == before
    assert receiver.metric("opledger_consumer_accepted_total") == 1
    # Labels stay a small fixed vocabulary: never an operation id, a header or a body.
    reasons = {
        dict(labels)["reason"]
        for (name, labels) in receiver.metrics()
        if name == "opledger_consumer_responses_total"
    }
    assert reasons <= {
        "accepted",
        "missing-idempotency-key",
        "malformed-idempotency-key",
        "bad-signature",
        "stale-signature",
        "unsupported-media-type",
        "body-too-large",
        "malformed-body",
        "invalid-event",
        "key-mismatch",
    }, reasons
    refused = sum(
        value
        for (name, labels), value in receiver.metrics().items()
        if name == "opledger_consumer_responses_total" and dict(labels)["status"].startswith("4")
    )
    assert refused == len(requests)


# --- concurrency ---------------------------------------------------------------------------------


async def _concurrent(urls: Sequence[str], op: str, copies: int) -> list[tuple[int, bool]]:
    body = event_body(op)
    headers = signed_headers(op, body)
    start = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(url: str) -> tuple[int, bool]:
            await start.wait()
            async with session.post(f"{url}/events", data=body, headers=headers) as response:
                await response.read()
                return response.status, "Idempotent-Replayed" in response.headers

        tasks = [asyncio.ensure_future(one(urls[i % len(urls)])) for i in range(copies)]
        await asyncio.sleep(0.05)
        start.set()
        return await asyncio.gather(*tasks)


def _check_once(answers: list[tuple[int, bool]]) -> None:
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) <= {202, 409}, statuses
    first_receipts = [a for a in answers if a == (202, False)]
    assert len(first_receipts) == 1, answers


def test_sixteen_concurrent_copies_apply_the_change_once(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    ops = [new_op_id() for _ in range(10)]
    seen: Counter[int] = Counter()
    for op in ops:
        answers = asyncio.run(_concurrent([receiver.url], op, 16))
        _check_once(answers)
        seen.update(status for status, _ in answers)
        late = send(receiver.url, op)  # once the first copy committed: a replayed 202
        assert (late.status, late.headers.get("Idempotent-Replayed")) == (202, "true")
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))
    assert counts(consumer_settings) == (len(ops), len(ops))
    assert receiver.metric("opledger_consumer_accepted_total") == len(ops), seen


def test_two_receivers_on_one_inbox_apply_the_change_once(consumer_settings: Settings) -> None:
    # Across processes only the primary key can stop the copy: no in-process set is shared.
    first, second = RunningReceiver(consumer_settings), RunningReceiver(consumer_settings)
    try:
        ops = [new_op_id() for _ in range(10)]
        for op in ops:
            _check_once(asyncio.run(_concurrent([first.url, second.url], op, 16)))
        assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))
        inbox_duplicates = sum(
            r.metric("opledger_consumer_duplicate_keys_total", seen_in="inbox")
            for r in (first, second)
        )
        assert inbox_duplicates > 0, "no copy ever reached the primary key"
    finally:
        first.stop()
        second.stop()


def test_a_key_still_in_progress_is_409(consumer_settings: Settings) -> None:
    async def slow_change(
        conn: psycopg.AsyncConnection[Any], consumer: str, events: Sequence[Event]
    ) -> list[str]:
        # The general form of a change (a coroutine in the inbox transaction), made slow.
        await conn.execute("SELECT pg_sleep(1.0)")
        for event in events:
            await conn.execute(
                "INSERT INTO consumer_applied_changes (consumer, operation_id, tenant_id, "
                "tool_name, destination, result_ref, content_type, result_bytes) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    consumer,
                    event.operation_id,
                    event.body.tenant_id,
                    event.body.tool_name,
                    event.body.destination,
                    event.body.result_ref,
                    event.body.content_type,
                    len(event.result),
                ),
            )
        return ["applied"] * len(events)

    running = RunningReceiver(consumer_settings, change=slow_change)
    try:
        op = new_op_id()

        async def two() -> list[tuple[int, bool]]:
            body = event_body(op)
            headers = signed_headers(op, body)
            async with aiohttp.ClientSession() as session:

                async def one(delay: float) -> tuple[int, bool]:
                    await asyncio.sleep(delay)
                    async with session.post(
                        f"{running.url}/events", data=body, headers=headers
                    ) as response:
                        return response.status, response.headers.get("Retry-After") == "1"

                return list(await asyncio.gather(one(0), one(0.3)))

        assert asyncio.run(two()) == [(202, False), (409, True)]
        assert send(running.url, op).headers.get("Idempotent-Replayed") == "true"
        assert changes_per_operation(consumer_settings) == Counter({op: 1})
    finally:
        running.stop()


# --- the key store -------------------------------------------------------------------------------


def test_accepted_keys_reach_the_key_store_on_their_partition(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    ops = [new_op_id() for _ in range(30)]
    bodies = {op: event_body(op) for op in ops}
    for op in ops:
        assert send(receiver.url, op, bodies[op]).status == 202
    wait_published(consumer_settings, len(ops))
    records = read_all(consumer_settings, consumer_settings.consumer_keys_topic)
    found = {}
    for partition, _offset, key, value in records:
        assert key is not None and value is not None
        entry = decode_entry(key, value)
        assert key == record_key("reference", entry.operation_id)
        assert partition == partition_of(entry.operation_id, consumer_settings.partitions)
        found[entry.operation_id] = entry
    assert set(found) == set(ops)
    for op, entry in found.items():
        assert entry.consumer == "reference"
        assert entry.fingerprint == hashlib.sha256(bodies[op]).digest()
        assert entry.outcome == "applied"
    assert receiver.metric("opledger_consumer_keystore_publish_lag_seconds_count") >= len(ops)


def test_a_wiped_inbox_still_refuses_every_earlier_key(consumer_settings: Settings) -> None:
    first = RunningReceiver(consumer_settings)
    ops = [new_op_id() for _ in range(40)]
    try:
        for op in ops:
            assert send(first.url, op).status == 202
        wait_published(consumer_settings, len(ops))
    finally:
        first.stop()

    with psycopg.connect(consumer_settings.consumer_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE consumer_inbox, consumer_applied_changes, consumer_held_records")
        conn.execute("DELETE FROM schema_migrations WHERE component = 'consumers'")

    second = RunningReceiver(consumer_settings)  # migrations recreate the tables, empty
    try:
        assert second.runtime.restored is not None and second.runtime.restored.keys == len(ops)
        assert counts(consumer_settings) == (0, 0)
        for op in ops:  # re-sent with fresh signatures, as a delivery worker retries
            answer = send(second.url, op)
            assert answer.status == 202 and answer.headers["Idempotent-Replayed"] == "true"
        assert_problem(send(second.url, ops[0], event_body(ops[0], tenant="x")), 422, "key-reused")
        assert counts(consumer_settings) == (0, 0), "a restored key was applied again"
        assert second.metric("opledger_consumer_duplicate_keys_total", seen_in="view") == len(ops)
        assert second.metric("opledger_consumer_keystore_restored_keys") == len(ops)
        restore = second.metric("opledger_consumer_keystore_restore_seconds")
        assert restore == second.runtime.restored.seconds and restore > 0
        assert send(second.url, new_op_id()).status == 202  # new keys still go through
        assert counts(consumer_settings) == (1, 1)
    finally:
        second.stop()


def test_restore_keeps_only_its_own_consumers_keys(consumer_settings: Settings) -> None:
    crm = RunningReceiver(consumer_settings, name="crm")
    try:
        op = new_op_id()
        assert send(crm.url, op).status == 202
        wait_published(consumer_settings, 1)
    finally:
        crm.stop()
    other = RunningReceiver(consumer_settings, name="billing")
    try:
        assert other.runtime.restored is not None and other.runtime.restored.keys == 0
        assert other.runtime.restored.records == 1
        assert send(other.url, op).status == 202  # the same operation is new to another consumer
        assert "Idempotent-Replayed" not in send(other.url, new_op_id()).headers
    finally:
        other.stop()


def test_a_tombstone_on_the_key_store_takes_the_key_out_of_the_view(
    consumer_settings: Settings,
) -> None:
    first = RunningReceiver(consumer_settings)
    kept, dropped = new_op_id(), new_op_id()
    try:
        assert send(first.url, kept).status == 202
        assert send(first.url, dropped).status == 202
        wait_published(consumer_settings, 2)
    finally:
        first.stop()
    producer = Producer({**connection_config(consumer_settings)})
    producer.produce(
        consumer_settings.consumer_keys_topic,
        None,
        record_key("reference", dropped),
        partition=partition_of(dropped, consumer_settings.partitions),
    )
    assert producer.flush(30) == 0
    runtime = ConsumerRuntime(consumer_settings)
    try:
        report = runtime.start()
        assert (report.records, report.keys) == (3, 1)
        assert kept in runtime.view and dropped not in runtime.view
    finally:
        runtime.close()


def test_a_change_may_refuse_an_event_and_the_refusal_is_kept(
    consumer_settings: Settings,
) -> None:
    async def refuse_acme(
        conn: psycopg.AsyncConnection[Any], consumer: str, events: Sequence[Event]
    ) -> list[str]:
        return ["refused" if e.body.tenant_id == "acme" else "applied" for e in events]

    running = RunningReceiver(consumer_settings, change=refuse_acme)
    try:
        refused, applied = new_op_id(), new_op_id()
        assert send(running.url, refused).status == 202  # receipt, whatever the change did
        assert send(running.url, applied, event_body(applied, tenant="beta")).status == 202
        again = send(running.url, refused)
        assert (again.status, again.headers.get("Idempotent-Replayed")) == (202, "true")
        assert running.metric("opledger_consumer_changes_total", outcome="refused") == 1
        assert running.metric("opledger_consumer_changes_total", outcome="applied") == 1
    finally:
        running.stop()
    with psycopg.connect(consumer_settings.consumer_dsn) as conn:
        rows = conn.execute("SELECT operation_id, outcome FROM consumer_inbox").fetchall()
    outcomes: dict[str, str] = dict(rows)
    assert outcomes == {refused: "refused", applied: "applied"}


def test_the_receiver_says_503_while_its_database_is_away_and_learns_by_itself_it_is_back(
    consumer_settings: Settings,
) -> None:
    """Its database cut (a TCP proxy): a POST gets 503 and so does /healthz, which names the
    database. Restored, /healthz says 200 again with no POST in between (it asks the database
    itself: a receiver taken out of rotation gets no writes to learn from), and the POST is
    then accepted."""
    target = conninfo_to_dict(consumer_settings.consumer_dsn)
    proxy = TcpProxy((str(target.get("host", "127.0.0.1")), int(target.get("port", 5432))))
    settings = consumer_settings.with_(
        consumer_pg_dsn=make_conninfo(
            consumer_settings.consumer_dsn, host="127.0.0.1", port=str(proxy.port)
        )
    )
    running = RunningReceiver(settings)
    op = new_op_id()
    try:
        assert post(running.url, b"", {}, path="/healthz", method="GET").status == 200
        proxy.cut()
        assert_problem(send(running.url, op), 503, "unavailable")
        health = post(running.url, b"", {}, path="/healthz", method="GET")
        assert health.status == 503 and "not answering" in health.json()["database"]
        proxy.restore()
        deadline = time.monotonic() + 30
        while post(running.url, b"", {}, path="/healthz", method="GET").status != 200:
            assert time.monotonic() < deadline, "/healthz never said 200 again"
            time.sleep(0.2)
        assert send(running.url, op).status == 202
    finally:
        running.stop()
        proxy.close()
    assert changes_per_operation(consumer_settings) == Counter({op: 1})


def test_a_locked_inbox_is_503_for_its_sender_not_a_request_held_for_ever(
    consumer_settings: Settings,
) -> None:
    """Another session's lock on the inbox (an analyst's LOCK TABLE in an open transaction)
    held every POST for as long as the lock was held; the sender's own timeout then fired and
    its retries piled up behind the same lock. Now the write gives up after
    OPLEDGER_PG_LOCK_TIMEOUT_MS and the sender hears 503; once the lock is gone, the same
    POST is accepted and applied once (decision 025)."""
    running = RunningReceiver(consumer_settings.with_(pg_lock_timeout_ms=200))
    op = new_op_id()
    try:
        with psycopg.connect(consumer_settings.consumer_dsn) as analyst:
            analyst.execute("LOCK TABLE consumer_inbox IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            assert_problem(send(running.url, op), 503, "unavailable")
            took = time.monotonic() - started
            analyst.rollback()
        assert took < 25, f"held the request {took:.1f}s"
        assert send(running.url, op).status == 202
    finally:
        running.stop()
    assert changes_per_operation(consumer_settings) == Counter({op: 1})


# --- the queue side ------------------------------------------------------------------------------


def _queue_topic(settings: Settings) -> str:
    topic = f"{settings.topic_prefix}.queue.crm"
    admin = AdminClient({**connection_config(settings)})
    for future in admin.create_topics([NewTopic(topic, num_partitions=3)]).values():
        future.result(30)
    deadline = time.monotonic() + 30
    while topic not in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return topic


def _queue_record(op: str, body: bytes, **overrides: Any) -> dict[str, Any]:
    headers = [
        ("Idempotency-Key", f'"{op}"'.encode()),
        ("webhook-id", f"{op}:{DESTINATION}".encode()),
    ]
    record: dict[str, Any] = {"key": op.encode(), "value": body, "headers": headers}
    record.update(overrides)
    return record


def _produce(settings: Settings, topic: str, records: list[dict[str, Any]]) -> None:
    producer = Producer({**connection_config(settings), "enable.idempotence": True})
    for record in records:
        producer.produce(topic, **record)
    assert producer.flush(30) == 0


def test_the_queue_consumer_applies_each_key_once(consumer_settings: Settings) -> None:
    topic = _queue_topic(consumer_settings)
    ops = [new_op_id() for _ in range(30)]
    good = [_queue_record(op, event_body(op)) for op in ops]
    conflicting = _queue_record(ops[0], event_body(ops[0], tenant="other"))
    stray = new_op_id()
    malformed = [
        _queue_record(stray, event_body(stray), headers=[]),  # no Idempotency-Key
        _queue_record(stray, event_body(stray), key=b"op_other"),  # key is not the header
        _queue_record(stray, b"{not json"),
        _queue_record(stray, None),  # type: ignore[arg-type]  # a tombstone-like record
        _queue_record(stray, event_body(new_op_id())),  # the body of another operation
    ]
    _produce(consumer_settings, topic, good + malformed + good + [conflicting])

    runtime = ConsumerRuntime(consumer_settings, name="queue-crm")
    consumer = QueueConsumer(runtime, topic, tenants=EVERY_TENANT)
    try:
        consumer.open()
        assert drain(consumer) == len(good) * 2 + len(malformed) + 1
        consumer.close()
        runtime.publisher.flush()
        records = runtime.metrics.queue_records
        by_outcome = {
            dict(s.labels)["outcome"]: s.value
            for metric in records.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }
    finally:
        runtime.close()
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))
    assert by_outcome["accepted"] == len(ops) and by_outcome["duplicate"] == len(ops)
    assert by_outcome["conflict"] == 1
    assert (
        sum(v for k, v in by_outcome.items() if k not in ("accepted", "duplicate", "conflict")) == 5
    )
    # What was not taken is kept whole on the dead-letter topic, with why.
    letters = _dead_letters_of(consumer_settings, topic)
    assert Counter(letter["kind"] for letter in letters) == {"invalid": 5, "conflict": 1}
    invalid = [(d["key"], d["value"]) for d in letters if d["kind"] == "invalid"]
    assert Counter(invalid) == Counter((record["key"], record["value"]) for record in malformed)

    # Offsets were committed after the inbox: the group has nothing left to read.
    group = f"{consumer_settings.topic_prefix}-consumer-queue-crm"
    reader = Consumer({**connection_config(consumer_settings), "group.id": group})
    try:
        ends = end_offsets(consumer_settings, [topic])
        committed = reader.committed([TopicPartition(topic, p) for (_, p) in ends], timeout=10)
        assert {(tp.topic, tp.partition): tp.offset for tp in committed} == ends
    finally:
        reader.close()

    # A new group reads everything again (a redelivery after a lost offset commit, at worst):
    # a fresh instance restores the keys from the key store and applies nothing.
    wait_published(consumer_settings, len(ops))
    again = ConsumerRuntime(consumer_settings, name="queue-crm")
    replay = QueueConsumer(again, topic, group_id=f"{group}-replay", tenants=EVERY_TENANT)
    try:
        replay.open()
        assert again.restored is not None and again.restored.keys == len(ops)
        drain(replay)
        replay.close()
    finally:
        again.close()
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))


def test_the_queue_consumer_waits_out_a_database_outage_longer_than_its_poll_interval(
    consumer_settings: Settings,
) -> None:
    """Its database cut for longer than ``max.poll.interval.ms`` (set to 10 s here): the consumer
    keeps its group membership (each attempt is short; the batch is read again), nothing is
    recorded while the database is away, and afterwards each record is accepted once, with no
    duplicate from a redelivery, and every offset committed. Holding the batch in one long wait
    would lose the group and crash on the offset commit."""
    topic = _queue_topic(consumer_settings)
    target = conninfo_to_dict(consumer_settings.consumer_dsn)
    proxy = TcpProxy((str(target.get("host", "127.0.0.1")), int(target.get("port", 5432))))
    settings = consumer_settings.with_(
        consumer_pg_dsn=make_conninfo(
            consumer_settings.consumer_dsn, host="127.0.0.1", port=str(proxy.port)
        )
    )
    ops = [new_op_id() for _ in range(20)]
    runtime = ConsumerRuntime(settings, name="queue-outage")
    consumer = QueueConsumer(
        runtime, topic, kafka_config={"max.poll.interval.ms": 10_000}, tenants=EVERY_TENANT
    )
    failures: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            while not stop.is_set():
                consumer.run_once()
        except BaseException as exc:  # the test reports it
            failures.append(exc)

    runner = threading.Thread(target=run)
    try:
        consumer.open()
        proxy.cut()
        _produce(consumer_settings, topic, [_queue_record(op, event_body(op)) for op in ops])
        runner.start()
        time.sleep(15)
        assert not failures, failures
        assert changes_per_operation(consumer_settings) == Counter()
        proxy.restore()
        group = f"{consumer_settings.topic_prefix}-consumer-queue-outage"
        ends = end_offsets(consumer_settings, [topic])
        reader = Consumer({**connection_config(consumer_settings), "group.id": group})
        try:
            deadline = time.monotonic() + 60
            while True:
                tps = reader.committed([TopicPartition(topic, p) for (_, p) in ends], timeout=10)
                if {(tp.topic, tp.partition): tp.offset for tp in tps} == ends:
                    break
                assert time.monotonic() < deadline, f"offsets not committed: {tps}"
                assert not failures, failures
                time.sleep(0.3)
        finally:
            reader.close()
        stop.set()
        runner.join(30)
        consumer.close()
        by_outcome = {
            dict(s.labels)["outcome"]: s.value
            for metric in runtime.metrics.queue_records.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(30)
        runtime.close()
        proxy.close()
    assert not failures, failures
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(ops, 1))
    assert by_outcome == {"accepted": len(ops)}


def test_queue_and_http_deliveries_of_one_consumer_share_its_keys(
    consumer_settings: Settings,
) -> None:
    topic = _queue_topic(consumer_settings)
    running = RunningReceiver(consumer_settings)
    op = new_op_id()
    try:
        assert send(running.url, op).status == 202
    finally:
        running.stop()
    _produce(consumer_settings, topic, [_queue_record(op, event_body(op))])
    runtime = ConsumerRuntime(consumer_settings)
    consumer = QueueConsumer(runtime, topic, tenants=EVERY_TENANT)
    try:
        consumer.open()
        drain(consumer)
        consumer.close()
    finally:
        runtime.close()
    assert changes_per_operation(consumer_settings) == Counter({op: 1})


def test_a_result_round_trips_into_the_change(
    receiver: RunningReceiver, consumer_settings: Settings
) -> None:
    op = new_op_id()
    result = bytes(range(256)) * 10
    body = event_body(op, result=result, content_type="application/octet-stream")
    assert send(receiver.url, op, body).status == 202
    with psycopg.connect(consumer_settings.consumer_dsn) as conn:
        row = conn.execute(
            "SELECT tenant_id, destination, content_type, result_bytes, result_ref "
            "FROM consumer_applied_changes WHERE operation_id = %s",
            (op,),
        ).fetchone()
    assert row is not None
    assert row[:4] == ("acme", DESTINATION, "application/octet-stream", len(result))
    assert row[4] == json.loads(body)["result_ref"]
    assert base64.b64decode(json.loads(body)["result_b64"]) == result


class _ResultServer:
    """Serves results at their ``GET /results/<op>`` URL; answers 503 for the blocked ones."""

    def __init__(self, results: dict[str, bytes]) -> None:
        self.results = results
        self.blocked: set[str] = set()
        self.requests: Counter[str] = Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                op = self.path.removeprefix("/results/").split("?", 1)[0]
                server.requests[op] += 1
                result = server.results.get(op)
                status = 503 if op in server.blocked or result is None else 200
                self.send_response(status)
                self.send_header("Content-Length", str(len(result or b"") * (status == 200)))
                self.end_headers()
                if status == 200:
                    self.wfile.write(result or b"")

            def log_message(self, *_args: Any) -> None:
                pass

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _by_reference_body(op: str, result: bytes, base_url: str) -> bytes:
    return canonical_json(
        {
            "operation_id": op,
            "tenant_id": "acme",
            "tool_name": "send_email",
            "destination": DESTINATION,
            "result_ref": content_ref(result),
            "content_type": "application/octet-stream",
            "result_url": result_url(base_url, "acme", DESTINATION, op),
            "result_size": len(result),
        }
    )


def _fetching_consumer(
    settings: Settings, topic: str, group: str, results_url: str, **options: Any
) -> QueueConsumer:
    """A queue consumer of a fresh runtime that fetches results by reference from
    ``results_url``; the caller closes both."""
    runtime = ConsumerRuntime(settings, name="queue-crm")
    return QueueConsumer(
        runtime,
        topic,
        group_id=group,
        fetch_secrets=[SECRET],
        results_url=results_url,
        **{"tenants": EVERY_TENANT, **options},
    )


def _committed(settings: Settings, group: str, topic: str) -> dict[int, int]:
    reader = Consumer({**connection_config(settings), "group.id": group})
    try:
        committed = reader.committed([TopicPartition(topic, p) for p in range(3)], timeout=10)
    finally:
        reader.close()
    return {tp.partition: tp.offset for tp in committed}


def test_a_result_that_cannot_be_fetched_holds_back_only_its_own_partition(
    consumer_settings: Settings,
) -> None:
    topic = _queue_topic(consumer_settings)
    stuck, behind = new_op_id(), [new_op_id() for _ in range(3)]
    elsewhere = {p: [new_op_id() for _ in range(5)] for p in (1, 2)}
    result = os.urandom(4096)
    server = _ResultServer({stuck: result})
    server.blocked.add(stuck)
    records = [
        _queue_record(stuck, _by_reference_body(stuck, result, server.base_url), partition=0)
    ]
    records += [_queue_record(op, event_body(op), partition=0) for op in behind]
    records += [
        _queue_record(op, event_body(op), partition=p) for p, ops in elsewhere.items() for op in ops
    ]
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-held"

    consumer = _fetching_consumer(consumer_settings, topic, group, server.base_url)
    runtime = consumer.runtime
    try:
        consumer.open()
        flowing = [op for ops in elsewhere.values() for op in ops]
        deadline = time.monotonic() + 30
        while set(changes_per_operation(consumer_settings)) != set(flowing):
            assert time.monotonic() < deadline, changes_per_operation(consumer_settings)
            consumer.run_once()
        for _ in range(10):  # ~1 s more, the fetch still failing: retried, nothing else moves
            consumer.run_once(timeout_s=0.1)
        assert server.requests[stuck] >= 2, "the fetch is tried again after a backoff"
        assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(flowing, 1))
        committed = _committed(consumer_settings, group, topic)
        assert (committed[1], committed[2]) == (5, 5), "the other partitions went on"
        assert committed[0] < 0, "nothing of the stuck partition is committed (no offset yet)"

        server.blocked.clear()
        drain(consumer)
        consumer.close()
        by_outcome = {
            dict(s.labels)["outcome"]: s.value
            for metric in runtime.metrics.queue_records.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }
    finally:
        runtime.close()
        server.close()
    everything = [stuck, *behind, *flowing]
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys(everything, 1))
    assert by_outcome == {"accepted": len(everything)}, "the held records were never recorded"
    assert _committed(consumer_settings, group, topic) == {0: 4, 1: 5, 2: 5}
    with psycopg.connect(consumer_settings.consumer_dsn) as conn:
        row = conn.execute(
            "SELECT result_bytes FROM consumer_applied_changes WHERE operation_id = %s", (stuck,)
        ).fetchone()
    assert row == (len(result),)


def test_a_held_partition_moves_through_rebalances_and_is_read_again(
    consumer_settings: Settings,
) -> None:
    """A partition paused while its result cannot be fetched, revoked by one rebalance and
    assigned back by the next, is read again (librdkafka may keep a pause across a rebalance)."""
    topic = _queue_topic(consumer_settings)
    stuck, behind = new_op_id(), [new_op_id() for _ in range(3)]
    result = os.urandom(2048)
    server = _ResultServer({stuck: result})
    server.blocked.add(stuck)
    by_reference = _by_reference_body(stuck, result, server.base_url)
    records = [_queue_record(stuck, by_reference, partition=0)]
    records += [_queue_record(op, event_body(op), partition=0) for op in behind]
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-rebalanced"

    def replica() -> QueueConsumer:
        return _fetching_consumer(consumer_settings, topic, group, server.base_url)

    first, second = replica(), replica()
    try:
        first.open()
        deadline = time.monotonic() + 30
        while server.requests[stuck] < 2:  # held, paused, and tried again
            assert time.monotonic() < deadline, "the fetch was not tried"
            first.run_once(timeout_s=0.1)
        second.open()  # a rebalance: the group's partitions are revoked and assigned again
        deadline = time.monotonic() + 30
        while not second._consumer.assignment():
            assert time.monotonic() < deadline, "the second replica got no partition"
            first.run_once(timeout_s=0.1)
            second.run_once(timeout_s=0.1)
        second.close()  # and another: the first replica is given every partition back
        server.blocked.clear()
        deadline = time.monotonic() + 60
        while _committed(consumer_settings, group, topic).get(0) != 4:
            assert time.monotonic() < deadline, (
                f"partition 0 not read again: {changes_per_operation(consumer_settings)}"
            )
            first.run_once(timeout_s=0.2)
        first.close()
    finally:
        for replica_ in (first, second):
            replica_.close()
            replica_.runtime.close()
        server.close()
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys([stuck, *behind], 1))


def test_a_record_naming_another_host_gets_no_signed_fetch(consumer_settings: Settings) -> None:
    """Queue records are not signed: a reference outside the ledger's results URL is refused
    without a request, so a record's writer cannot collect a signed fetch to replay."""
    topic = _queue_topic(consumer_settings)
    ledger_op, elsewhere_op = new_op_id(), new_op_id()
    result = os.urandom(1024)
    ledger = _ResultServer({ledger_op: result})
    elsewhere = _ResultServer({elsewhere_op: result})
    records = [
        _queue_record(op, _by_reference_body(op, result, server.base_url), partition=0)
        for op, server in ((elsewhere_op, elsewhere), (ledger_op, ledger))
    ]
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-hosts"
    consumer = _fetching_consumer(consumer_settings, topic, group, ledger.base_url)
    runtime = consumer.runtime
    try:
        consumer.open()
        drain(consumer)
        consumer.close()
        refused = runtime.registry.get_sample_value(
            "opledger_consumer_result_fetches_total",
            {"consumer": "queue-crm", "outcome": "refused"},
        )
    finally:
        runtime.close()
        ledger.close()
        elsewhere.close()
    assert elsewhere.requests == Counter(), "no request, so no signature, went elsewhere"
    assert ledger.requests == Counter({ledger_op: 1})
    assert refused == 1
    assert changes_per_operation(consumer_settings) == Counter({ledger_op: 1})
    assert _committed(consumer_settings, group, topic)[0] == 2, "refused and skipped, not held"


def test_one_pass_fetches_results_up_to_its_byte_budget(consumer_settings: Settings) -> None:
    """Every fetched result of a pass is held in memory until its batch is recorded, so a pass
    fetches at most its budget of bytes (at least one result); the rest is read again next."""
    topic = _queue_topic(consumer_settings)
    ops = [new_op_id() for _ in range(6)]
    results = {op: os.urandom(1000) for op in ops}
    server = _ResultServer(results)
    records = [
        _queue_record(op, _by_reference_body(op, results[op], server.base_url), partition=0)
        for op in ops
    ]
    records.append(_queue_record(inline := new_op_id(), event_body(inline), partition=0))
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-budget"
    consumer = _fetching_consumer(
        consumer_settings, topic, group, server.base_url, max_fetched_bytes=2500
    )
    runtime = consumer.runtime
    per_pass: list[int] = []
    try:
        consumer.open()
        deadline = time.monotonic() + 60
        while _committed(consumer_settings, group, topic).get(0) != len(records):
            assert time.monotonic() < deadline, changes_per_operation(consumer_settings)
            before = server.requests.total()
            consumer.run_once(timeout_s=0.2)
            per_pass.append(server.requests.total() - before)
        consumer.close()
    finally:
        runtime.close()
        server.close()
    assert max(per_pass) == 2, f"2 results of 1,000 bytes fit in 2,500, not 3: {per_pass}"
    assert server.requests == Counter(dict.fromkeys(ops, 1)), "each fetched once, none again"
    assert changes_per_operation(consumer_settings) == Counter(dict.fromkeys([*ops, inline], 1))


REDRIVE = [sys.executable, "-m", "opledger.cli", "consumer", "redrive"]


def _redrive(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``opledger consumer redrive ARGS`` as a process; it must exit 0."""
    done = subprocess.run(
        [*REDRIVE, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def _dead_letters_of(settings: Settings, topic: str) -> list[dict[str, Any]]:
    """The consumers' dead letters of records from ``topic``, oldest first per partition."""
    dlq = settings.consumer_dead_letter_topic
    ends = end_offsets(settings, [dlq])
    reader = Consumer(
        {
            **connection_config(settings),
            "group.id": "verifier",
            "enable.auto.commit": False,
        }
    )
    reader.assign([TopicPartition(dlq, p, 0) for (_, p) in ends])
    remaining = sum(ends.values())
    letters: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while remaining > 0:
        assert time.monotonic() < deadline, f"{remaining} dead letters not read back"
        for m in reader.consume(1000, 0.5):
            if m.error():
                continue
            remaining -= 1
            headers = [(k, v) for k, v in m.headers() or []]
            named = dict(headers)
            if named.get("opledger-source-topic") != topic.encode():
                continue
            letters.append(
                {
                    "at": (
                        int(named["opledger-source-partition"]),
                        int(named["opledger-source-offset"]),
                    ),
                    "kind": named["opledger-dlq-kind"].decode(),
                    "reason": named["opledger-dlq-reason"].decode(),
                    "key": m.key(),
                    "value": m.value(),
                    "own_headers": [h for h in headers if not h[0].startswith("opledger-")],
                }
            )
    reader.close()
    return sorted(letters, key=lambda letter: letter["at"])


def _counted(counter: Any, label: str) -> dict[str, float]:
    return {
        dict(s.labels)[label]: s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def test_what_the_queue_consumer_cannot_take_is_dead_lettered_whole_and_redriven_once(
    consumer_settings: Settings,
) -> None:
    """Four records a queue consumer cannot take, each ahead of one it can: a reference the
    ledger never serves (past a 3 s hold limit), a record that is not an event, a reference
    whose bytes are not the result, and a key taken earlier with another body. Each goes whole
    to the dead-letter topic with its kind and reason; every partition goes on and is committed
    to its end. A redrive of the unfetchable one, once its result is served, applies it once;
    a second redrive of everything applies nothing more."""
    topic = _queue_topic(consumer_settings)
    never, wrong_bytes = new_op_id(), new_op_id()
    good = [new_op_id() for _ in range(4)]
    result = os.urandom(2048)
    server = _ResultServer({wrong_bytes: os.urandom(2048)})  # served, but not `result`
    records = [
        _queue_record(never, _by_reference_body(never, result, server.base_url), partition=0),
        _queue_record(good[0], event_body(good[0]), partition=0),
        _queue_record(good[1], b"{not json", partition=1),
        _queue_record(
            wrong_bytes, _by_reference_body(wrong_bytes, result, server.base_url), partition=1
        ),
        _queue_record(good[2], event_body(good[2]), partition=1),
        _queue_record(good[3], event_body(good[3]), partition=2),
        _queue_record(good[3], event_body(good[3], tenant="other"), partition=2),
    ]
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-dlq"
    hold_limit_s = 3.0

    consumer = _fetching_consumer(
        consumer_settings, topic, group, server.base_url, hold_limit_s=hold_limit_s
    )
    runtime = consumer.runtime
    try:
        consumer.open()
        started = time.monotonic()
        deadline = started + 60
        while _committed(consumer_settings, group, topic) != {0: 2, 1: 3, 2: 2}:
            assert time.monotonic() < deadline, _committed(consumer_settings, group, topic)
            consumer.run_once(timeout_s=0.2)
            if time.monotonic() - started < hold_limit_s - 0.5:
                assert good[0] not in changes_per_operation(consumer_settings), (
                    "the record behind the unfetchable one waits until its hold limit"
                )
        assert time.monotonic() - started >= hold_limit_s, "dead-lettered before its hold limit"
        consumer.close()
        dead = _counted(runtime.metrics.dead_letters, "kind")
    finally:
        runtime.close()
    assert dead == {"unfetchable": 1, "invalid": 1, "refused": 1, "conflict": 1}
    assert changes_per_operation(consumer_settings) == Counter({good[0]: 1, good[2]: 1, good[3]: 1})
    letters = _dead_letters_of(consumer_settings, topic)
    assert [(letter["at"], letter["kind"]) for letter in letters] == [
        ((0, 0), "unfetchable"),
        ((1, 0), "invalid"),
        ((1, 1), "refused"),
        ((2, 1), "conflict"),
    ]
    sources = [records[0], records[2], records[3], records[6]]
    for letter, source in zip(letters, sources, strict=True):
        assert (letter["key"], letter["value"]) == (source["key"], source["value"]), "kept whole"
        assert letter["own_headers"] == source["headers"], "its own headers kept"
        assert letter["reason"]
    assert "hold limit" in letters[0]["reason"]

    # Served at last: a redrive of the unfetchable one puts it back on its partition, once.
    server.results[never] = result
    env = env_for(consumer_settings)
    # Both filters must match: the refused letter is at 1:1, not 0:0.
    none = _redrive(env, "--topic", topic, "--kind", "refused", "--at", "0:0")
    assert "0 record(s) put back" in none.stdout
    redriven = _redrive(env, "--topic", topic, "--kind", "unfetchable", "--at", "0:0")
    assert f"redriven {topic}[0]@0" in redriven.stdout
    assert "1 record(s) put back" in redriven.stdout
    # A second redrive of every kind: the unfetchable one again, and the three others.
    again = _redrive(env, "--topic", topic)
    assert "4 record(s) put back" in again.stdout

    consumer = _fetching_consumer(consumer_settings, topic, group, server.base_url)
    runtime = consumer.runtime
    try:
        consumer.open()
        drain(consumer)
        consumer.close()
        outcomes = _counted(runtime.metrics.queue_records, "outcome")
        dead = _counted(runtime.metrics.dead_letters, "kind")
    finally:
        runtime.close()
        server.close()
    assert server.requests[never] >= 1
    assert changes_per_operation(consumer_settings) == Counter(
        {never: 1, good[0]: 1, good[2]: 1, good[3]: 1}
    ), "the redriven record applied once, nothing else applied again"
    assert outcomes["accepted"] == 1 and outcomes["duplicate"] == 1
    assert dead == {"invalid": 1, "refused": 1, "conflict": 1}, "taken out again, not applied"
    assert _committed(consumer_settings, group, topic) == {0: 4, 1: 5, 2: 3}


def test_a_dead_letter_holding_a_reference_is_read_back_checked_and_redriven_once(
    consumer_settings: Settings,
) -> None:
    """Two records too large to republish (about 935 KB, over the dead-letter topic's inline
    limit) go to the dead letters as references: the consumer was scoped to acme only, and they
    are globex's. Then one of them is deleted from its topic by retention. A redrive with the
    scope fixed reads the other back at its coordinates, checks its size and sha256, and puts
    it back, whole: it is applied once, and a second redrive applies nothing more. The deleted
    one is named with why (exit 4), not guessed at, and its letter stays."""
    topic = _queue_topic(consumer_settings)
    big, gone, small = new_op_id(), new_op_id(), new_op_id()
    large_result = os.urandom(700 * 1024)  # ~935 KB of body once in base64
    records = [
        _queue_record(big, event_body(big, tenant="globex", result=large_result), partition=0),
        _queue_record(small, event_body(small), partition=0),
        _queue_record(gone, event_body(gone, tenant="globex", result=large_result), partition=1),
    ]
    assert len(records[0]["value"]) > DLQ_INLINE_LIMIT
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-scoped"

    def consume(tenants: list[str]) -> None:
        runtime = ConsumerRuntime(consumer_settings, name="queue-crm")
        try:
            consumer = QueueConsumer(runtime, topic, group_id=group, tenants=tenants)
            consumer.open()
            drain(consumer)
            consumer.close()
        finally:
            runtime.close()

    consume(["acme"])
    assert changes_per_operation(consumer_settings) == Counter({small: 1})
    letters = _dead_letters_of(consumer_settings, topic)
    assert [(letter["at"], letter["kind"]) for letter in letters] == [
        ((0, 0), "foreign-tenant"),
        ((1, 0), "foreign-tenant"),
    ]
    for letter, source in zip(letters, (records[0], records[2]), strict=True):
        reference = json.loads(letter["value"])
        assert reference["by_reference"] is True
        assert reference["sha256"] == hashlib.sha256(source["value"]).hexdigest()

    admin = AdminClient({**connection_config(consumer_settings)})
    for future in admin.delete_records([TopicPartition(topic, 1, 1)]).values():
        future.result(30)

    env = env_for(consumer_settings)
    done = subprocess.run(
        [*REDRIVE, "--topic", topic, "--kind", "foreign-tenant"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert f"redriven {topic}[0]@0 (read back from its topic" in done.stdout
    assert f"not redriven {topic}[1]@0: no longer on {topic}" in done.stdout
    assert "1 record(s) put back" in done.stdout

    consume(["acme", "globex"])
    assert changes_per_operation(consumer_settings) == Counter({small: 1, big: 1})
    with psycopg.connect(consumer_settings.consumer_dsn) as conn:
        row = conn.execute(
            "SELECT fingerprint FROM consumer_inbox WHERE operation_id = %s", (big,)
        ).fetchone()
    assert row is not None and bytes(row[0]) == hashlib.sha256(records[0]["value"]).digest(), (
        "the record put back is the one dead-lettered, byte for byte"
    )
    again = _redrive(env, "--topic", topic, "--at", "0:0")
    assert "1 record(s) put back" in again.stdout
    consume(["acme", "globex"])
    assert changes_per_operation(consumer_settings) == Counter({small: 1, big: 1})
    assert len(_dead_letters_of(consumer_settings, topic)) == 2, "the deleted one's letter stays"


def test_a_reference_whose_digest_is_not_the_records_is_not_redriven(
    consumer_settings: Settings,
) -> None:
    """A dead letter naming a record by reference, with a sha256 the record at those
    coordinates does not have (written by hand here; a letter of another cluster's topic of the
    same name would be the same): the redrive does not put that record back in its place."""
    topic = _queue_topic(consumer_settings)
    op = new_op_id()
    record = _queue_record(op, event_body(op), partition=2)
    _produce(consumer_settings, topic, [record])
    letter = by_reference(
        DeadLetter(
            Coordinates(topic, 2, 0),
            "invalid: test",
            record["key"],
            b"x" * len(record["value"]),  # the record's size, other bytes: only the digest differs
            0,
        )
    )
    headers = dead_letter_headers(letter, [("opledger-dlq-kind", b"invalid")])
    producer = Producer({**connection_config(consumer_settings)})
    producer.produce(
        consumer_settings.consumer_dead_letter_topic,
        key=letter.key,
        value=letter.value,
        headers=headers,
    )
    assert producer.flush(30) == 0
    done = subprocess.run(
        [*REDRIVE, "--topic", topic, "--at", "2:0"],
        env=env_for(consumer_settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert f"not redriven {topic}[2]@0: the record at its coordinates is not the one" in (
        done.stdout
    )
    assert "0 record(s) put back" in done.stdout
    assert end_offsets(consumer_settings, [topic])[(topic, 2)] == 1, "nothing put back"


def test_the_hold_limit_counts_across_restarts_and_rebalances(consumer_settings: Settings) -> None:
    """A record whose result is never served is dead-lettered once it has waited the hold
    limit, although no consumer instance held it that long: each instance leaves the group
    about 1.5 s after its first failed fetch and a new one takes the partition over. The clock
    is in the consumer's database, not in an instance's memory."""
    topic = _queue_topic(consumer_settings)
    never, behind = new_op_id(), new_op_id()
    server = _ResultServer({})  # never serves it
    records = [
        _queue_record(
            never, _by_reference_body(never, os.urandom(512), server.base_url), partition=0
        ),
        _queue_record(behind, event_body(behind), partition=0),
    ]
    _produce(consumer_settings, topic, records)
    group = f"{consumer_settings.topic_prefix}-consumer-rejoining"
    migrate_database(consumer_settings.consumer_dsn)  # the loop's condition reads its tables
    hold_limit_s = 4.0
    instances = 0
    first_fetch: float | None = None  # the first failed fetch of any instance
    deadline = time.monotonic() + 120
    try:
        while changes_per_operation(consumer_settings).get(behind) != 1:
            assert time.monotonic() < deadline, f"still held after {instances} instances"
            consumer = _fetching_consumer(
                consumer_settings, topic, group, server.base_url, hold_limit_s=hold_limit_s
            )
            instances += 1
            try:
                consumer.open()
                opened = time.monotonic()
                tried = server.requests[never]
                leave_at = time.monotonic() + 30
                while changes_per_operation(consumer_settings).get(behind) != 1:
                    if time.monotonic() >= leave_at:
                        break
                    consumer.run_once(timeout_s=0.2)
                    if server.requests[never] > tried and leave_at > time.monotonic() + 1.5:
                        first_fetch = first_fetch or time.monotonic()
                        leave_at = time.monotonic() + 1.5  # this instance tried: leave soon
                held_by_the_last = time.monotonic() - opened
                consumer.close()
            finally:
                consumer.runtime.close()
    finally:
        server.close()
    # The record waited the limit in all, from the first failed fetch, but the instance that
    # dead-lettered it held it for less: its clock came from the database, not its memory. (How
    # many instances that takes depends on how long each one's group join takes.)
    assert first_fetch is not None
    assert instances >= 2, "one instance held the record to the end"
    assert held_by_the_last < hold_limit_s, held_by_the_last
    assert time.monotonic() - first_fetch >= hold_limit_s - 0.5
    letters = _dead_letters_of(consumer_settings, topic)
    assert [(letter["at"], letter["kind"]) for letter in letters] == [((0, 0), "unfetchable")]
    assert changes_per_operation(consumer_settings) == Counter({behind: 1})
    with psycopg.connect(consumer_settings.consumer_dsn) as conn:
        clocks = conn.execute(
            "SELECT count(*) FROM consumer_held_records WHERE topic = %s", (topic,)
        ).fetchone()
    assert clocks == (0,), "a dead-lettered record's clock is released"


def test_a_dead_letter_topic_that_does_not_answer_holds_the_batch_and_loses_nothing(
    consumer_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """With the dead-letter topic gone (deleted; the broker creates no topic by itself), an
    invalid record is neither passed nor committed: its batch is read again until the topic is
    back, then the record is dead-lettered and everything committed. Its value, which carries a
    marker, never reaches the log; its coordinates do."""
    topic = _queue_topic(consumer_settings)
    dlq = consumer_settings.consumer_dead_letter_topic
    admin = AdminClient({**connection_config(consumer_settings)})
    for future in admin.delete_topics([dlq]).values():
        future.result(30)
    deadline = time.monotonic() + 30
    while dlq in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, "the dead-letter topic was not deleted"
        time.sleep(0.2)
    marker = f"MARKER-{new_op_id()}"
    good = new_op_id()
    poison = _queue_record(good, f"{{not json {marker}".encode(), partition=0)
    _produce(consumer_settings, topic, [poison, _queue_record(good, event_body(good), partition=0)])
    group = f"{consumer_settings.topic_prefix}-consumer-nodlq"
    caplog.set_level(logging.DEBUG, logger="opledger")

    runtime = ConsumerRuntime(consumer_settings, name="queue-crm")
    consumer = QueueConsumer(
        runtime, topic, group_id=group, dead_letter_timeout_s=2.0, tenants=EVERY_TENANT
    )
    try:
        consumer.open()
        until = time.monotonic() + 8
        while time.monotonic() < until:
            consumer.run_once(timeout_s=0.2)
        assert _committed(consumer_settings, group, topic)[0] < 0, "nothing committed past it"
        assert "waits for the dead-letter topic" in caplog.text

        ensure_topics(consumer_settings)  # the topic is back
        deadline = time.monotonic() + 60
        while _committed(consumer_settings, group, topic)[0] != 2:
            assert time.monotonic() < deadline, _committed(consumer_settings, group, topic)
            consumer.run_once(timeout_s=0.2)
        consumer.close()
        dead = _counted(runtime.metrics.dead_letters, "kind")
    finally:
        runtime.close()
    assert dead == {"invalid": 1}, "counted once, when it was dead-lettered"
    letters = _dead_letters_of(consumer_settings, topic)
    assert {(d["at"], d["kind"], d["value"]) for d in letters} == {
        ((0, 0), "invalid", poison["value"])
    }
    assert changes_per_operation(consumer_settings) == Counter({good: 1})
    assert f"{topic}[0]@0 dead-lettered (invalid)" in caplog.text
    assert marker not in caplog.text, "a record's value never reaches the log"
