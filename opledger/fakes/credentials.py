"""The fake provider's control credential: its ``/_control/`` routes reconfigure, reset and
count every tenant's calls, so they answer only a caller that shows the token in
``<home>/keys/fake-provider-control.token`` (``OPLEDGER_FAKE_PROVIDER_CONTROL_TOKEN_FILE``; mode
0600, made by the server on its first start). Without it, anything that can reach the port (a
webhook the stack's delivery worker was told to call, say) could reset the counts a kill test
relies on, or read which operations ran."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from ledger.private_files import create_private_once
from ledger.settings import Settings
from opledger.fakes.model import FakeProviderError

#: The header a control request carries the token in: ``Authorization: Bearer <token>``.
SCHEME = "Bearer "


def control_token_path(settings: Settings) -> Path:
    return Path(
        settings.fake_provider_control_token_file
        or settings.home / "keys" / "fake-provider-control.token"
    )


def ensure_control_token(settings: Settings) -> str:
    """The token, made once (written aside and linked into place, so no reader sees half)."""
    create_private_once(control_token_path(settings), lambda: secrets.token_urlsafe(32) + "\n")
    return control_token(settings)


def control_token(settings: Settings) -> str:
    path = control_token_path(settings)
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise FakeProviderError(
            f"cannot read the fake provider's control token at {path}: {exc.strerror} (the "
            "server makes it on its first start)"
        ) from None
    if len(token) < 32:
        raise FakeProviderError(f"{path} does not hold a control token")
    return token


def authorized(header: str | None, token: str) -> bool:
    """Whether ``header`` (an Authorization value) shows ``token``; constant time."""
    shown = (header or "").removeprefix(SCHEME) if (header or "").startswith(SCHEME) else ""
    return hmac.compare_digest(shown.encode(), token.encode())
