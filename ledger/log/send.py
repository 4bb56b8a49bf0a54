"""The acknowledged send: records handed to the broker and acknowledged, with one resend policy.

:class:`Transport` is all a writer needs: send these records and return once every one is
acknowledged, or raise. Unit tests of the handle logic give the recorder an in-memory transport;
:class:`KafkaTransport` is the real one.

One producer serves every thread (and the asyncio recorder) of a process. A background thread
serves its delivery reports as they arrive, and each call waits for the reports of its *own*
records only: concurrent callers never wait on each other's acknowledgements, and nobody calls a
global ``flush()``.

:class:`LogWriter` is what every writer of events uses: the records built by
:class:`~ledger.log.records.RecordBuilder`, sent through a transport, and sent again (the very
same records) when the acknowledgement was lost, under one policy (:data:`RESENDS`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from confluent_kafka import KafkaError, KafkaException

from ledger.codec import Codec, default_codec
from ledger.domain.events import LedgerEvent
from ledger.errors import DeliveryError, DeliveryTimeoutError, RecordError, RecordTooLargeError
from ledger.kafka import MESSAGE_MAX_BYTES, producer_config
from ledger.log.clients import producer_from
from ledger.log.records import (
    LogTopics,
    OutgoingRecord,
    Positions,
    RawRecord,
    RecordBuilder,
    fits,
    record_size,
)
from ledger.settings import Settings

log = logging.getLogger(__name__)

#: Default for how long the broker gets to acknowledge a record (librdkafka
#: ``delivery.timeout.ms``) before the call fails; a worker waits at most about this long.
DEFAULT_DELIVERY_TIMEOUT_S = 10.0

# librdkafka reports a timed-out message on its own timer scan (about once a second), so the
# SDK waits a little past the configured timeout before it gives up on the report itself.
_REPORT_GRACE_S = 5.0

_UNREACHABLE = (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE)
_NO_TOPIC = (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART)


class Transport(Protocol):
    """Appends records durably; the recorder depends on nothing else of Kafka."""

    def send(self, records: Sequence[OutgoingRecord]) -> Positions | None:
        """Return once the broker acknowledged every record (where they were written, if the
        transport knows); raise DeliveryError otherwise."""
        ...

    def close(self) -> None:
        """Deliver what is queued and release the client."""
        ...


@runtime_checkable
class SplitTransport(Transport, Protocol):
    """A transport whose send comes apart: hand the records over now, wait for their
    acknowledgements later, so a caller can do other work while they are in flight."""

    #: Whether records handed over now go out at once (see :attr:`KafkaTransport.warm`).
    warm: bool

    def submit(self, records: Sequence[OutgoingRecord]) -> Any:
        """Hand every record to the client; answers what :meth:`wait` takes."""
        ...

    def wait(self, submitted: Any) -> Positions:
        """:meth:`Transport.send`'s wait and checks for records already submitted."""
        ...

    async def wait_async(self, submitted: Any) -> Positions:
        """:meth:`wait` without blocking the event loop."""
        ...


def produce(
    producer: Any,
    record: OutgoingRecord | RawRecord,
    on_delivery: Callable[[KafkaError | None, Any], None],
    deadline: float,
    make_room: Callable[[Any], None],
) -> bool:
    """Hand ``record`` to ``producer`` (the one produce of every writer), waiting for room in
    the client's local queue until ``deadline`` (``time.monotonic()``); False if none came.
    ``make_room`` is how the caller lets the queue drain (its own poll, or a pause while a
    poller thread serves the reports). Raises ``KafkaException`` if the client refuses the
    record itself (too large for it, say)."""
    while True:
        try:
            if record.partition is None:  # the key's partition (murmur2)
                producer.produce(
                    record.topic,
                    record.value,
                    record.key,
                    headers=record.headers,
                    on_delivery=on_delivery,
                )
            else:
                producer.produce(
                    record.topic,
                    record.value,
                    record.key,
                    partition=record.partition,
                    headers=record.headers,
                    on_delivery=on_delivery,
                )
            return True
        except BufferError:
            if time.monotonic() > deadline:
                return False
            make_room(producer)


