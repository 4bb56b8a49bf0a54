"""``ledger.kafka.partition_for`` against Kafka's own murmur2 vectors (``UtilsTest.testMurmur2``
in apache/kafka): readers find an operation's records by it, so it must agree with the Java
partitioner bit for bit. Where librdkafka actually puts records is checked against the broker in
``tests/integration/test_producer.py``."""

from __future__ import annotations

import random

import pytest

from ledger.kafka import partition_for

#: key -> Utils.murmur2(key), as Kafka's test states them (signed 32-bit).
KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
}


@pytest.mark.parametrize(("key", "murmur2"), KAFKA_VECTORS.items())
def test_partition_for_is_javas_to_positive_murmur2(key: bytes, murmur2: int) -> None:
    # With 2**31 partitions the modulo keeps every bit toPositive leaves.
    assert partition_for(key, 2**31) == murmur2 & 0x7FFFFFFF
    assert partition_for(key, 6) == (murmur2 & 0x7FFFFFFF) % 6


def test_remembered_partitions_are_the_computed_ones() -> None:
    from ledger.kafka import _murmur2_partition  # noqa: PLC0415

    rng = random.Random(5)
    keys = [rng.randbytes(rng.randrange(0, 200)) for _ in range(2000)]
    for key in keys + keys:  # the second round answers from the cache (short keys)
        assert partition_for(key, 12) == _murmur2_partition(key, 12)
        assert partition_for(key, 7) == _murmur2_partition(key, 7)
