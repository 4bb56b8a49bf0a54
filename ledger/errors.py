"""The errors of appending to the ledger. Every failure a caller must handle is a
:class:`RecordError`, so a worker can catch one type around "record, then acknowledge my job" and
know nothing was acknowledged. The SDK (``producers``) re-exports them."""

from __future__ import annotations

from typing import Any, Self


class RecordError(Exception):
    """A transition was not recorded (or its outcome is unknown); do not acknowledge the job.

    Raised by a call that began an operation, it says what the log holds for the operation and
    what happens to it next (:meth:`tell`), in its message and as attributes."""

    #: the operation the error is about, once the SDK knows it (a call that made its own id)
    operation_id: str | None = None
    #: what the log holds for the operation, as far as the raising process knows
    log_holds: str | None = None
    #: what will happen to the operation, and what the caller should do
    next_step: str | None = None

    def tell(self, operation_id: str, holds: str, next_step: str) -> Self:
        """Add what the log holds and what happens next (once: the first teller knows most)."""
        if self.log_holds is None:
            self.operation_id = operation_id
            self.log_holds = holds
            self.next_step = next_step
            said = str(self.args[0]).rstrip(". ") if self.args else type(self).__name__
            self.args = (f"{said}. The log holds {holds}: {next_step}", *self.args[1:])
        return self


class IllegalTransitionError(RecordError, ValueError):
    """The state machine refuses this transition; nothing was sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConflictError(IllegalTransitionError):
    """Another event already recorded this step of the operation (another writer, or a new event
    where a resend of the in-doubt one was due); nothing was sent."""


class InvalidTransitionError(RecordError, ValueError):
    """The arguments cannot make a valid event (bad id, missing error text...); nothing was sent."""


class DeliveryError(RecordError):
    """The broker refused or never acknowledged a record: its outcome is unknown.

    ``kafka_error`` is the first ``confluent_kafka.KafkaError`` reported (``None`` when the SDK
    gave up waiting before librdkafka reported anything). ``handles`` holds, by operation id,
    every handle whose append failed; each is now *in doubt* and accepts only
    ``recorder.resend(handle)``.
    """

    def __init__(self, message: str, kafka_error: object | None = None) -> None:
        super().__init__(message)
        self.kafka_error = kafka_error
        #: operation id -> the SDK handle (a producers.operation.TrackedOperation) now in doubt
        self.handles: dict[str, Any] = {}

    @property
    def handle(self) -> Any:
        """The one in-doubt handle of a single-operation call."""
        if len(self.handles) != 1:
            raise ValueError(f"{len(self.handles)} handles are in doubt; use .handles")
        return next(iter(self.handles.values()))


class RecordTooLargeError(RecordError, ValueError):
    """A record is larger than the producer may send (``ledger.kafka.MESSAGE_MAX_BYTES``, key,
    value and headers together); nothing was sent. Sending it again cannot succeed."""


class DeliveryTimeoutError(DeliveryError):
    """No acknowledgement within the delivery timeout. The record may still have been written:
    the outcome is unknown, so resend the same event (``recorder.resend(handle)``); a repeat is
    recognised by its event id and harmless."""


class InDoubtError(RecordError):
    """The handle's last append may or may not be recorded; only resending it is allowed.

    Resending the identical event is safe (a repeat is recognised by its event id); any other
    step could contradict what is already on the topic, so the recorder refuses it.
    """

    def __init__(self, message: str, handle: Any) -> None:
        super().__init__(message)
        self.handle = handle


class LeaseLostError(RecordError):
    """This process does not (or no longer) hold the operation's lease: another may own it now.
    Nothing was sent; take the operation over again (``take_over``) to continue it."""


class UnknownToolError(RecordError, ValueError):
    """No provider is registered for the tool; nothing was recorded."""


class ResultStoreError(RecordError):
    """A result payload could not be stored or is not acceptable (size, content type, tenant)."""


class RecorderClosedError(RecordError):
    """The recorder was closed (or is closing) before this call began; nothing was recorded.
    Use a recorder that is open: connect a new one."""


class ForkedRecorderError(RecordError):
    """The recorder was created in another process and this one is a fork of it; nothing was
    recorded. Its Kafka producer and PostgreSQL connections belong to the parent (a child using
    them would hang or corrupt the parent's sessions): create a recorder in each process."""
