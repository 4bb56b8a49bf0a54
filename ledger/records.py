"""Values that cross between the Kafka edge and the PostgreSQL edge, and the port the projector
writes through. Defined here, in the shared kernel, so ``processors`` (which reads Kafka) and
``projections`` (which owns the tables) never import each other; ``opledger`` wires them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ledger.domain.events import OperationEvent, PolicyChanged


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
    event: OperationEvent
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class SourcedPolicyChange:
    """A decoded policy change from the policy topic, keyed by its subject, and where it was
    read from (policy_history keeps these coordinates: the audit trail outlives compaction)."""

    coordinates: Coordinates
    event: PolicyChanged
    timestamp_ms: int


class SinkUnavailableError(RuntimeError):
    """The sink could not be reached or was interrupted (a restart, a lost connection, a
    concurrent writer): nothing of the batch is stored, and the same batch may be tried again."""


class RecordRefusedError(RuntimeError):
    """The sink refused to store something in the batch (a value it cannot hold, a constraint):
    trying again would fail again, so the culprit must be found and set aside."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be decoded or stored; its reason travels to the dead-letter
    topic, with the record itself or, when the record is too large to republish, a reference to
    it (``by_reference``)."""

    coordinates: Coordinates
    reason: str
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    by_reference: bool = False
    #: size of the original record's value (``value`` holds the reference when by_reference)
    size_bytes: int | None = None
    #: the record's own headers, republished with it (a redrive gives them back)
    headers: tuple[tuple[str, bytes | None], ...] = ()


@dataclass(frozen=True, slots=True)
class ProjectionBatch:
    """One poll's worth of records, in partition-offset order.

    ``next_offsets`` holds, per (topic, partition) in the batch, the offset after the last record
    read; the sink commits it with the rows so the batch is applied exactly once.

    ``execution_topic`` and ``execution_end`` let the sink tell a delivery whose execution is
    not projected *yet* from one whose execution does not exist: ``execution_end(p)`` is the
    current end offset of partition ``p`` of the execution topic, asked when needed. Anything
    that caused a delivery was appended before it, so below that end.
    """

    events: Sequence[SourcedEvent]
    dead_letters: Sequence[DeadLetter]
    next_offsets: Mapping[tuple[str, int], int]
    execution_topic: str = ""
    execution_end: Callable[[int], int] | None = None
    #: policy changes in the batch, in log order; their offsets are in ``next_offsets`` too
    policy_changes: Sequence[SourcedPolicyChange] = ()


@dataclass(slots=True)
class ProjectionReport:
    """What one batch did, for metrics and logs."""

    applied: dict[str, int] = field(
        default_factory=lambda: {"execution": 0, "delivery": 0, "control": 0}
    )
    duplicates: dict[str, int] = field(
        default_factory=lambda: {"execution": 0, "delivery": 0, "control": 0}
    )
    anomalies: dict[str, int] = field(
        default_factory=lambda: {"execution": 0, "delivery": 0, "control": 0}
    )
    dead_letters: int = 0
    skipped_redelivered: int = 0
    #: policy changes folded into the policy tables
    policy_changes: int = 0
    #: why each policy change read but not applied was not (its event id folded already from
    #: another offset: a replayed record), in log order
    policy_stale: list[str] = field(default_factory=list)
    #: (machine, rejection kind) -> anomalies of that kind
    anomaly_kinds: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: dead-lettered deliveries sent again by a person
    redrives: int = 0
    #: (topic, partition) -> offset to read again from: deliveries held back until their
    #: execution is projected (the sink committed that partition only up to there).
    rewind: dict[tuple[str, int], int] = field(default_factory=dict)


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
