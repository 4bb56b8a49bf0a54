"""Who may change policy: the operator's Ed25519 key signs every policy change, and readers
obey only changes signed by a key they trust (decision 032).

A record on the policy topic says nothing reliable about who wrote it: ``actor_id`` is whatever
the writer claims, and anyone the broker lets write the topic could grant itself any tool. The
signature moves the question from "who could reach the broker" to "who holds the operator's
private key". The projector checks it on every change it reads (a change that does not verify is
dead-lettered with the reason, counted, never folded), and the SDK and the workers check the
projected rows again before a grant allows anything, so a row written into PostgreSQL by some
other path does not allow anything either.

Files: the private key is one line, ``ed25519-private:`` and its 32 raw bytes in base64 (mode
0600); the trusted keys file holds one ``ed25519:<base64 of the 32-byte public key>`` per line,
``#`` comments allowed. Rotation: add the new public key to the trusted file everywhere, sign
with the new key, then remove the old line; changes signed by a removed key stop counting.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.domain.events import PolicyChanged
from ledger.private_files import key_file_lines, reread_on_change
from ledger.settings import Settings

_PRIVATE_PREFIX = "ed25519-private:"
_PUBLIC_PREFIX = "ed25519:"


class PolicyKeyError(RuntimeError):
    """A key file is missing or does not hold a key; the message says which and what to do."""


def key_id(public: bytes) -> str:
    """The id a change's ``signed_by`` names its key with."""
    return _PUBLIC_PREFIX + hashlib.sha256(public).hexdigest()[:32]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class OperatorKey:
    """The private key policy changes are signed with."""

    private: Ed25519PrivateKey
    public: bytes
    id: str

    @classmethod
    def generate(cls) -> OperatorKey:
        return cls.from_private(Ed25519PrivateKey.generate())

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey) -> OperatorKey:
        public = private.public_key().public_bytes_raw()
        return cls(private, public, key_id(public))

    @classmethod
    def load(cls, path: Path) -> OperatorKey:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            raise PolicyKeyError(
                f"no operator signing key at {path}: policy changes are signed with it "
                "(`opledger stack up` creates one for the local stack; elsewhere "
                "`opledger policy key create --out PATH` and OPLEDGER_POLICY_SIGNING_KEY_FILE)"
            ) from None
        except PermissionError:
            raise PolicyKeyError(
                f"cannot read the operator signing key at {path}: only the operator may sign "
                "policy changes"
            ) from None
        try:
            seeds = key_file_lines(path, text, _PRIVATE_PREFIX)
        except ValueError:
            seeds = []
        if len(seeds) != 1:
            raise PolicyKeyError(f"{path} does not hold an operator key ({_PRIVATE_PREFIX}...)")
        return cls.from_private(Ed25519PrivateKey.from_private_bytes(seeds[0]))

    def save(self, path: Path) -> None:
        """Write the private key to ``path`` (created 0600; never overwritten)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = self.private.private_bytes_raw()
        line = f"{_PRIVATE_PREFIX}{base64.b64encode(seed).decode()}\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(line)

    @property
    def public_line(self) -> str:
        """This key's line in a trusted keys file."""
        return f"{_PUBLIC_PREFIX}{base64.b64encode(self.public).decode()}"

    def sign(self, change: PolicyChanged) -> PolicyChanged:
        """``change`` signed by this key (a copy; any earlier signature replaced)."""
        named = change.model_copy(update={"signed_by": self.id, "signature": None})
        return named.model_copy(update={"signature": _b64(self.private.sign(named.signed_bytes()))})


class TrustedKeys:
    """The public keys whose signatures make a policy change count; thread-safe."""

    def __init__(self, publics: Iterable[bytes], source: str = "(given)") -> None:
        self._keys = {key_id(p): Ed25519PublicKey.from_public_bytes(p) for p in publics}
        self.source = source
        self._lock = threading.Lock()
        # (signed bytes, signature) already checked: the SDK checks each grant row it reads.
        self._verified: dict[tuple[bytes, str], bool] = {}

    @classmethod
    def load(cls, path: Path) -> TrustedKeys:
        """The keys listed in ``path``; no file: none (every change is refused)."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls([], str(path))
        try:
            return cls(key_file_lines(path, text, _PUBLIC_PREFIX), str(path))
        except ValueError as exc:
            raise PolicyKeyError(str(exc)) from None

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def refusal(
        self, signed_bytes: bytes, signed_by: str | None, signature: str | None
    ) -> str | None:
        """None when ``signature`` is a trusted key's over ``signed_bytes``; else why not."""
        if signed_by is None or signature is None:
            return "the policy change is not signed (only the operator's key may change policy)"
        public = self._keys.get(signed_by)
        if public is None:
            return f"the policy change is signed by {signed_by}, not a trusted operator key"
        memo = (signed_bytes, signature)
        with self._lock:
            known = self._verified.get(memo)
        if known is None:
            try:
                public.verify(_unb64(signature), signed_bytes)
                known = True
            except (InvalidSignature, ValueError, binascii.Error):
                known = False
            with self._lock:
                if len(self._verified) > 10_000:
                    self._verified.clear()
                self._verified[memo] = known
        if not known:
            return f"the policy change's signature by {signed_by} does not verify (altered?)"
        return None

    def refuses(self, change: PolicyChanged) -> str | None:
        """:meth:`refusal` for a change as read from the topic."""
        return self.refusal(change.signed_bytes(), change.signed_by, change.signature)


_read_trusted = reread_on_change(TrustedKeys.load)


def trusted_keys(settings: Settings) -> TrustedKeys:
    """The trusted keys ``settings`` name, read again when the file changes."""
    return _read_trusted(settings.policy_trusted_keys_path)


def operator_key(settings: Settings) -> OperatorKey:
    """The operator's signing key ``settings`` name (PolicyKeyError if it cannot be read)."""
    return OperatorKey.load(settings.policy_signing_key_path)


def ensure_local_keys(settings: Settings) -> OperatorKey:
    """The local stack's operator key, created with its trusted keys file on first use."""
    path = settings.policy_signing_key_path
    if not path.exists():
        OperatorKey.generate().save(path)
    key = OperatorKey.load(path)
    trusted = settings.policy_trusted_keys_path
    listed = trusted.read_text() if trusted.exists() else ""
    if key.public_line not in listed.split():
        trusted.parent.mkdir(parents=True, exist_ok=True)
        with trusted.open("a") as out:
            out.write(f"# the local stack's operator key ({key.id})\n{key.public_line}\n")
    return key
