"""What "acknowledged" means for every append the SDK and the workers make: written to every
in-sync replica (``acks=all``), once and in order (idempotence), placed by Java's partitioner.
README and ``ledger/kafka.py`` promise it; a change to ``acks=1`` would still pass every test
that appends and reads back, so it is checked here, on the configuration itself and on the one
the SDK's transport hands its producer."""

from __future__ import annotations

from typing import Any

from ledger.kafka import consumer_config, producer_config
from ledger.log import KafkaTransport
from ledger.settings import Settings

SETTINGS = Settings.from_env(
    {"OPLEDGER_HOME": "/srv/opledger", "OPLEDGER_KAFKA_SECURITY": "plaintext"}
)


def _durable(config: dict[str, Any]) -> None:
    assert config["acks"] == "all"
    assert config["enable.idempotence"] is True
    assert config["max.in.flight.requests.per.connection"] <= 5  # idempotence keeps order
    assert config["partitioner"] == "murmur2_random"


def test_the_factory_builds_durable_producers() -> None:
    _durable(producer_config(SETTINGS))


def test_the_sdk_transport_hands_its_producer_the_durable_config() -> None:
    seen: list[dict[str, Any]] = []

    class _Producer:
        def __init__(self, config: dict[str, Any]) -> None:
            seen.append(config)

        def poll(self, _timeout: float) -> int:
            return 0

        def flush(self, _timeout: float) -> int:
            return 0

    transport = KafkaTransport(SETTINGS, producer_factory=_Producer)
    try:
        assert len(seen) == 1
        _durable(seen[0])
        assert seen[0]["linger.ms"] == 0, "a single call's latency is not padded"
    finally:
        transport.close()


def test_consumers_read_committed_and_commit_nothing_by_themselves() -> None:
    config = consumer_config(SETTINGS, group_id="g")
    assert config["isolation.level"] == "read_committed"
    assert config["enable.auto.commit"] is False
    assert config["enable.auto.offset.store"] is False
