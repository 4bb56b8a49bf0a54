"""Reads of the log's ends, with one policy for the errors a moving cluster gives.

A partition's leader moves on every rolling restart, preferred-leader election and broker
failure; a topic created a moment ago has none for a while; a coordinator loads after a
restart. Each of those answers a request with an error that the same request, asked again a
moment later, does not get. :func:`ride_out` asks again until the caller's deadline, and only
then raises a :class:`LogUnavailableError` that names the broker, the partitions and what to do.
Every read of an end offset in opledger goes through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ledger.log.clients import new_consumer
from ledger.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a read waits out a settling cluster by default.
READ_DEADLINE_S = 30.0

#: Errors that mean "not now": leadership or a coordinator moving, a topic's metadata still
#: settling, a connection lost on the way. librdkafka marks some of them retriable itself; these
#: are asked again whether or not it does.
SETTLING: frozenset[int] = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.OFFSET_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._WAIT_COORD,
        KafkaError._UNKNOWN_PARTITION,
        # a broker handle torn down as the broker it spoke to was fenced (a SIGKILLed broker)
        KafkaError._DESTROY_BROKER,
    }
)


class LogUnavailableError(KafkaException):
    """A read of the log kept failing with errors that settle by themselves, past its deadline.
    A ``KafkaException`` still, so a caller that handled the raw error handles this one."""


def settling(error: object) -> bool:
    """Whether ``error`` (a KafkaError, or a KafkaException carrying one) is one that the same
    request asked again may not get."""
    if isinstance(error, KafkaException):
        error = error.args[0] if error.args else None
    if not isinstance(error, KafkaError):
        return False
    return error.code() in SETTLING or (error.retriable() and not error.fatal())


def ride_out(
    call: Callable[[], T],
    *,
    deadline: float,
    what: str,
    bootstrap: str,
    partitions: Sequence[tuple[str, int]] = (),
    pause_s: float = 0.1,
    refresh: Callable[[], object] | None = None,
) -> T:
    """``call()``, asked again after each error that :func:`settling` accepts until ``deadline``
    (``time.monotonic()``); pauses grow from ``pause_s`` to 1 s. Any other error is raised at
    once, as it was; a settling one past the deadline as :class:`LogUnavailableError` naming
    ``what`` was read, from which broker and partitions, and what to do.

    ``refresh`` is called before each new try: a client's view of who leads a partition is
    not refreshed by a failed offsets request (after a broker was SIGKILLed, a long-lived
    consumer answered ``_UNKNOWN_PARTITION`` for 25 s and more, until a metadata request), so
    the caller asks for the metadata again."""
    tries = 0
    while True:
        try:
            return call()
        except KafkaException as exc:
            if not settling(exc):
                raise
            tries += 1
            now = time.monotonic()
            if now >= deadline:
                where = ", ".join(f"{t}[{p}]" for t, p in partitions[:6]) or "the topics asked"
                more = f" and {len(partitions) - 6} more" if len(partitions) > 6 else ""
                raise LogUnavailableError(
                    f"{what} could not be read from the Kafka cluster at {bootstrap} "
                    f"({where}{more}): {exc.args[0] if exc.args else exc} after {tries} tries. "
                    "Leadership did not settle in time: check that every broker is up "
                    "(`opledger stack status`) and ask again; nothing was changed"
                ) from exc
            if tries == 1:
                log.info("%s: %s; asking again", what, exc.args[0] if exc.args else exc)
            time.sleep(min(pause_s, deadline - now))
            pause_s = min(pause_s * 2, 1.0)
            if refresh is not None:
                try:
                    refresh()
                except KafkaException as failure:  # the next try says what is wrong
                    log.debug("%s: metadata not refreshed: %s", what, failure)


def watermarks(
    consumer: Consumer, tp: TopicPartition, deadline: float, *, bootstrap: str = "the broker"
) -> tuple[int, int]:
    """The low and high watermarks of ``tp``, asked of the broker (never the cached ones)."""

    def ask() -> tuple[int, int]:
        low, high = consumer.get_watermark_offsets(tp, timeout=10, cached=False)
        return int(low), int(high)

    return ride_out(
        ask,
        deadline=deadline,
        what="a partition's watermarks",
        bootstrap=bootstrap,
        partitions=[(tp.topic, tp.partition)],
        refresh=_metadata_of(consumer, [tp.topic]),
    )


def _metadata_of(consumer: Consumer, topics: Sequence[str]) -> Callable[[], None]:
    """Asks the cluster again who leads ``topics``' partitions (what a retry needs first)."""

    def refresh() -> None:
        for topic in dict.fromkeys(topics):
            consumer.list_topics(topic, timeout=5)

    return refresh


#: ListOffsets' timestamp for "the latest offset" (Kafka's protocol; librdkafka passes it on).
_LATEST = -1


