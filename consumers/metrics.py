"""The consumers' Prometheus metrics, one object built from a registry that is passed in.

Receipt and execution are counted apart: ``responses``/``accepted``/``duplicate_keys`` say what
arrived and what the sender was told (a 202 is receipt); ``changes`` says what the consumer's
change did. Labels are bounded: a consumer name, a transport, a status code and a fixed reason
word; never an operation id or a URL.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class ConsumerMetrics:
    responses: Counter
    request_seconds: Histogram
    accepted: Counter
    duplicate_keys: Counter
    key_conflicts: Counter
    changes: Counter
    queue_records: Counter
    restore_seconds: Gauge
    restored_keys: Gauge
    publish_lag_seconds: Histogram
    unpublished_keys: Gauge
    republished: Counter
    publish_failures: Counter
    result_fetches: Counter
    dead_letters: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ConsumerMetrics:
        return cls(
            responses=Counter(
                "opledger_consumer_responses_total",
                "Answers of the receiver by HTTP status and reason (accepted, duplicate, or the "
                "problem type of a refusal). A 202 acknowledges receipt, not execution.",
                ["consumer", "status", "reason"],
                registry=registry,
            ),
            request_seconds=Histogram(
                "opledger_consumer_request_seconds",
                "Time to answer POST /events, refusals included.",
                ["consumer"],
                buckets=_REQUEST_BUCKETS,
                registry=registry,
            ),
            accepted=Counter(
                "opledger_consumer_accepted_total",
                "Keys received for the first time and committed to the inbox, by transport.",
                ["consumer", "via"],
                registry=registry,
            ),
            duplicate_keys=Counter(
                "opledger_consumer_duplicate_keys_total",
                "Keys received again with the same body and not applied again, by transport and "
                "where the key was found (view: restored key store or this instance; inbox).",
                ["consumer", "via", "seen_in"],
                registry=registry,
            ),
            result_fetches=Counter(
                "opledger_consumer_result_fetches_total",
                "Fetches of results delivered by reference, by outcome: fetched (size and "
                "sha256 checked), unavailable (the receiver answers 503, the queue consumer "
                "tries again until its hold limit), refused (422; the queue consumer "
                "dead-letters the record).",
                ["consumer", "outcome"],
                registry=registry,
            ),
            key_conflicts=Counter(
                "opledger_consumer_key_conflicts_total",
                "Keys received again with a different body (refused, 422), by transport.",
                ["consumer", "via"],
                registry=registry,
            ),
            changes=Counter(
                "opledger_consumer_changes_total",
                "What the consumer's change did with first receipts (execution, not receipt): "
                "applied or refused.",
                ["consumer", "outcome"],
                registry=registry,
            ),
            queue_records=Counter(
                "opledger_consumer_queue_records_total",
                "Queue records handled by outcome: accepted, duplicate, conflict, or the problem "
                "type of a record refused and dead-lettered.",
                ["consumer", "outcome"],
                registry=registry,
            ),
            dead_letters=Counter(
                "opledger_consumer_dead_letters_total",
                "Queue records put on the consumers' dead-letter topic instead of being taken, "
                "by kind: invalid, foreign-tenant, refused (fetched bytes not the result), "
                "conflict (key taken with another body), unfetchable (result not fetched within "
                "the hold limit).",
                ["consumer", "kind"],
                registry=registry,
            ),
            restore_seconds=Gauge(
                "opledger_consumer_keystore_restore_seconds",
                "Duration of the last rebuild of the key view from the compacted key store.",
                ["consumer"],
                registry=registry,
            ),
            restored_keys=Gauge(
                "opledger_consumer_keystore_restored_keys",
                "Keys in the view after the last restore.",
                ["consumer"],
                registry=registry,
            ),
            publish_lag_seconds=Histogram(
                "opledger_consumer_keystore_publish_lag_seconds",
                "From a key's inbox commit to the broker's acknowledgement of its key-store "
                "record (republished keys included: a crash shows as a long lag).",
                ["consumer"],
                buckets=_LAG_BUCKETS,
                registry=registry,
            ),
            unpublished_keys=Gauge(
                "opledger_consumer_keystore_unpublished_keys",
                "Inbox rows not yet acknowledged on the key store (at the last sweep).",
                ["consumer"],
                registry=registry,
            ),
            republished=Counter(
                "opledger_consumer_keystore_republished_total",
                "Keys the sweep sent again because their first write was not acknowledged.",
                ["consumer"],
                registry=registry,
            ),
            publish_failures=Counter(
                "opledger_consumer_keystore_publish_failures_total",
                "Key-store writes the broker refused or timed out (the sweep retries them).",
                ["consumer"],
                registry=registry,
            ),
        )
