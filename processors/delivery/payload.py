"""What a destination receives: the body of ``POST /events`` (and of a queue record) and its
headers, Standard Webhooks signing included.

The body is canonical JSON of values that never change between sends (the operation, the
destination, the stored result or, over the inline limit, where to fetch it: decision 015), so
every send of one delivery carries the very same bytes: a receiver that fingerprints the raw
body sees a retry as the same request.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from standardwebhooks import Webhook

from ledger.domain.ids import canonical_json

IDEMPOTENCY_HEADER = "Idempotency-Key"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One result on its way to one destination."""

    operation_id: str
    tenant_id: str
    tool_name: str
    destination: str
    result_ref: str
    content_type: str
    result: bytes
    #: Set when the result is too large to carry: the body names where to fetch it instead.
    result_url: str | None = None

    @property
    def webhook_id(self) -> str:
        """Standard Webhooks' message id: stable across every send of this delivery."""
        return f"{self.operation_id}:{self.destination}"

    def body(self) -> bytes:
        fields: dict[str, str | int] = {
            "operation_id": self.operation_id,
            "tenant_id": self.tenant_id,
            "tool_name": self.tool_name,
            "destination": self.destination,
            "result_ref": self.result_ref,
            "content_type": self.content_type,
        }
        if self.result_url is None:
            fields["result_b64"] = base64.b64encode(self.result).decode("ascii")
        else:
            # By reference (decision 015): the URL and size never change between sends, so
            # every send still carries the very same bytes.
            fields["result_url"] = self.result_url
            fields["result_size"] = len(self.result)
        return canonical_json(fields)


@functools.lru_cache(maxsize=1024)
def _signer(secret: str) -> Webhook:
    # Decoding the secret costs more than the HMAC; a worker sends to few destinations.
    return Webhook(secret)


def webhook_headers(
    delivery: Delivery, body: bytes, secret: str, now: datetime, *, also: Sequence[str] = ()
) -> dict[str, str]:
    """The headers of one webhook send, signed over ``body`` with the destination's secret and
    with each of ``also`` (a rotated-out secret during its overlap): Standard Webhooks puts the
    signatures side by side, space-separated, and a receiver accepts any one it can verify."""
    text = body.decode("utf-8")
    signature = " ".join(
        _signer(key).sign(delivery.webhook_id, now, text) for key in (secret, *also)
    )
    return {
        "Content-Type": "application/json",
        IDEMPOTENCY_HEADER: delivery.operation_id,
        "webhook-id": delivery.webhook_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }


def queue_headers(delivery: Delivery) -> list[tuple[str, bytes]]:
    """The headers of a queue record (its key is the operation id)."""
    return [
        (IDEMPOTENCY_HEADER, delivery.operation_id.encode("ascii")),
        ("webhook-id", delivery.webhook_id.encode("utf-8")),
        ("content-type", b"application/json"),
    ]
