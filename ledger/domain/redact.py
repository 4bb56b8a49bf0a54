"""Keep credentials out of events and log lines: events are retained forever and replayed by
auditors, so a secret that enters a topic can never be taken back."""

from __future__ import annotations

import re

_SECRET_PATTERNS = (
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"(?i)\b(pass(word)?|passwd|secret|token|api[_-]?key|authorization)\s*[=:]\s*\S+"),
    re.compile(r"\b(sk|pk|rk|ghp|gho|xox[abp])[-_][A-Za-z0-9_-]{12,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),  # credentials inside a URL
)

REDACTED = "[REDACTED]"


def looks_secret(text: str) -> bool:
    """True when ``text`` contains something shaped like a credential."""
    return any(p.search(text) for p in _SECRET_PATTERNS)


def redact(text: str) -> str:
    """``text`` with every credential-shaped span replaced by ``[REDACTED]``."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return text