def _sleep_a_little(_producer: Any) -> None:
    time.sleep(0.005)


def _poll_a_little(producer: Any) -> None:
    producer.poll(0.05)


class _Reports:
    """The delivery reports of one call's records, filled in by the poller thread."""

    __slots__ = (
        "_callbacks",
        "_done",
        "_latch",
        "_lock",
        "errors",
        "expected",
        "positions",
        "received",
    )

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.received = 0
        self.errors: list[tuple[KafkaError, str]] = []
        #: (topic, partition, offset) of every record acknowledged
        self.positions: list[tuple[str, int, int]] = []
        self._done = False
        # A bare lock as a one-shot latch: held until the last report is in. Waiting on it is
        # one acquire; a threading.Event would build a Condition and a waiter lock per wait.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        if expected == 0:  # nothing to wait for
            self._done = True
            self._latch.release()

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        # Usually the poller thread; close() serves reports from its own thread too.
        with self._lock:
            if err is not None:
                self.errors.append((err, msg.topic()))
            else:
                self.positions.append((msg.topic(), msg.partition(), msg.offset()))
            self.received += 1
            if self.received != self.expected:
                return
            self._done = True
            self._latch.release()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def wait(self, timeout: float) -> bool:
        if self._done:
            return True
        if not self._latch.acquire(timeout=timeout):
            return False
        self._latch.release()  # open for good: a later wait returns at once
        return True

    def when_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (in the poller thread) once every report is in, or now if they are."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()


