"""What the demo reads after (and while waiting for) the run, and the invariants it checks.

Two sources, kept apart: the *projections* (what the ledger says happened) and the *outside
world* (the fake provider's own count of calls and side effects per idempotency key, and the
consumers' applied changes). :func:`failures` is pure: it judges an :class:`Observed`, so a test
can hand it a double side effect and see it fail.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ledger import pg
from ledger.settings import Settings
from opledger.demo.plan import QUEUE, TENANTS, WEBHOOK, Call, routed
from opledger.fakes.model import KeyStats

FINAL = frozenset({"SUCCEEDED", "FAILED"})
DELIVERED = frozenset({"ACKED", "DEAD_LETTERED"})

_OPS_SQL = """
SELECT operation_id, tenant_id, actor_id, tool_name, execution_state, attempt, parked,
       decision, error
  FROM agent_operations
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
"""
_DELIVERIES_SQL = """
SELECT operation_id, tenant_id, destination, state, attempts, error
  FROM deliveries
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
"""
_DECISIONS_SQL = """
SELECT operation_id, decision, lookup, reason
  FROM reconciliations
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
 ORDER BY occurred_at, "offset"
"""
#: Events folded per state machine and outcome (applied, duplicate: a repeat recognised).
_OUTCOMES_SQL = """
SELECT machine, outcome, count(*)
  FROM operation_history
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
 GROUP BY 1, 2
"""
#: Operations that went UNKNOWN at some point (lost contact, or a dispatch nobody finished).
_WENT_UNKNOWN_SQL = """
SELECT count(DISTINCT operation_id)
  FROM operation_history
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
   AND machine = 'execution' AND state = 'UNKNOWN' AND outcome = 'applied'
"""
_ANOMALIES_SQL = """
SELECT kind, count(*)
  FROM anomalies
 WHERE tenant_id = ANY(%(tenants)s) AND operation_id = ANY(%(ops)s)
 GROUP BY 1
"""
#: The consumers' own record of what they applied (one row per applied change, by design not
#: unique: a duplicate the inbox let through would show here as a second row).
_APPLIED_SQL = """
SELECT consumer, operation_id, count(*), max(result_bytes)
  FROM consumer_applied_changes
 WHERE operation_id = ANY(%(ops)s)
 GROUP BY 1, 2
"""
#: Results over the inline limit: their deliveries went by reference (decisions 015, 016: the
#: demo's queue has a fetch secret).
_LARGE_RESULTS_SQL = """
SELECT o.operation_id, octet_length(r.payload)
  FROM agent_operations o
  JOIN results r ON r.tenant_id = o.tenant_id AND r.result_ref = o.result_ref
 WHERE o.tenant_id = ANY(%(tenants)s) AND o.operation_id = ANY(%(ops)s)
   AND octet_length(r.payload) > %(inline_max)s
"""


@dataclass(frozen=True, slots=True)
class OpRow:
    operation_id: str
    tenant_id: str
    actor_id: str
    tool_name: str
    state: str
    attempt: int
    #: why it waits for a person (REFUSE, PARK), else None
    parked: str | None = None
    decision: str | None = None
    error: str | None = None

    @property
    def refused_at_dispatch(self) -> bool:
        """FAILED before any attempt: policy refused the dispatch, no call was made."""
        return self.state == "FAILED" and self.attempt == 0

    @property
    def settled(self) -> bool:
        return self.state in FINAL or self.parked is not None


@dataclass(frozen=True, slots=True)
class DeliveryRow:
    operation_id: str
    tenant_id: str
    destination: str
    state: str
    attempts: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Decided:
    operation_id: str
    decision: str
    lookup: str
    reason: str


@dataclass(frozen=True, slots=True)
class Observed:
    """One reading of the projections and the outside world, for this run's operations."""

    #: every operation a service announced (printed before calling), with its call
    announced: Mapping[str, Call]
    #: the announced operations as the projection holds them (absent: not projected)
    ops: Mapping[str, OpRow]
    deliveries: Sequence[DeliveryRow]
    decisions: Sequence[Decided]
    #: the provider's own counts per idempotency key (= operation id); absent: never called
    provider: Mapping[str, KeyStats]
    #: (consumer, operation id) -> changes the consumer applied
    applied: Mapping[tuple[str, str], int]
    #: destination -> the consumer that applies what is delivered there
    consumers: Mapping[str, str]
    #: records on the topics the projector has not folded yet
    behind: int = 0
    #: (machine, outcome) -> events folded
    outcomes: Mapping[tuple[str, str], int] = field(default_factory=dict)
    went_unknown: int = 0
    anomalies: Mapping[str, int] = field(default_factory=dict)
    #: operation id -> the size of its stored result, for results over the inline limit
    large_results: Mapping[str, int] = field(default_factory=dict)
    #: (consumer, operation id) -> the size of the result the consumer applied
    applied_bytes: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def new_attempts(self) -> Counter[str]:
        """Calls reconciliation allowed beyond the first, per operation."""
        return Counter(d.operation_id for d in self.decisions if d.decision == "NEW_ATTEMPT")

    def max_side_effects(self) -> int:
        return max(
            (self.provider[op].side_effects for op in self.announced if op in self.provider),
            default=0,
        )

    def max_applied(self) -> int:
        return max(self.applied.values(), default=0)

    def by_reference(self) -> list[tuple[str, str]]:
        """(consumer, operation id) of every acknowledged delivery of a large result: the ones
        that went by reference (to the webhook, and to the queue, which has a fetch secret)."""
        return sorted(
            (consumer, d.operation_id)
            for d in self.deliveries
            if d.state == "ACKED"
            and d.destination in (WEBHOOK, QUEUE)
            and d.operation_id in self.large_results
            and (consumer := self.consumers.get(d.destination)) is not None
        )


