"""The one place that constructs Kafka clients.

Configurations come from :mod:`ledger.kafka` (durability, partitioning, logging decided once);
this module turns them into clients, so that ``tests/unit/test_one_way_to_the_log.py`` can hold
every other module to "ask here": a client built elsewhere would be one whose settings nobody
reviewed.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from ledger.kafka import admin_config, consumer_config, producer_config
from ledger.settings import Settings


def new_producer(
    settings: Settings,
    *,
    client_id: str,
    overrides: dict[str, Any] | None = None,
    **options: Any,
) -> Producer:
    """A durable producer (:func:`ledger.kafka.producer_config` with ``options``), with
    librdkafka settings ``overrides`` on top (a callback, a larger ``message.max.bytes``)."""
    return Producer(
        {**producer_config(settings, client_id=client_id, **options), **(overrides or {})}
    )


def producer_from(config: dict[str, Any]) -> Producer:
    """A producer from a configuration already built by :func:`ledger.kafka.producer_config`
    (a transport that replaces its client after a fatal error builds the same one again)."""
    return Producer(config)


def new_consumer(
    settings: Settings,
    *,
    group_id: str,
    client_id: str,
    overrides: dict[str, Any] | None = None,
) -> Consumer:
    """A consumer that commits nothing by itself (:func:`ledger.kafka.consumer_config`), with
    librdkafka settings ``overrides`` on top."""
    config = consumer_config(settings, group_id=group_id, client_id=client_id)
    return Consumer({**config, **(overrides or {})})


def new_admin(
    settings: Settings, *, client_id: str, overrides: dict[str, Any] | None = None
) -> AdminClient:
    """An admin client (topic creation, metadata, leader elections)."""
    return AdminClient({**admin_config(settings, client_id=client_id), **(overrides or {})})
