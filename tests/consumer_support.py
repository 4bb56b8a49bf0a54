"""Building what a delivery worker sends to a consumer (tests only): a ``POST /events`` body and
its Standard Webhooks headers, signed with ``standardwebhooks`` itself, and a queue record."""

from __future__ import annotations

import base64
import os
import time
from datetime import UTC, datetime

from standardwebhooks import Webhook

from ledger.domain.ids import canonical_json, content_ref, operation_id

#: A test secret (32 bytes of key), the form OPLEDGER_CONSUMER_SECRETS takes.
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(bytes(range(100, 132))).decode()
DESTINATION = "webhook:crm"


def new_op_id() -> str:
    return operation_id(int(time.time() * 1000), os.urandom(10))


def event_body(
    op_id: str,
    *,
    tenant: str = "acme",
    tool: str = "send_email",
    destination: str = DESTINATION,
    result: bytes = b'{"status":"sent"}',
    content_type: str = "application/json",
) -> bytes:
    """The JSON body the delivery worker sends (canonical JSON, UTF-8)."""
    return canonical_json(
        {
            "operation_id": op_id,
            "tenant_id": tenant,
            "tool_name": tool,
            "destination": destination,
            "result_ref": content_ref(result),
            "content_type": content_type,
            "result_b64": base64.b64encode(result).decode(),
        }
    )


def sign(body: bytes, webhook_id: str, timestamp: int, secret: str = SECRET) -> str:
    when = datetime.fromtimestamp(timestamp, tz=UTC)
    return Webhook(secret).sign(webhook_id, when, body.decode("utf-8"))


def signed_headers(
    op_id: str,
    body: bytes,
    *,
    destination: str = DESTINATION,
    secret: str = SECRET,
    timestamp: int | None = None,
    quoted: bool = True,
) -> dict[str, str]:
    """Every header of a correct request for ``body``."""
    when = int(time.time()) if timestamp is None else timestamp
    webhook_id = f"{op_id}:{destination}"
    return {
        "Content-Type": "application/json",
        "Idempotency-Key": f'"{op_id}"' if quoted else op_id,
        "webhook-id": webhook_id,
        "webhook-timestamp": str(when),
        "webhook-signature": sign(body, webhook_id, when, secret),
    }
