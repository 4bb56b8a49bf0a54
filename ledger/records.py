"""Values that cross between the Kafka edge and the PostgreSQL edge, and the port the projector
writes through. Defined here, in the shared kernel, so ``processors`` (which reads Kafka) and
``projections`` (which owns the tables) never import each other; ``opledger`` wires them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ledger.domain.events import Transition


@dataclass(frozen=True, slots=True, order=True)
class Coordinates:
    """Where a record sits in Kafka: the identity auditors replay by."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class SourcedEvent:
    """A decoded, validated event and where it was read from."""

    coordinates: Coordinates
    event: Transition
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be decoded; its reason travels to the dead-letter topic."""

    coordinates: Coordinates
    reason: str
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class ProjectionBatch:
    """One poll's worth of records, in partition-offset order.

    ``next_offsets`` holds, per (topic, partition) in the batch, the offset after the last record
    read; the sink commits it with the rows so the batch is applied exactly once.
    """

    events: Sequence[SourcedEvent]
    dead_letters: Sequence[DeadLetter]
    next_offsets: Mapping[tuple[str, int], int]


@dataclass(slots=True)
class ProjectionReport:
    """What one batch did, for metrics and logs."""

    applied: dict[str, int] = field(default_factory=lambda: {"execution": 0, "delivery": 0})
    duplicates: dict[str, int] = field(default_factory=lambda: {"execution": 0, "delivery": 0})
    anomalies: dict[str, int] = field(default_factory=lambda: {"execution": 0, "delivery": 0})
    dead_letters: int = 0
    skipped_redelivered: int = 0


@dataclass(frozen=True, slots=True)
class OpenAges:
    """How long the oldest unfinished work has waited, from the projections.

    ``executions`` maps a non-terminal execution state to the age in seconds of its oldest
    operation; ``deliveries`` maps (destination, non-terminal state) likewise. What a heartbeat
    cannot show: a worker can be alive while UNKNOWN operations or PENDING deliveries pile up.
    """

    executions: Mapping[str, float]
    deliveries: Mapping[tuple[str, str], float]


class ProjectionSink(Protocol):
    """Where the projector folds batches; implemented over PostgreSQL in ``projections``."""

    def positions(self, consumer: str, topics: Sequence[str]) -> dict[tuple[str, int], int]:
        """Next offset to read per (topic, partition), as committed with the projections."""
        ...

    def project(self, consumer: str, batch: ProjectionBatch) -> ProjectionReport:
        """Fold the batch and commit rows and offsets in one transaction."""
        ...

    def open_ages(self) -> OpenAges:
        """Age of the oldest operation in each non-terminal state (see :class:`OpenAges`)."""
        ...
