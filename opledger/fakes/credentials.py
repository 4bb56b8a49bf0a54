"""The fake provider's control credential: its ``/_control/`` routes reconfigure, reset and
count every tenant's calls, so they answer only a caller that shows the token in
``<home>/keys/fake-provider-control.token`` (``OPLEDGER_FAKE_PROVIDER_CONTROL_TOKEN_FILE``; mode
0600, made by the server on its first start). Without it, anything that can reach the port (a
webhook the stack's delivery worker was told to call, say) could reset the counts a kill test
relies on, or read which operations ran."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

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
    path = control_token_path(settings)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.new")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
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
