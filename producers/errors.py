"""The SDK's errors. Every failure a caller must handle is a :class:`RecordError`, so a worker can
catch one type around "record, then acknowledge my job" and know nothing was acknowledged."""

from __future__ import annotations


class RecordError(Exception):
    """A transition was not recorded (or its outcome is unknown); do not acknowledge the job."""


class IllegalTransitionError(RecordError, ValueError):
    """The state machine refuses this transition; nothing was sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidTransitionError(RecordError, ValueError):
    """The arguments cannot make a valid event (bad id, missing error text...); nothing was sent."""


class DeliveryError(RecordError):
    """The broker refused or never acknowledged a record.

    ``kafka_error`` is the first ``confluent_kafka.KafkaError`` reported (``None`` when the SDK
    gave up waiting before librdkafka reported anything).
    """

    def __init__(self, message: str, kafka_error: object | None = None) -> None:
        super().__init__(message)
        self.kafka_error = kafka_error


class DeliveryTimeoutError(DeliveryError):
    """No acknowledgement within the delivery timeout. The record may still have been written:
    the outcome is unknown, so retry the same call (the fold makes a repeat harmless)."""


class ResultStoreError(RecordError):
    """A result payload could not be stored or is not acceptable (size, content type, tenant)."""
