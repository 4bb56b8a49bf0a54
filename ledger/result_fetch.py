"""Results delivered by reference: the URL a delivery names and the signed ``GET`` a destination
fetches it with (decision 015).

A webhook delivery whose result is over the inline limit carries ``result_url`` instead of the
result. The destination fetches it from the delivery workers, signing its request the Standard
Webhooks way with the destination's own ``whsec_`` secret, the one that signs its deliveries:
``webhook-id`` is the delivery's (``<operation_id>:<destination>``) and the signed text is the
request's target, so a signature answers for one operation, one destination and one tenant,
for five minutes. The sender and the receiver both build that text with :func:`fetch_target`,
never from a URL as received.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from urllib.parse import urlencode

from standardwebhooks import Webhook, WebhookVerificationError

RESULTS_PATH = "/results/"
#: The largest result a destination fetches: the result store's own bound.
MAX_RESULT_BYTES = 16 * 1024 * 1024


def fetch_target(tenant_id: str, destination: str, operation_id: str) -> str:
    """The path and query of one result's ``GET``: what the URL ends with and what is signed."""
    return f"{RESULTS_PATH}{operation_id}?" + urlencode(
        {"tenant": tenant_id, "destination": destination}
    )


def result_url(base_url: str, tenant_id: str, destination: str, operation_id: str) -> str:
    return base_url.rstrip("/") + fetch_target(tenant_id, destination, operation_id)


def _signed_text(tenant_id: str, destination: str, operation_id: str) -> str:
    return "GET " + fetch_target(tenant_id, destination, operation_id)


def sign_fetch(
    secrets: Sequence[str], tenant_id: str, destination: str, operation_id: str, now: datetime
) -> dict[str, str]:
    """The ``webhook-*`` headers of one fetch, signed with each of ``secrets`` (a receiver that
    is rotating its secret does not know which one the ledger holds: Standard Webhooks lets one
    header carry several signatures)."""
    if not secrets:
        raise ValueError("a fetch is signed with at least one secret")
    msg_id = f"{operation_id}:{destination}"
    text = _signed_text(tenant_id, destination, operation_id)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": " ".join(Webhook(s).sign(msg_id, now, text) for s in secrets),
    }


def fetch_signed(
    secret: str,
    headers: Mapping[str, str],
    tenant_id: str,
    destination: str,
    operation_id: str,
) -> bool:
    """Whether ``headers`` sign a fetch of this result with ``secret``, within the library's
    five minutes. Anything malformed is simply not signed."""
    msg_id = headers.get("webhook-id")
    timestamp = headers.get("webhook-timestamp")
    signature = headers.get("webhook-signature")
    if msg_id != f"{operation_id}:{destination}" or not timestamp or not signature:
        return False
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        return False  # the library signs float(timestamp): only plain seconds are compared
    text = _signed_text(tenant_id, destination, operation_id)
    checked = {"webhook-id": msg_id, "webhook-timestamp": timestamp, "webhook-signature": signature}
    try:
        Webhook(secret).verify(text, checked, json_parse=False)
    except (WebhookVerificationError, ValueError):  # ValueError covers bad base64 too
        return False
    return True