def unsettled(observed: Observed) -> list[str]:
    """What is not finished yet (empty: every operation final or parked, every delivery ACKED
    or DEAD_LETTERED, every acknowledged delivery applied, the projector caught up)."""
    waiting: list[str] = []
    missing = _lost(observed)
    if missing:
        waiting.append(f"{len(missing)} operations not projected yet")
    open_ops = Counter(r.state for r in observed.ops.values() if not r.settled)
    if open_ops:
        waiting.append(f"operations not final: {_tally(open_ops)}")
    unopened = _unopened(observed)
    if unopened:
        waiting.append(f"{len(unopened)} deliveries the outbox has not opened yet")
    open_deliveries = Counter(d.state for d in observed.deliveries if d.state not in DELIVERED)
    if open_deliveries:
        waiting.append(f"deliveries not final: {_tally(open_deliveries)}")
    unapplied = _unapplied(observed)
    if unapplied:
        waiting.append(f"{len(unapplied)} acknowledged deliveries not applied by a consumer yet")
    if observed.behind:
        waiting.append(f"the projector is {observed.behind} records behind")
    return waiting


def failures(observed: Observed, *, fetched: int | None = None) -> list[str]:
    """Every invariant the run broke, one line each (empty: all held).

    - at most one side effect per operation, as the provider counted it (a non-idempotent tool
      counts every call, so any second call shows);
    - no call beyond the first unless reconciliation recorded a NEW_ATTEMPT for it (nothing on
      the delivery path ever calls the tool);
    - at most one applied change per operation at each consumer, and every acknowledged
      delivery applied;
    - no operation lost or left unfinished, no delivery left open; the projections agree with
      the provider (SUCCEEDED: one side effect, FAILED: none);
    - every result over the inline limit went by reference (the consumers counted at least
      that many ``fetched`` between them) and was applied whole.
    """
    found: list[str] = []
    for op in observed.announced:
        counts = observed.provider.get(op, KeyStats())
        if counts.side_effects > 1:
            found.append(
                f"{op} ({observed.announced[op].tool_name}): the provider performed its side "
                f"effect {counts.side_effects} times"
            )
    found.extend(excess_calls(observed))
    found.extend(disagreements(observed))
    for (consumer, op), applied in sorted(observed.applied.items()):
        if applied > 1:
            found.append(f"{op}: consumer {consumer} applied it {applied} times")
    for consumer, op in _unapplied(observed):
        found.append(f"{op}: delivery acknowledged, but consumer {consumer} never applied it")
    found.extend(truncated(observed))
    by_reference = len(observed.by_reference())
    if fetched is not None and fetched < by_reference:
        found.append(
            f"{by_reference} results were over the inline limit, but the consumers fetched only "
            f"{fetched} by reference: the others were not delivered by reference"
        )
    lost = _lost(observed)
    if lost:
        found.append(f"{len(lost)} operations lost: announced, never projected ({_some(lost)})")
    stuck = sorted(op for op, row in observed.ops.items() if not row.settled)
    if stuck:
        found.append(f"{len(stuck)} operations never finished nor parked ({_some(stuck)})")
    unopened = _unopened(observed)
    if unopened:
        found.append(f"{len(unopened)} deliveries never opened ({_some(unopened)})")
    stuck_deliveries = sorted(
        f"{d.operation_id}/{d.destination}" for d in observed.deliveries if d.state not in DELIVERED
    )
    if stuck_deliveries:
        found.append(f"{len(stuck_deliveries)} deliveries never final ({_some(stuck_deliveries)})")
    if observed.behind:
        found.append(f"the projector is still {observed.behind} records behind")
    return found


