"""Standard Webhooks signatures, checked with ``standardwebhooks`` 1.1.0 over the raw body.

What its source (``standardwebhooks/webhooks.py``) does, and what this module adds:

- ``Webhook.verify`` decodes the body as UTF-8 and signs ``f"{id}.{timestamp}.{text}".encode()``:
  for a valid UTF-8 body those are exactly the raw bytes, so the signature covers what was sent.
  A body that is not UTF-8 raises ``UnicodeDecodeError``, not its own error: refused here first.
- It signs ``floor(float(timestamp))``, not the header's text, so ``"0017…"`` or ``"17….5"``
  would be checked over another string than the sender signed: only plain decimal seconds pass.
- Its window is a constant 5 minutes; a tighter ``tolerance_s`` is checked here first.
- A signature entry without a comma (``ValueError`` from unpacking) or with bad base64
  (``binascii.Error``) escapes as a plain exception: both are answered 401 here, not 500.
- It compares with ``hmac.compare_digest`` and accepts any of the space-separated ``v1,``
  entries; several secrets (a rotation) are several ``Webhook`` objects, tried in turn.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence

from standardwebhooks import Webhook, WebhookVerificationError

from consumers.contract import bad_signature, malformed_body, missing_signature, stale_signature

_SECONDS = re.compile(r"[1-9][0-9]{0,11}")
HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


class SignatureVerifier:
    """Checks ``webhook-*`` headers against a body with one or more ``whsec_`` secrets."""

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        tolerance_s: int = 300,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secrets:
            raise ValueError("at least one webhook secret is required")
        self._hooks = [Webhook(secret) for secret in secrets]
        #: what the receiver signs its fetches of results by reference with (decision 015)
        self.secrets = tuple(secrets)
        self._tolerance_s = tolerance_s
        self._clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> str:
        """The ``webhook-id`` of a correctly signed, fresh request; raises
        :class:`~consumers.contract.ProblemError` (401, or 400 for a body that is not UTF-8)."""
        values = {name: headers.get(name) for name in HEADERS}
        missing = [name for name, value in values.items() if not value]
        if missing:
            raise missing_signature(f"missing header(s): {', '.join(missing)}")
        msg_id, timestamp, signature = (values[name] or "" for name in HEADERS)
        if not _SECONDS.fullmatch(timestamp):
            raise bad_signature("webhook-timestamp is not Unix time in whole seconds")
        if abs(self._clock() - int(timestamp)) > self._tolerance_s:
            raise stale_signature(
                f"webhook-timestamp is more than {self._tolerance_s}s away from now"
            )
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise malformed_body("the body is not UTF-8") from None
        checked = {
            "webhook-id": msg_id,
            "webhook-timestamp": timestamp,
            "webhook-signature": signature,
        }
        for hook in self._hooks:
            try:
                hook.verify(body, checked, json_parse=False)
            except WebhookVerificationError as exc:
                if "timestamp" in str(exc):  # "too old" / "too new": the library's own window
                    raise stale_signature("webhook-timestamp outside the 5 minute window") from None
                continue
            except ValueError:  # includes binascii.Error: a malformed signature list
                raise bad_signature("webhook-signature is not a list of 'v1,<base64>'") from None
            return msg_id
        raise bad_signature("no webhook-signature matches the body with a known secret")
