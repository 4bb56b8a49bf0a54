"""The Kafka topics opledger writes, as data, and an idempotent way to create them.

Auto-creation is off on our brokers, so every topic that holds opledger's records is created
here, explicitly, with the partition count and configuration the processors rely on. (The
projector, recovery and delivery workers host a faust app, which declares one internal topic,
``<prefix>-<worker>-host-__assignor-__leader``, for its app group; it carries no record of ours:
``tests/integration/test_stack.py`` checks that nothing else is there.)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

# confluent_kafka.admin re-exports these implicitly, which mypy strict rejects.
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewTopic

from ledger.kafka_access import ensure_access
from ledger.log.clients import new_admin
from ledger.log.reads import ride_out
from ledger.settings import Settings


class TopicError(RuntimeError):
    """A topic could not be created, or exists with a shape we cannot use."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic: its name, partition count, topic-level configuration and replicas."""

    name: str
    partitions: int
    config: Mapping[str, str]
    replication: int = 1


def min_insync_replicas(replication: int) -> int:
    """A majority of ``replication`` replicas (1 of 1, 2 of 2, 2 of 3): producers send with
    acks=all, so an acknowledged record is on a majority of them, and losing any minority of
    brokers neither loses it nor stops writes (with 3, one broker may be away: a rolling
    restart)."""
    return replication // 2 + 1


def _spec(settings: Settings, name: str, partitions: int, config: Mapping[str, str]) -> TopicSpec:
    replication = settings.replication_factor
    return TopicSpec(
        name,
        partitions,
        MappingProxyType({**config, "min.insync.replicas": str(min_insync_replicas(replication))}),
        replication,
    )


# Auditors replay the whole log, so nothing is ever deleted by age or size (retention -1);
# compaction would drop the history of an operation, hence "delete" with infinite retention.
# CreateTime keeps the producer's clock, which is when the transition happened.
_LOG_CONFIG: Mapping[str, str] = MappingProxyType(
    {
        "cleanup.policy": "delete",
        "retention.ms": "-1",
        "message.timestamp.type": "CreateTime",
    }
)


# Policy is current state, not history: compaction keeps the last record per key (the subject
# a record decides: ledger.domain.policy.grant_key / credential_key), so the topic stays small
# however often a grant changes, and a replay still rebuilds today's policy. Revocations are
# records, never tombstones, so they survive compaction with their version. The full trail of
# changes is kept by the projector in policy_history, with each record's coordinates.
_POLICY_CONFIG: Mapping[str, str] = MappingProxyType(
    {
        "cleanup.policy": "compact",
        "message.timestamp.type": "CreateTime",
    }
)

#: One partition: policy changes are rare (people and provisioning scripts write them), so one
#: partition is far from a throughput limit; it gives every change one total order, which
#: policy_history and the projector's stored position follow, and nothing has to be
#: co-partitioned with the operation topics.
POLICY_PARTITIONS = 1


# The consumers' key store (consumers/keystore.py) is current state too: one record per
# (consumer, operation) key, the last one kept by compaction. Nothing expires by age, so the
# dedup window is forever unless a tombstone is written (docs/decisions/009-consumer-dedup.md).
_CONSUMER_KEYS_CONFIG: Mapping[str, str] = MappingProxyType(
    {
        "cleanup.policy": "compact",
        "message.timestamp.type": "CreateTime",
    }
)


def topic_specs(settings: Settings) -> list[TopicSpec]:
    """The execution, delivery and dead-letter topics for ``settings`` (the append-only logs)."""
    return [
        _spec(settings, settings.execution_topic, settings.partitions, _LOG_CONFIG),
        _spec(settings, settings.delivery_topic, settings.partitions, _LOG_CONFIG),
        # Same partitions so a dead letter can keep the key -> partition of its source record.
        _spec(settings, settings.dead_letter_topic, settings.partitions, _LOG_CONFIG),
    ]


def policy_topic_spec(settings: Settings) -> TopicSpec:
    """The compacted policy topic for ``settings``."""
    return _spec(settings, settings.policy_topic, POLICY_PARTITIONS, _POLICY_CONFIG)


def consumer_keys_topic_spec(settings: Settings) -> TopicSpec:
    """The compacted consumer key store, co-partitioned with the operation topics (same count;
    records are placed by the murmur2 partition of their operation id)."""
    return _spec(settings, settings.consumer_keys_topic, settings.partitions, _CONSUMER_KEYS_CONFIG)


def consumer_dead_letter_topic_spec(settings: Settings) -> TopicSpec:
    """The queue consumers' dead letters: kept like the logs, as they may be redriven."""
    return _spec(settings, settings.consumer_dead_letter_topic, settings.partitions, _LOG_CONFIG)


