"""A rotated-out secret signs next to the new one during its overlap, and only then (decision
021): pure, no stack."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from standardwebhooks import Webhook

from ledger.destinations import Destination, Kind, new_secret
from processors.delivery.payload import Delivery, webhook_headers

NOW = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)


def _destination(until: datetime | None) -> Destination:
    return Destination(
        tenant_id="acme",
        name="hooks",
        kind=Kind.WEBHOOK,
        target="https://example.com/events",
        tools=("*",),
        timeout_ms=1000,
        enabled=True,
        disabled_reason=None,
        secret="whsec_" + "A" * 32,
        previous_secret=None if until is None else "whsec_" + "B" * 32,
        previous_secret_until=until,
    )


def test_the_previous_secret_signs_until_its_overlap_ends_and_never_shows() -> None:
    rotated = _destination(NOW + timedelta(hours=1))
    assert rotated.signing_secrets(NOW) == (rotated.secret, rotated.previous_secret)
    assert rotated.signing_secrets(NOW + timedelta(hours=1)) == (rotated.secret,)
    assert _destination(None).signing_secrets(NOW) == (rotated.secret,)
    assert "whsec_" not in repr(rotated)


def test_a_send_signed_with_both_verifies_with_either_secret_alone() -> None:
    old, new = new_secret(), new_secret()
    delivery = Delivery("op_1", "acme", "send_email", "hooks", "sha256:x", "text/plain", b"hi")
    body = delivery.body()
    headers = webhook_headers(delivery, body, new, datetime.now(UTC), also=(old,))
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        Webhook(secret).verify(body, headers)
    alone = webhook_headers(delivery, body, new, datetime.now(UTC))
    assert " " not in alone["webhook-signature"]