def truncated(observed: Observed) -> list[str]:
    """Results delivered by reference that a consumer applied with another size than stored."""
    return [
        f"{op}: consumer {consumer} applied {observed.applied_bytes[(consumer, op)]} bytes of a "
        f"{observed.large_results[op]}-byte result delivered by reference"
        for consumer, op in observed.by_reference()
        if (consumer, op) in observed.applied_bytes
        and observed.applied_bytes[(consumer, op)] != observed.large_results[op]
    ]


def excess_calls(observed: Observed) -> list[str]:
    """Operations the provider saw more calls for than reconciliation allowed (one, plus one per
    NEW_ATTEMPT): a blind retry, or a delivery that reached the tool."""
    allowed = observed.new_attempts()
    return [
        f"{op} ({call.tool_name}): the provider was called {counts.calls} times, but "
        f"reconciliation allowed {1 + allowed[op]}"
        for op, call in observed.announced.items()
        if (counts := observed.provider.get(op, KeyStats())).calls > 1 + allowed[op]
    ]


def disagreements(observed: Observed) -> list[str]:
    """Operations whose final state the provider contradicts: SUCCEEDED must have exactly one
    side effect, FAILED none."""
    wanted = {"SUCCEEDED": 1, "FAILED": 0}
    return [
        f"{op}: {row.state} in the projection, but the provider performed its side effect "
        f"{effects} times"
        for op, row in observed.ops.items()
        if row.state in wanted
        and (effects := observed.provider.get(op, KeyStats()).side_effects) != wanted[row.state]
    ]


def lost_or_unfinished(observed: Observed) -> int:
    return len(_lost(observed)) + sum(1 for row in observed.ops.values() if not row.settled)


def _lost(observed: Observed) -> list[str]:
    return sorted(op for op in observed.announced if op not in observed.ops)


def _unopened(observed: Observed) -> list[str]:
    have = {(d.operation_id, d.destination) for d in observed.deliveries}
    return sorted(
        f"{op}/{destination}"
        for op, row in observed.ops.items()
        if row.state == "SUCCEEDED"
        for destination in routed(row.tenant_id, row.tool_name)
        if (op, destination) not in have
    )


def _unapplied(observed: Observed) -> list[tuple[str, str]]:
    return sorted(
        (consumer, d.operation_id)
        for d in observed.deliveries
        if d.state == "ACKED"
        and (consumer := observed.consumers.get(d.destination)) is not None
        and observed.applied.get((consumer, d.operation_id), 0) == 0
    )


def _tally(counts: Counter[str]) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def _some(items: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


# -- reading ------------------------------------------------------------------------------------


def read(
    settings: Settings,
    announced: Mapping[str, Call],
    consumers: Mapping[str, str],
    provider: Mapping[str, KeyStats],
    behind: int,
) -> Observed:
    """The projections and the consumers' tables for ``announced``, with the given outside
    counts (the caller fetches the provider's stats and the projector's lag)."""
    params: dict[str, Any] = {
        "tenants": list(TENANTS),
        "ops": list(announced),
        "inline_max": settings.delivery_inline_max_bytes,
    }
    with pg.connect(settings.dsn, name="opledger-demo", read_only=True) as conn:
        ops = {r[0]: OpRow(*r) for r in conn.execute(_OPS_SQL, params).fetchall()}
        deliveries = [DeliveryRow(*r) for r in conn.execute(_DELIVERIES_SQL, params).fetchall()]
        decisions = [Decided(*r) for r in conn.execute(_DECISIONS_SQL, params).fetchall()]
        outcomes = {(m, o): n for m, o, n in conn.execute(_OUTCOMES_SQL, params).fetchall()}
        unknown_row = conn.execute(_WENT_UNKNOWN_SQL, params).fetchone()
        anomalies: dict[str, int] = dict(conn.execute(_ANOMALIES_SQL, params).fetchall())
        large: dict[str, int] = dict(conn.execute(_LARGE_RESULTS_SQL, params).fetchall())
    applied = read_applied(settings, list(announced))
    return Observed(
        announced=announced,
        ops=ops,
        deliveries=deliveries,
        decisions=decisions,
        provider={op: provider[op] for op in announced if op in provider},
        applied={key: count for key, (count, _size) in applied.items()},
        consumers=consumers,
        behind=behind,
        outcomes=outcomes,
        went_unknown=int(unknown_row[0]) if unknown_row else 0,
        anomalies=anomalies,
        large_results=large,
        applied_bytes={key: size for key, (_count, size) in applied.items()},
    )


def read_applied(settings: Settings, ops: list[str]) -> dict[tuple[str, str], tuple[int, int]]:
    """(consumer, operation id) -> (changes applied, the largest result applied)."""
    try:
        with pg.connect(settings.consumer_dsn, name="opledger-demo", read_only=True) as conn:
            rows = conn.execute(_APPLIED_SQL, {"ops": ops}).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}  # no consumer has started yet: nothing applied
    return {(consumer, op): (n, size) for consumer, op, n, size in rows}