def all_topic_specs(settings: Settings) -> list[TopicSpec]:
    """Every topic opledger writes: the logs, the policy topic, the consumer key store and the
    consumers' dead letters."""
    return [
        *topic_specs(settings),
        policy_topic_spec(settings),
        consumer_keys_topic_spec(settings),
        consumer_dead_letter_topic_spec(settings),
    ]


def ensure_topics(settings: Settings, timeout: float = 30.0) -> list[TopicSpec]:
    """Create the topics if missing and check existing ones, with the ACLs each role needs on
    them when the broker has an authorizer (:mod:`ledger.kafka_access`); safe to call any number
    of times. A service's principal may neither create topics nor ACLs: it only checks."""
    specs = all_topic_specs(settings)
    admin = new_admin(settings, client_id="opledger-topics")
    _create(admin, specs, timeout)
    _verify(admin, specs, timeout, settings.bootstrap_servers, settings.kafka_user)
    ensure_access(settings, timeout)
    return specs


# Another process (a test, the projector) may have won the race; a service's principal may not
# create topics at all, and the admin's `opledger stack up` did. Either way _verify checks that
# what exists is what we would have created, and names what is missing.
_NOT_OURS_TO_CREATE = (
    KafkaError.TOPIC_ALREADY_EXISTS,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
)


def _create(admin: AdminClient, specs: list[TopicSpec], timeout: float) -> None:
    new = [
        NewTopic(
            s.name,
            num_partitions=s.partitions,
            replication_factor=s.replication,
            config=dict(s.config),
        )
        for s in specs
    ]
    futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() in _NOT_OURS_TO_CREATE:
                continue
            raise TopicError(f"could not create topic {name}: {error}") from exc


def _verify(
    admin: AdminClient,
    specs: list[TopicSpec],
    timeout: float,
    bootstrap: str,
    principal: str = "admin",
) -> None:
    # Metadata of a just-created topic can lag the create response by a moment.
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        missing = [s.name for s in specs if s.name not in topics or topics[s.name].error]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TopicError(
                f"topics not visible after {timeout:.0f}s: {', '.join(missing)} (missing, or "
                f"not visible to Kafka principal {principal!r}: the admin creates them, "
                "`opledger stack up` on the local stack)"
            )
        time.sleep(0.2)
    for spec in specs:
        partitions = topics[spec.name].partitions
        actual = len(partitions)
        if actual != spec.partitions:
            raise TopicError(
                f"topic {spec.name} has {actual} partitions but settings ask for "
                f"{spec.partitions}; key -> partition routing would change, so use a new "
                f"topic_prefix or delete the topic"
            )
        # Fewer replicas than asked would acknowledge records one broker's loss can take away;
        # more is the operator's choice and kept.
        replicas = min(len(p.replicas) for p in partitions.values())
        if replicas < spec.replication:
            raise TopicError(
                f"topic {spec.name} has {replicas} replica(s) on some partition but "
                f"OPLEDGER_REPLICATION_FACTOR asks for {spec.replication}; reassign its "
                "partitions to more brokers or use a new topic_prefix"
            )
    _verify_cleanup(admin, specs, timeout, bootstrap)


def topic_configs(
    admin: AdminClient, names: list[str], timeout: float, bootstrap: str
) -> dict[str, dict[str, str | None]]:
    """Each topic's configuration as the brokers state it (their defaults included)."""
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in names]

    def describe() -> dict[str, Any]:
        return {
            resource.name: future.result(timeout)
            for resource, future in admin.describe_configs(resources).items()
        }

    # A broker that has not learnt of a topic created a moment ago answers
    # UNKNOWN_TOPIC_OR_PART (seen on the three-broker cluster in CI): asked again, it knows.
    described = ride_out(
        describe,
        deadline=time.monotonic() + timeout,
        what="the topics' configurations",
        bootstrap=bootstrap,
    )
    return {
        name: {key: entry.value for key, entry in entries.items()}
        for name, entries in described.items()
    }


def _verify_cleanup(
    admin: AdminClient, specs: list[TopicSpec], timeout: float, bootstrap: str
) -> None:
    # A policy topic left with "delete" would lose grants to retention; a log topic with
    # "compact" would lose history to compaction. Either is refused, not silently used.
    described = topic_configs(admin, [s.name for s in specs], timeout, bootstrap)
    for spec in specs:
        want = spec.config.get("cleanup.policy")
        actual = described[spec.name].get("cleanup.policy")
        if want is not None and actual != want:
            raise TopicError(
                f"topic {spec.name} has cleanup.policy={actual} but opledger needs {want}; "
                "use a new topic_prefix or delete the topic"
            )
