"""Words from outside (a provider's, an exception's) as the recovery worker records or logs them:
cut, made storable and scrubbed of secrets."""

from __future__ import annotations

import functools

from ledger.domain.events import storable_text
from ledger.secrets import cut_tokens, scrub

#: The longest error or reason text a recovery event carries, and a log line quotes.
MAX_ERROR = 1000


def recordable(value: str | BaseException) -> str:
    """``value`` (an exception as ``Type: message``) as an event may carry it."""
    text = value if isinstance(value, str) else f"{type(value).__name__}: {value}"
    # A provider's words, recorded even if unstorable. Cut first, at a whitespace, as the
    # delivery worker cuts a destination's answer: the scrub's cost grows faster than its input
    # (10,000 characters shaped for its keyword detector took over 20 s), and the cache below
    # would otherwise keep every long text a provider ever sent.
    return _scrubbed(storable_text(cut_tokens(text, MAX_ERROR)))


def said(exc: BaseException) -> str:
    """An exception from outside (a provider's), cut for a log line: the log handlers scrub
    every line, at a cost that grows faster than its length."""
    return cut_tokens(f"{type(exc).__name__}: {exc}", MAX_ERROR)


@functools.lru_cache(maxsize=4096)
def _scrubbed(text: str) -> str:
    # scrub is a pure function of the text, and a pass repeats the same few reasons hundreds
    # of times: detect-secrets' plugins over each of them cost more than the rest of a decision.
    return scrub(text, max_length=MAX_ERROR)
