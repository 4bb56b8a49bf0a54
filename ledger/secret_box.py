"""Destinations' signing secrets at rest: sealed with AES-256-GCM under a key the operator
provides, never stored in the clear (decision 033).

The key file holds one ``aes256gcm:<base64 of 32 bytes>`` per line (``#`` comments allowed, mode
0600); the first line seals, every line opens, so a rotation adds a new first line, re-seals
every row (``opledger destinations rekey``) and then drops the old one. A sealed secret is
``sealed1:<key id>:<base64url of nonce and ciphertext>``; the additional data binds it to its
tenant and destination, so a sealed value copied into another tenant's row does not open.
A database dump, a backup or an analyst who reaches the table holds only ciphertext.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ledger.private_files import (
    create_private_once,
    key_file_lines,
    reread_on_change,
    write_private,
)
from ledger.settings import Settings

_KEY_PREFIX = "aes256gcm:"
_SEALED_PREFIX = "sealed1:"
SEALED_RE = re.compile(r"\Asealed1:[0-9a-f]{16}:[A-Za-z0-9_-]{40,}\Z")
_NONCE_BYTES = 12
#: how a secret stored before sealing existed begins
LEGACY_PREFIX = "whsec_"


class SecretKeyError(RuntimeError):
    """The key file is missing or malformed, or a sealed secret does not open; the message says
    which (and never holds a secret)."""


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"opledger.secret-key" + key).hexdigest()[:16]


def _additional_data(tenant_id: str, name: str) -> bytes:
    return b"opledger.destination-secret.v1\x00" + f"{tenant_id}\x00{name}".encode()


def new_key_line() -> str:
    """A fresh key as a line of the key file."""
    return _KEY_PREFIX + base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()


@dataclass(frozen=True, slots=True)
class SecretBox:
    """Seals with the first key, opens with any."""

    keys: tuple[tuple[str, bytes], ...]
    source: str = "(given)"

    @classmethod
    def load(cls, path: Path) -> SecretBox:
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise SecretKeyError(
                f"no secrets key at {path}: destinations' signing secrets are sealed with it "
                "(`opledger stack up` creates one for the local stack; elsewhere "
                "`opledger destinations key create --out PATH` and OPLEDGER_SECRETS_KEY_FILE)"
            ) from None
        except PermissionError:
            raise SecretKeyError(f"cannot read the secrets key at {path}") from None
        try:
            keys = [(_key_id(key), key) for key in key_file_lines(path, text, _KEY_PREFIX)]
        except ValueError as exc:
            raise SecretKeyError(str(exc)) from None
        if not keys:
            raise SecretKeyError(f"{path} holds no key")
        return cls(tuple(keys), str(path))

    @property
    def current_id(self) -> str:
        return self.keys[0][0]

    def seal(self, secret: str, *, tenant_id: str, name: str) -> str:
        key_id, key = self.keys[0]
        nonce = os.urandom(_NONCE_BYTES)
        sealed = AESGCM(key).encrypt(nonce, secret.encode(), _additional_data(tenant_id, name))
        text = base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")
        return f"{_SEALED_PREFIX}{key_id}:{text}"

    def open(self, stored: str, *, tenant_id: str, name: str) -> str:
        """The secret ``stored`` seals; raises :class:`SecretKeyError` naming the destination.
        A secret stored in the clear before sealing existed is returned as it is, until
        `opledger destinations rekey` seals it (`opledger stack up` does on the local stack)."""
        if stored.startswith(LEGACY_PREFIX):
            return stored
        if not SEALED_RE.match(stored):
            raise SecretKeyError(
                f"the secret of destination {name!r} (tenant {tenant_id!r}) is neither sealed "
                "nor a whsec_ secret"
            )
        _, key_id, text = stored.split(":", 2)
        key = dict(self.keys).get(key_id)
        if key is None:
            raise SecretKeyError(
                f"the secret of destination {name!r} (tenant {tenant_id!r}) is sealed with key "
                f"{key_id}, not in {self.source}"
            )
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        try:
            plain = AESGCM(key).decrypt(
                raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _additional_data(tenant_id, name)
            )
        except InvalidTag:
            raise SecretKeyError(
                f"the sealed secret of destination {name!r} (tenant {tenant_id!r}) does not "
                "open: altered, or copied from another destination"
            ) from None
        return plain.decode()

    def is_current(self, stored: str) -> bool:
        return stored.startswith(f"{_SEALED_PREFIX}{self.current_id}:")


_read_box = reread_on_change(SecretBox.load)


def secret_box(settings: Settings) -> SecretBox:
    """The box ``settings`` name, read again when the key file changes (a rotation)."""
    return _read_box(settings.secrets_key_path)


def write_key_file(path: Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` atomically, mode 0600 from the start."""
    write_private(path, "".join(f"{line}\n" for line in lines))


def key_lines(path: Path) -> list[str]:
    """The key lines of ``path`` as they stand (comments dropped), first the sealing one."""
    SecretBox.load(path)  # refuses a malformed file before anything is rewritten
    return [
        text for line in path.read_text().splitlines() if (text := line.split("#", 1)[0].strip())
    ]


def ensure_local_secret_key(settings: Settings) -> SecretBox:
    """The local stack's key, created once (`opledger stack up`)."""
    create_private_once(settings.secrets_key_path, lambda: new_key_line() + "\n")
    return secret_box(settings)