class KafkaTransport:
    """A confluent-kafka producer shared by every caller of a process; each caller waits for the
    acknowledgements of its own records."""

    def __init__(
        self,
        settings: Settings,
        *,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        compression: str = "lz4",
        linger_ms: float = 0.0,
        extra_config: dict[str, Any] | None = None,
        producer_factory: Callable[[dict[str, Any]], Any] = producer_from,
    ) -> None:
        config = producer_config(
            settings,
            client_id="opledger-sdk",
            delivery_timeout_s=delivery_timeout_s,
            linger_ms=linger_ms,
            compression=compression,
        )
        config.update(extra_config or {})
        config["error_cb"] = self._on_client_error
        self._bootstrap = settings.bootstrap_servers
        self._config = config
        self._factory = producer_factory
        self._swap_lock = threading.Lock()
        self._producer = producer_factory(config)
        #: True once this producer had a record acknowledged. A fresh idempotent client
        #: handed a record in its first milliseconds often holds it about half a second
        #: (``bench/bench_first_produce.py``; figures in ``bench/README.md``), so a caller with
        #: other work to do does that first while this is False.
        self.warm = False
        self._wait_s = delivery_timeout_s + _REPORT_GRACE_S
        self._fatal: KafkaError | None = None
        # (monotonic time it was first seen, the error) while no broker answers.
        self._unreachable: tuple[float, KafkaError] | None = None
        self._closing = threading.Event()
        self._poller = threading.Thread(
            target=self._serve_reports, name="opledger-delivery-reports", daemon=True
        )
        self._poller.start()

    # -- callbacks (run in the poller thread) ----------------------------------------------------

    def _serve_reports(self) -> None:
        while not self._closing.is_set():
            # Returns as soon as a report arrives; the timeout only bounds how long close() waits.
            self._producer.poll(0.1)

    def _replace_producer(self) -> None:
        """After a fatal error (an idempotent producer whose sequence broke, say, across a broker
        restart) the old client may send nothing more: start a fresh one, so a long-lived
        recorder carries on. Records the old one still held get no report: their callers time
        out, are in doubt, and resend through the new client."""
        with self._swap_lock:
            fatal = self._fatal
            if fatal is None:
                return
            log.warning("replacing the Kafka producer after a fatal error: %s", fatal.str())
            old, self._producer = self._producer, self._factory(self._config)
            self._fatal = None
            self.warm = False
        old.purge()  # nothing of it will be reported anyway
        old.flush(0)

    def _on_client_error(self, err: KafkaError) -> None:
        # Connection trouble is retried by librdkafka and surfaces per record if it lasts; it is
        # remembered so a timed-out call can say that the broker, not the topic, is the problem.
        if err.fatal():
            self._fatal = err
            log.error("kafka producer fatal error: %s", err)
        elif err.code() in _UNREACHABLE and self._unreachable is None:
            self._unreachable = (time.monotonic(), err)
            log.warning("kafka broker %s unreachable: %s", self._bootstrap, err.str())

    def _note_reachable(self, reports: _Reports) -> None:
        if self._unreachable is not None and len(reports.errors) < reports.expected:
            self._unreachable = None
            log.info("kafka broker %s reachable again", self._bootstrap)

    # -- sending -----------------------------------------------------------------------------------

    def submit(self, records: Sequence[OutgoingRecord]) -> _Reports:
        """Hand every record to the producer; the returned reports fill in as acks arrive.
        Raises :class:`~ledger.errors.RecordTooLargeError`, having sent nothing, if any record
        is over the producer's limit."""
        for record in records:
            if not fits(record):
                raise RecordTooLargeError(
                    f"a record for {record.topic} is {record_size(record)} bytes, over the "
                    f"{MESSAGE_MAX_BYTES} a producer may send; nothing was sent"
                )
        if self._fatal is not None:
            self._replace_producer()
        reports = _Reports(len(records))
        callback = reports.on_delivery
        deadline = time.monotonic() + self._wait_s
        for index, record in enumerate(records):
            try:
                # librdkafka's local queue may be full; the poller thread makes room.
                handed = produce(self._producer, record, callback, deadline, _sleep_a_little)
            except KafkaException as exc:
                # Refused by the client itself; the records before it are on their way.
                raise DeliveryError(
                    f"the producer refused a record for {record.topic}: {exc.args[0]}; "
                    f"the {index} record(s) before it may be written: resend the same "
                    "events",
                    exc.args[0],
                ) from None
            if not handed:
                raise DeliveryTimeoutError(self._timeout_message(reports))
        return reports

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        """Produce every record, then wait for their own acknowledgements (one wait)."""
        if not records:
            return []
        return self.wait(self.submit(records))

    def wait(self, submitted: _Reports) -> Positions:
        """Wait for the acknowledgements of records :meth:`submit` handed over; raises as
        :meth:`send` does."""
        if not submitted.wait(self._wait_s):
            raise DeliveryTimeoutError(self._timeout_message(submitted))
        self._check(submitted)
        self.warm = True
        return submitted.positions

    async def send_async(self, records: Sequence[OutgoingRecord]) -> Positions:
        """:meth:`send` for asyncio: the event loop is never blocked on an acknowledgement."""
        if not records:
            return []
        return await self.wait_async(self.submit(records))

    async def wait_async(self, submitted: _Reports) -> Positions:
        """:meth:`wait` for asyncio: the poller thread resolves a future."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not done.done():
                done.set_result(None)

        def wake() -> None:
            loop.call_soon_threadsafe(resolve)

        submitted.when_done(wake)
        try:
            await asyncio.wait_for(asyncio.shield(done), self._wait_s)
        except TimeoutError:
            raise DeliveryTimeoutError(self._timeout_message(submitted)) from None
        self._check(submitted)
        self.warm = True
        return submitted.positions

    def _check(self, reports: _Reports) -> None:
        self._note_reachable(reports)
        if not reports.errors:
            return
        err, topic = reports.errors[0]
        expected = reports.expected
        if err.code() == KafkaError._MSG_TIMED_OUT and self._unreachable is not None:
            raise DeliveryTimeoutError(self._timeout_message(reports), err)
        if err.code() in _NO_TOPIC:
            raise DeliveryError(
                f"{len(reports.errors)} of {expected} records not written: topic {topic!r} does "
                "not exist on the broker (topics are not auto-created: run `opledger stack up` "
                "or ledger.topics.ensure_topics)",
                err,
            )
        if err.code() == KafkaError._MSG_TIMED_OUT:
            raise DeliveryTimeoutError(
                f"{len(reports.errors)} of {expected} records to {topic} were not acknowledged "
                f"in time ({err.str()}); they may still have been written: the outcome is "
                "unknown, so resend the same event",
                err,
            )
        raise DeliveryError(
            f"{len(reports.errors)} of {expected} records not written to {topic}: "
            f"{err.name()}: {err.str()}",
            err,
        )

    def _timeout_message(self, reports: _Reports) -> str:
        missing = reports.expected - reports.received
        unknown = (
            f"{missing} of {reports.expected} records not acknowledged within "
            f"{self._wait_s:.0f}s: they may still be written (the outcome is unknown)"
        )
        if self._unreachable is not None:
            since, err = self._unreachable
            return (
                f"the Kafka broker at {self._bootstrap} is unreachable ({err.str()}, for "
                f"{time.monotonic() - since:.0f}s); {unknown}. Start the broker "
                "(`opledger stack up`) and resend the same event (recorder.resend)"
            )
        return f"{unknown}; resend the same event (recorder.resend)"

    def close(self) -> None:
        """Deliver what is queued (bounded by the delivery timeout), then stop the poller."""
        remaining = self._producer.flush(self._wait_s)
        self._closing.set()
        self._poller.join(timeout=5)
        if remaining:
            log.error("%d records still unacknowledged when the producer closed", remaining)


#: How often a writer sends the same records again after a failed send, and how long it waits
#: before each try. A resend after a lost acknowledgement is harmless: the fold recognises each
#: event by its id. A record too large, or refused as unwritable, is not sent again.
RESENDS: tuple[float, ...] = (0.2, 0.4)


class LogWriter:
    """Appends events for one kind of writer: each event as its record, acknowledged, sent again
    under :data:`RESENDS` when the send failed; the last failure is raised as the
    :class:`~ledger.errors.RecordError` it was (its outcome unknown: the caller may send the
    same events again)."""

    def __init__(
        self,
        transport: Transport,
        topics: LogTopics,
        writer: str,
        *,
        codec: Codec | None = None,
        resends: Sequence[float] = RESENDS,
    ) -> None:
        self.transport = transport
        self.builder = RecordBuilder(topics, codec or default_codec(), writer)
        self._resends = tuple(resends)

    @classmethod
    def connect(cls, settings: Settings, writer: str, **options: Any) -> LogWriter:
        """A writer with a Kafka transport of its own (close it with :meth:`close`)."""
        return cls(KafkaTransport(settings), LogTopics.of(settings), writer, **options)

    def records(self, events: Sequence[LedgerEvent]) -> list[OutgoingRecord]:
        return self.builder.records(events)

    def append(self, events: Sequence[LedgerEvent]) -> Positions:
        """Record ``events`` in order; returns where they were written (when known)."""
        return self.send(self.builder.records(events))

    def send(self, records: Sequence[OutgoingRecord]) -> Positions:
        """Send records this writer built (with :meth:`records`), under the resend policy."""
        if not records:
            return []
        for pause in self._resends:
            try:
                return self.transport.send(records) or []
            except RecordTooLargeError:
                raise
            except RecordError as exc:
                log.warning(
                    "append failed (%s); sending the same records again in %.1fs", exc, pause
                )
                time.sleep(pause)
        return self.transport.send(records) or []

    def close(self) -> None:
        self.transport.close()


#: Kafka's two ways of saying a record (or its batch) is over a limit.
TOO_LARGE: Final = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)


@dataclass(frozen=True, slots=True)
class RawSent:
    """What became of a :meth:`RawWriter.send`: where the acknowledged records were written,
    and by index, those refused or not acknowledged."""

    positions: Positions
    #: records refused as over a size limit, by the client or by the broker
    too_large: list[int]
    #: records refused for another reason, with the reason
    failed: list[tuple[int, str]]
    #: records handed over but not acknowledged in time, or never handed over
    unacknowledged: int

    @property
    def complete(self) -> bool:
        return not (self.too_large or self.failed or self.unacknowledged)


class RawWriter:
    """Sends records that are not events (:class:`~ledger.log.records.RawRecord`) with a
    producer of this module's making: dead letters and the records a redrive puts back,
    acknowledged as a batch (:meth:`send`), and the consumers' key-store entries, handed over
    one by one and acknowledged through their callbacks (:meth:`submit`, :meth:`poll`).

    A writer belongs to one caller: :meth:`send` waits for everything the producer holds.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_id: str,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        linger_ms: float = 0.0,
        overrides: dict[str, Any] | None = None,
        on_client_error: Callable[[KafkaError], None] | None = None,
        producer_factory: Callable[[dict[str, Any]], Any] = producer_from,
    ) -> None:
        config = producer_config(
            settings,
            client_id=client_id,
            delivery_timeout_s=delivery_timeout_s,
            linger_ms=linger_ms,
        )
        config.update(overrides or {})
        if on_client_error is not None:
            config["error_cb"] = on_client_error
        self._producer = producer_factory(config)
        self._timeout_s = delivery_timeout_s

    def send(self, records: Sequence[RawRecord], timeout_s: float | None = None) -> RawSent:
        """Produce every record and wait (at most ``timeout_s``, else the delivery timeout)
        for the broker's answers; never raises for a record refused, it reports it."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        positions: Positions = []
        too_large: list[int] = []
        failed: list[tuple[int, str]] = []
        answered = [0]

        def report(index: int) -> Callable[[KafkaError | None, Any], None]:
            def delivered(err: KafkaError | None, msg: Any) -> None:
                answered[0] += 1
                if err is None:
                    positions.append((msg.topic(), msg.partition(), msg.offset()))
                elif err.code() in TOO_LARGE:
                    too_large.append(index)
                else:
                    failed.append((index, err.str()))

            return delivered

        for index, record in enumerate(records):
            try:
                if not produce(self._producer, record, report(index), deadline, _poll_a_little):
                    break
            except KafkaException as exc:  # refused by the client itself
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() in TOO_LARGE:
                    too_large.append(index)
                else:
                    failed.append((index, str(err)))
        self._producer.flush(max(0.0, deadline - time.monotonic()))
        unacknowledged = len(records) - len(too_large) - len(failed) - len(positions)
        return RawSent(positions, sorted(too_large), sorted(failed), unacknowledged)

    def submit(
        self,
        record: RawRecord,
        on_delivery: Callable[[KafkaError | None, Any], None],
        *,
        wait_s: float = 0.0,
    ) -> bool:
        """Hand ``record`` over without waiting for its acknowledgement (``on_delivery`` gets
        it, from :meth:`poll` or :meth:`flush`); waits up to ``wait_s`` for room in a full
        local queue, serving acknowledgements meanwhile. False if none came."""
        deadline = time.monotonic() + wait_s
        return produce(self._producer, record, on_delivery, deadline, _poll_a_little)

    def poll(self, timeout_s: float) -> None:
        """Serve the acknowledgements that arrived (waits at most ``timeout_s`` for one)."""
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        """Wait for every record handed over; answers how many are still unacknowledged."""
        return int(self._producer.flush(timeout_s))

    def close(self, timeout_s: float = 10.0) -> int:
        """Deliver what is queued (at most ``timeout_s``); answers how many were not."""
        return self.flush(timeout_s)
