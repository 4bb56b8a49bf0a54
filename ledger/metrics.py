"""Prometheus metrics, one object built from a registry that is passed in (faust's
``FaustMetrics.create(registry, app_name)``). Base units, ``_total`` on counters, histograms for
latencies, and never an operation_id in a label (unbounded cardinality)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 10, 50, 100, 500, 1000, 2000, 5000, 10000)


@dataclass(frozen=True, slots=True)
class Metrics:
    records_appended: Counter
    append_seconds: Histogram
    projected_events: Counter
    duplicate_transitions: Counter
    illegal_transitions: Counter
    dead_letters: Counter
    projector_batch_seconds: Histogram
    projector_batch_events: Histogram
    append_to_visible_seconds: Histogram
    projector_lag_records: Gauge
    projector_skipped_redelivered: Counter
    projector_consumer_reopens: Counter
    delivery_outbox_rejoins: Counter
    execution_oldest_age_seconds: Gauge
    delivery_oldest_age_seconds: Gauge
    anomalies: Counter
    reconciliations: Counter
    provider_lookups: Counter
    provider_calls: Counter
    detector_transitions: Counter
    resumed: Counter
    lease_takeovers: Counter
    parked_oldest_age_seconds: Gauge
    recovery_pass_seconds: Histogram
    deliveries: Counter
    outbox_deliveries: Counter
    delivery_send_seconds: Histogram
    delivery_pool_connections_max: Gauge
    delivery_pool_connections_in_use: Gauge
    delivery_pool_wait_seconds: Histogram
    delivery_pool_waiting: Gauge
    confirmation_to_ack_seconds: Histogram
    dead_lettered_deliveries: Gauge
    delivery_redrives: Counter
    delivery_pass_seconds: Histogram
    result_fetches: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> Metrics:
        return cls(
            records_appended=Counter(
                "opledger_records_appended_total",
                "Transitions acknowledged by the broker, by machine.",
                ["machine"],
                registry=registry,
            ),
            append_seconds=Histogram(
                "opledger_append_seconds",
                "Time from produce to broker acknowledgement of one SDK call.",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            projected_events=Counter(
                "opledger_projected_events_total",
                "Events folded into the projections, by machine and outcome "
                "(applied, duplicate, anomaly).",
                ["machine", "outcome"],
                registry=registry,
            ),
            duplicate_transitions=Counter(
                "opledger_duplicate_transitions_total",
                "Repeated transitions (same operation, state and attempt) seen by the projector.",
                ["machine"],
                registry=registry,
            ),
            illegal_transitions=Counter(
                "opledger_illegal_transitions_total",
                "Transitions refused by the state machine and stored as anomalies.",
                ["machine"],
                registry=registry,
            ),
            dead_letters=Counter(
                "opledger_dead_letters_total",
                "Undecodable records sent to the dead-letter topic, by source topic.",
                ["source_topic"],
                registry=registry,
            ),
            projector_batch_seconds=Histogram(
                "opledger_projector_batch_seconds",
                "Time to fold and commit one batch into PostgreSQL.",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            projector_batch_events=Histogram(
                "opledger_projector_batch_events",
                "Records per projector batch.",
                buckets=_BATCH_BUCKETS,
                registry=registry,
            ),
            append_to_visible_seconds=Histogram(
                "opledger_append_to_visible_seconds",
                "From the record's Kafka timestamp to its projection commit.",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            projector_lag_records=Gauge(
                "opledger_projector_lag_records",
                "Records on the topic not yet projected, by topic.",
                ["topic"],
                registry=registry,
            ),
            projector_skipped_redelivered=Counter(
                "opledger_projector_skipped_redelivered_total",
                "Records skipped because their offset was already projected (redelivery).",
                registry=registry,
            ),
            projector_consumer_reopens=Counter(
                "opledger_projector_consumer_reopens_total",
                "Times the projector reopened its Kafka consumer because records waited on the "
                "broker while nothing was fetched (a stalled fetcher after a broker restart).",
                registry=registry,
            ),
            delivery_outbox_rejoins=Counter(
                "opledger_delivery_outbox_rejoins_total",
                "Times the delivery worker left and joined its group again because SUCCEEDED "
                "records waited on the broker while its outbox read nothing.",
                registry=registry,
            ),
            execution_oldest_age_seconds=Gauge(
                "opledger_execution_oldest_age_seconds",
                "Age of the oldest operation in each unfinished execution state (UNKNOWN above "
                "all: it waits for reconciliation); absent when no operation is in that state.",
                ["state"],
                registry=registry,
            ),
            delivery_oldest_age_seconds=Gauge(
                "opledger_delivery_oldest_age_seconds",
                "Age of the oldest unfinished (PENDING or SENT) delivery per destination.",
                ["destination", "state"],
                registry=registry,
            ),
            anomalies=Counter(
                "opledger_anomalies_total",
                "Refused events by kind: illegal, conflict, fenced (an append under a lease "
                "taken over since), foreign_tenant, awaiting_execution.",
                ["machine", "kind"],
                registry=registry,
            ),
            reconciliations=Counter(
                "opledger_reconciliations_total",
                "Reconciliation decisions by outcome: succeeded, failed, new_attempt, refused, "
                "parked, retry_lookup.",
                ["outcome"],
                registry=registry,
            ),
            provider_lookups=Counter(
                "opledger_provider_lookups_total",
                "Provider lookups by idempotency key, by result.",
                ["tool", "result"],
                registry=registry,
            ),
            provider_calls=Counter(
                "opledger_provider_calls_total",
                "Tool calls made by a worker (resumed intents and permitted new attempts), by "
                "outcome: succeeded, failed, unknown.",
                ["tool", "outcome"],
                registry=registry,
            ),
            detector_transitions=Counter(
                "opledger_detector_transitions_total",
                "DISPATCHED operations with no live owner past their tool's timeout, recorded "
                "UNKNOWN by the recovery worker.",
                registry=registry,
            ),
            resumed=Counter(
                "opledger_resumed_intents_total",
                "Intents whose owner went away before dispatching, dispatched once by the "
                "recovery worker (or refused by policy), by outcome.",
                ["outcome"],
                registry=registry,
            ),
            lease_takeovers=Counter(
                "opledger_lease_takeovers_total",
                "Operations taken over under a new lease (their previous lease had expired).",
                registry=registry,
            ),
            parked_oldest_age_seconds=Gauge(
                "opledger_parked_oldest_age_seconds",
                "Age of the oldest operation parked for a person (0 when none is).",
                registry=registry,
            ),
            recovery_pass_seconds=Histogram(
                "opledger_recovery_pass_seconds",
                "Time of one recovery pass (find, take over, load, decide, record).",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            deliveries=Counter(
                "opledger_deliveries_total",
                "Sends of deliveries by destination (its name) and outcome: acked, retry, "
                "throttled, dead_lettered, disabled, not_sent (no connection came free: not an "
                "attempt); and refused (dead-lettered before a send: policy, a disabled or "
                "unknown destination, no stored result).",
                ["destination", "outcome"],
                registry=registry,
            ),
            outbox_deliveries=Counter(
                "opledger_outbox_deliveries_total",
                "PENDING deliveries the outbox opened for SUCCEEDED executions.",
                registry=registry,
            ),
            result_fetches=Counter(
                "opledger_delivery_result_fetches",
                "Fetches of results delivered by reference, by answer (served, bad-signature, "
                "not-found, ...).",
                ["outcome"],
                registry=registry,
            ),
            delivery_send_seconds=Histogram(
                "opledger_delivery_send_seconds",
                "Time of one send (HTTP request to answer, or queue append to acknowledgement).",
                ["kind"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            delivery_pool_connections_max=Gauge(
                "opledger_delivery_pool_connections_max",
                "The webhook sender's connections (OPLEDGER_DELIVERY_CONCURRENCY): requests in "
                "flight at once, each on a connection of its own.",
                registry=registry,
            ),
            delivery_pool_connections_in_use=Gauge(
                "opledger_delivery_pool_connections_in_use",
                "The webhook sender's connections carrying a request now.",
                registry=registry,
            ),
            delivery_pool_wait_seconds=Histogram(
                "opledger_delivery_pool_wait_seconds",
                "Time a due webhook delivery waited for one of the sender's connections before "
                "its send was recorded (0 for one that found a connection free at once).",
                buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
                registry=registry,
            ),
            delivery_pool_waiting=Gauge(
                "opledger_delivery_pool_waiting_deliveries",
                "Due webhook deliveries waiting for a connection now, on this worker: nothing "
                "recorded for them, no attempt spent (decision 026).",
                registry=registry,
            ),
            confirmation_to_ack_seconds=Histogram(
                "opledger_delivery_confirmation_to_ack_seconds",
                "Time from the execution's SUCCEEDED to the delivery's acknowledgement.",
                ["destination"],
                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200),
                registry=registry,
            ),
            dead_lettered_deliveries=Gauge(
                "opledger_dead_lettered_deliveries",
                "Deliveries dead-lettered now (waiting for a redrive), by destination, on this "
                "worker's partitions.",
                ["destination"],
                registry=registry,
            ),
            delivery_redrives=Counter(
                "opledger_delivery_redrives_total",
                "Dead-lettered deliveries sent again by a person (opledger deliveries redrive).",
                registry=registry,
            ),
            delivery_pass_seconds=Histogram(
                "opledger_delivery_pass_seconds",
                "Time of one delivery pass (outbox, due deliveries, sends, records).",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )
