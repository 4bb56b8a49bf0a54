"""The producer SDK: what a service calls to record its operations' transitions.

A service records each step of an operation - ``intent``, ``dispatched``, ``succeeded`` /
``failed`` / ``unknown``, and per destination ``delivery_pending`` ... ``delivery_acked`` -
through a :class:`TransitionRecorder`. Each call is checked against the state machines before
anything is sent (:class:`IllegalTransitionError`), repeats are recognised and not sent twice,
and a call returns only once the broker has acknowledged the record, so a worker can acknowledge
its own job right after. Result payloads go to the :class:`ResultStore` (durable first); events
carry only their ``sha256:`` reference.

    with TransitionRecorder.connect(settings) as recorder:
        op = recorder.intent("tenant-1", "agent-7", "send_email", {"to": "a@example.com"})
        recorder.dispatched(op, provider_ref="msg-123")
        recorder.succeeded(op, b'{"status": "sent"}', content_type="application/json")
        recorder.delivery_pending(op, "https://hooks.example.com/events")

The everyday form runs the whole tool call, threaded or asyncio (``producers.execution``):

    done = recorder.execute("tenant-1", "agent-7", "send_email", {"to": "a@example.com"})
    done = await async_recorder.execute("tenant-1", "agent-7", "send_email", {"to": "a@..."})
"""

from ledger.errors import (
    ConflictError,
    DeliveryError,
    DeliveryTimeoutError,
    ForkedRecorderError,
    IllegalTransitionError,
    InDoubtError,
    InvalidTransitionError,
    LeaseLostError,
    RecorderClosedError,
    RecordError,
    ResultStoreError,
    UnknownToolError,
)
from ledger.kafka import producer_config
from ledger.log import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    KafkaTransport,
    OutgoingRecord,
    Transport,
)
from ledger.results import MAX_RESULT_BYTES, ResultStore
from producers.aio import AsyncTransitionRecorder
from producers.execution import Execution
from producers.operation import OperationState, TrackedOperation
from producers.planner import clean_error
from producers.recorder import TransitionRecorder

__all__ = [
    "DEFAULT_DELIVERY_TIMEOUT_S",
    "MAX_RESULT_BYTES",
    "AsyncTransitionRecorder",
    "ConflictError",
    "DeliveryError",
    "DeliveryTimeoutError",
    "Execution",
    "ForkedRecorderError",
    "IllegalTransitionError",
    "InDoubtError",
    "InvalidTransitionError",
    "KafkaTransport",
    "LeaseLostError",
    "OperationState",
    "OutgoingRecord",
    "RecordError",
    "RecorderClosedError",
    "ResultStore",
    "ResultStoreError",
    "TrackedOperation",
    "TransitionRecorder",
    "Transport",
    "UnknownToolError",
    "clean_error",
    "producer_config",
]
