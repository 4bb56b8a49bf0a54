"""The two state machines, as explicit transition tables.

Enum symbols mirror ``schemas/*.avsc`` exactly (a unit test proves it): the Avro files are the
source of truth and these enums follow them.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType


class ExecutionState(StrEnum):
    INTENT_RECORDED = "INTENT_RECORDED"
    DISPATCHED = "DISPATCHED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    # Contact was lost after dispatch: neither a failure nor permission to retry.
    UNKNOWN = "UNKNOWN"


class DeliveryState(StrEnum):
    PENDING = "PENDING"
    SENT = "SENT"
    ACKED = "ACKED"
    DEAD_LETTERED = "DEAD_LETTERED"


_X = ExecutionState
_D = DeliveryState

#: Where an execution may go from each state. INTENT_RECORDED -> FAILED is a refusal before any
#: provider call (policy, validation). UNKNOWN leaves only through reconciliation: the provider
#: says what happened (SUCCEEDED/FAILED), or policy explicitly allows a new attempt (DISPATCHED).
EXECUTION_TRANSITIONS: Mapping[ExecutionState, frozenset[ExecutionState]] = MappingProxyType(
    {
        _X.INTENT_RECORDED: frozenset({_X.DISPATCHED, _X.FAILED}),
        _X.DISPATCHED: frozenset({_X.SUCCEEDED, _X.FAILED, _X.UNKNOWN}),
        _X.UNKNOWN: frozenset({_X.SUCCEEDED, _X.FAILED, _X.DISPATCHED}),
        _X.SUCCEEDED: frozenset(),
        _X.FAILED: frozenset(),
    }
)
EXECUTION_INITIAL: frozenset[ExecutionState] = frozenset({_X.INTENT_RECORDED})

#: Where a delivery may go from each state. SENT -> PENDING schedules a retry of the *delivery*
#: (never of the execution); ACKED is reachable only from SENT. DEAD_LETTERED -> PENDING is a
#: redrive: a person sends a given-up delivery again (an audited event with a reason).
DELIVERY_TRANSITIONS: Mapping[DeliveryState, frozenset[DeliveryState]] = MappingProxyType(
    {
        _D.PENDING: frozenset({_D.SENT, _D.DEAD_LETTERED}),
        _D.SENT: frozenset({_D.ACKED, _D.PENDING, _D.DEAD_LETTERED}),
        _D.ACKED: frozenset(),
        _D.DEAD_LETTERED: frozenset({_D.PENDING}),
    }
)
DELIVERY_INITIAL: frozenset[DeliveryState] = frozenset({_D.PENDING})

EXECUTION_TERMINAL = frozenset(s for s, nxt in EXECUTION_TRANSITIONS.items() if not nxt)
DELIVERY_TERMINAL = frozenset(s for s, nxt in DELIVERY_TRANSITIONS.items() if not nxt)


def execution_predecessors(state: ExecutionState) -> frozenset[ExecutionState]:
    """States from which ``state`` may be entered (the SQL guard uses this)."""
    return frozenset(s for s, nxt in EXECUTION_TRANSITIONS.items() if state in nxt)


def delivery_predecessors(state: DeliveryState) -> frozenset[DeliveryState]:
    """States from which ``state`` may be entered (the SQL guard uses this)."""
    return frozenset(s for s, nxt in DELIVERY_TRANSITIONS.items() if state in nxt)