def _list_offsets(
    consumer: Consumer,
    keys: Sequence[tuple[str, int]],
    timestamp_ms: int,
    deadline: float,
    *,
    bootstrap: str,
    what: str,
) -> list[Any]:
    """One ListOffsets request per broker for ``keys`` at ``timestamp_ms``, ridden out."""

    def ask() -> list[Any]:
        return list(
            consumer.offsets_for_times(
                [TopicPartition(t, p, timestamp_ms) for t, p in keys],
                timeout=max(0.5, min(10.0, deadline - time.monotonic())),
            )
        )

    return ride_out(
        ask,
        deadline=deadline,
        what=what,
        bootstrap=bootstrap,
        partitions=keys,
        refresh=_metadata_of(consumer, [t for t, _p in keys]),
    )


def latest_offsets(
    consumer: Consumer,
    keys: Sequence[tuple[str, int]],
    deadline: float,
    *,
    bootstrap: str = "the broker",
) -> dict[tuple[str, int], int]:
    """Each partition's end (what a read_committed reader can read up to), asked in one
    ListOffsets request per broker: a watermark query per partition is a round trip each. A
    partition whose answer carries an error is asked again, alone, for its watermarks."""
    if not keys:
        return {}
    answers = _list_offsets(
        consumer, keys, _LATEST, deadline, bootstrap=bootstrap, what="the log's ends"
    )
    latest: dict[tuple[str, int], int] = {}
    for answer in answers:
        key = (answer.topic, answer.partition)
        if answer.error is not None or answer.offset < 0:
            _low, high = watermarks(consumer, TopicPartition(*key), deadline, bootstrap=bootstrap)
            latest[key] = high
        else:
            latest[key] = int(answer.offset)
    missing = [key for key in keys if key not in latest]
    if missing:
        raise LogUnavailableError(f"no end offset for {missing} from {bootstrap}")
    return latest


def offsets_at(
    consumer: Consumer,
    keys: Sequence[tuple[str, int]],
    timestamp_ms: int,
    ends: dict[tuple[str, int], int],
    deadline: float,
    *,
    bootstrap: str = "the broker",
) -> dict[tuple[str, int], int]:
    """Each partition's first offset whose record time is at or after ``timestamp_ms`` (its
    end in ``ends`` when no record is that late), asked in one ListOffsets request per broker."""
    if not keys:
        return {}
    answers = _list_offsets(
        consumer, keys, timestamp_ms, deadline, bootstrap=bootstrap, what="a time's offsets"
    )
    found: dict[tuple[str, int], int] = {}
    for answer in answers:
        if answer.error is not None:
            raise KafkaException(answer.error)
        key = (answer.topic, answer.partition)
        found[key] = ends[key] if answer.offset < 0 else min(int(answer.offset), ends[key])
    return found


def read_range(
    consumer: Consumer,
    where: tuple[str, int],
    start: int,
    end: int,
    deadline: float,
    *,
    batch: int = 500,
) -> Iterator[Any]:
    """Every record of ``where`` (topic, partition) from offset ``start`` up to ``end``, in
    order, as the consumer reads them (read_committed: an aborted transaction's records and
    every commit marker leave gaps in the offsets). Raises ``TimeoutError`` past ``deadline``."""
    topic, partition = where
    consumer.assign([TopicPartition(topic, partition, start)])
    position = start
    try:
        while position < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}[{partition}] was not read to {end} in time")
            for message in consumer.consume(min(batch, end - position), 0.5):
                if (error := message.error()) is not None:
                    if error.fatal():
                        raise KafkaException(error)
                    continue
                offset = int(message.offset() or 0)
                position = max(position, offset + 1)
                if start <= offset < end:
                    yield message
            # Past a transaction's commit marker, which is no record.
            (tp,) = consumer.position([TopicPartition(topic, partition)])
            position = max(position, int(tp.offset))
    finally:
        consumer.unassign()


def end_offsets(
    settings: Settings, topics: Iterable[str], timeout_s: float = READ_DEADLINE_S
) -> dict[tuple[str, int], int]:
    """The high watermark of every partition of ``topics``: where "caught up" ends. A topic
    created a moment ago is waited for (up to ``timeout_s``) while its leaders settle."""
    # A throwaway consumer: watermark queries need one, and it never joins its group. It reads
    # read_committed as every worker does, so "the end" is the last stable offset they can reach.
    consumer = new_consumer(
        settings,
        group_id=settings.readers_group("watermarks"),
        client_id="opledger-watermarks",
    )
    deadline = time.monotonic() + timeout_s
    bootstrap = settings.bootstrap_servers
    try:
        keys: list[tuple[str, int]] = []
        wanted = list(topics)

        def partitions_of() -> list[tuple[str, int]]:
            meta = consumer.list_topics(timeout=10)
            found = []
            for topic in wanted:
                described = meta.topics.get(topic)
                if described is None or described.error is not None:
                    error = None if described is None else described.error
                    raise KafkaException(error or KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
                found += [(topic, p) for p in sorted(described.partitions)]
            return found

        keys = ride_out(
            partitions_of, deadline=deadline, what="the topics' partitions", bootstrap=bootstrap
        )
        return latest_offsets(consumer, keys, deadline, bootstrap=bootstrap)
    finally:
        consumer.close()
