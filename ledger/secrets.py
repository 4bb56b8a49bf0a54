"""Scrub credentials from text at the edge, before it becomes an event or a log line.

``scrub`` runs the maintained detector ``detect-secrets`` over each line and then the
contract-level shapes of ``ledger.domain.redact``; whatever either reports is replaced by
``[REDACTED]``, and opledger's own ids are kept. ``RedactingFilter`` applies it to logging.

How detect-secrets is used, from its 1.5.0 source: its ad-hoc ``scan_line`` reads the
plugin list from a process-wide settings singleton and disables a filter in it on every call,
and ``transient_settings`` swaps that singleton, so neither is safe to call from many threads
or free of side effects. Instead this module builds its own plugin instances once and calls
each one's ``analyze_line``. That never writes shared state (the high-entropy plugins only
swap their regex in eager mode, which is not used) and only reads the settings singleton to
see whether network verification was switched on, which opledger never does.

It is slow (``bench/bench_scrub.py``; figures in ``bench/README.md``): a fraction of a
millisecond for an ordinary error text, several times that when the text names a key (the
keyword plugin wakes up), and many times the domain pass alone. Fine for error texts and log
lines; keep it off every per-event path.
"""

from __future__ import annotations

import logging

from detect_secrets.plugins.aws import AWSKeyDetector
from detect_secrets.plugins.azure_storage_key import AzureStorageKeyDetector
from detect_secrets.plugins.base import BasePlugin
from detect_secrets.plugins.basic_auth import BasicAuthDetector
from detect_secrets.plugins.cloudant import CloudantDetector
from detect_secrets.plugins.discord import DiscordBotTokenDetector
from detect_secrets.plugins.github_token import GitHubTokenDetector
from detect_secrets.plugins.gitlab_token import GitLabTokenDetector
from detect_secrets.plugins.high_entropy_strings import (
    Base64HighEntropyString,
    HexHighEntropyString,
)
from detect_secrets.plugins.ibm_cloud_iam import IbmCloudIamDetector
from detect_secrets.plugins.ibm_cos_hmac import IbmCosHmacDetector
from detect_secrets.plugins.jwt import JwtTokenDetector
from detect_secrets.plugins.keyword import KeywordDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.npm import NpmDetector
from detect_secrets.plugins.openai import OpenAIDetector
from detect_secrets.plugins.private_key import PrivateKeyDetector
from detect_secrets.plugins.pypi_token import PypiTokenDetector
from detect_secrets.plugins.sendgrid import SendGridDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.softlayer import SoftlayerDetector
from detect_secrets.plugins.square_oauth import SquareOAuthDetector
from detect_secrets.plugins.stripe import StripeDetector
from detect_secrets.plugins.telegram_token import TelegramBotTokenDetector
from detect_secrets.plugins.twilio import TwilioKeyDetector

from ledger.domain.display import displayable
from ledger.domain.redact import (
    REDACTED,
    Span,
    looks_secret,
    own_id_spans,
    redact,
    redact_spans,
    secret_spans,
)

# Every detect-secrets 1.5.0 plugin except two: ArtifactoryDetector (its password shape,
# "AP" + a hex digit + 8 letters, matches capitalised words, and its matches include the
# surrounding whitespace) and IPPublicDetector (an IP address is not a credential).
# The entropy limits are the library's defaults, stated so an upgrade cannot move them.
#
# Beside each plugin, lower-case literals of which every one of its matches contains at least
# one; a line without any is skipped. These plugins' patterns start with a case-insensitive
# alternation of key names, which the regex engine tries at every position: KeywordDetector
# alone is the costliest of them (bench/bench_scrub.py). tests/unit/test_redact.py checks the
# literals against the plugins' own word lists.
_KEY_OR_PASS = ("key", "pwd", "pass", "token")
_PLUGINS: tuple[tuple[BasePlugin, tuple[str, ...]], ...] = (
    (AWSKeyDetector(), ()),
    (AzureStorageKeyDetector(), ()),
    (BasicAuthDetector(), ()),
    (CloudantDetector(), (*_KEY_OR_PASS, "pw", "cloudant.com")),
    (DiscordBotTokenDetector(), ()),
    (GitHubTokenDetector(), ()),
    (GitLabTokenDetector(), ()),
    (IbmCloudIamDetector(), _KEY_OR_PASS),
    (IbmCosHmacDetector(), ("secret",)),
    (JwtTokenDetector(), ()),
    (KeywordDetector(), ("key", "pass", "pwd", "secret", "contrase")),
    (MailchimpDetector(), ("-us",)),
    (NpmDetector(), ()),
    (OpenAIDetector(), ()),
    (PrivateKeyDetector(), ()),
    (PypiTokenDetector(), ()),
    (SendGridDetector(), ()),
    (SlackDetector(), ("xox", "hooks.slack.com")),
    (SoftlayerDetector(), (*_KEY_OR_PASS, "softlayer")),
    (SquareOAuthDetector(), ()),
    (StripeDetector(), ()),
    (TelegramBotTokenDetector(), ()),
    (TwilioKeyDetector(), ()),
    (Base64HighEntropyString(limit=4.5), ()),
    (HexHighEntropyString(limit=3.0), ()),
)

# KeywordDetector picks its regexes by file extension. With none it wants quoted values
# (password = "x"); the config-file variants would take everything after "password=" to the
# end of the line, swallowing the rest of an error text. Unquoted forms are the domain's.
_SOURCE_NAME = "opledger-text"

# A value this short also occurs inside ordinary words, so it is replaced only where it
# stands alone.
_SHORT_VALUE = 6


def _reported_values(text: str) -> set[str]:
    values: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        lowered = line.lower()
        for plugin, needs in _PLUGINS:
            if needs and not any(literal in lowered for literal in needs):
                continue
            for found in plugin.analyze_line(filename=_SOURCE_NAME, line=line, line_number=number):
                if found.secret_value:
                    values.add(found.secret_value)
    return values


def _occurrences(text: str, value: str) -> list[Span]:
    spans = []
    at = text.find(value)
    while at != -1:
        end = at + len(value)
        standalone = (at == 0 or not text[at - 1].isalnum()) and (
            end == len(text) or not text[end].isalnum()
        )
        if len(value) >= _SHORT_VALUE or standalone:
            spans.append((at, end))
        at = text.find(value, at + 1)
    return spans


def _scrub(text: str) -> str:
    own = own_id_spans(text)
    spans = secret_spans(text)
    for value in _reported_values(text):
        spans += [
            (start, end)
            for start, end in _occurrences(text, value)
            if not any(s <= start and end <= e for s, e in own)
        ]
    # The domain pass again: what the event model checks is exactly what it redacts.
    return redact(redact_spans(text, spans)) if spans else text


def _cut(text: str, length: int) -> str:
    # Never through a placeholder: "password=[REDAC" reads as a value again.
    straddling = text.find(REDACTED, max(0, length - len(REDACTED) + 1), length + len(REDACTED))
    return text[: straddling if -1 < straddling < length else length]


def cut_tokens(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters before it is scrubbed, at a whitespace: the
    scrub's cost grows faster than its input (a text shaped for detect-secrets' keyword detector
    takes seconds once it is long: bench/README.md), so text from outside (a destination's
    answer) is cut first. A token the cut would split is dropped whole, so no part of a secret
    is left for the scrub to miss."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    if not text[limit].isspace():
        # Back to the last whitespace (str.rsplit would also drop leading whitespace, and finds
        # nothing to split in a head of whitespace alone: "\r0" cut at 1 raised IndexError).
        end = len(head)
        while end and not head[end - 1].isspace():
            end -= 1
        head = head[:end]
    head = head.rstrip()
    return f"{head} [cut]" if head else "[cut]"


def scrub(text: str, *, max_length: int | None = None) -> str:
    """``text`` with every credential detect-secrets or the domain shapes find replaced by
    ``[REDACTED]``; opledger's own ids are kept. The result never looks secret, and is at most
    ``max_length`` characters when given (cut after scrubbing, never through a placeholder).
    Thread-safe."""
    cleaned = _scrub(text)
    if max_length is None or len(cleaned) <= max_length:
        return cleaned
    for _ in range(3):
        # A cut can leave a shape that the whole text did not have (a 41-character token
        # becomes an AWS-secret-sized 40); redact and cut again.
        cleaned = _cut(cleaned, max_length)
        if not looks_secret(cleaned):
            return cleaned
        cleaned = redact(cleaned)
    return _cut(REDACTED, max_length)


_TRACEBACK = logging.Formatter()


def redact_handlers(logger: logging.Logger | None = None) -> int:
    """Put a :class:`RedactingFilter` on every handler of ``logger`` (default: the root logger)
    that has none; returns how many it added. For a worker whose framework sets up logging
    itself (faust's ``mode`` replaces the root handlers, and any filter on them, as it starts):
    called once that is done."""
    added = 0
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
            added += 1
    return added


class RedactingFilter(logging.Filter):
    """Scrubs each record's message, arguments and traceback, so no log line carries a secret,
    and writes what a terminal would act on as visible escapes (:mod:`ledger.domain.display`).

    Attach it to handlers: a logger's own filters do not see records propagated from its
    children. It never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            # A malformed format string: keep what it carried, scrubbed, rather than raise
            # into the caller of the log statement.
            message = f"{record.msg} {record.args!r}"
        # Shown, not run: a provider's words in a message must not clear an operator's
        # terminal or begin a line that poses as another record (ledger.domain.display).
        record.msg = displayable(scrub(message))
        # Empty, not None: mode's formatter (faust's workers) turns None into (None,) and formats
        # the message with it again.
        record.args = ()
        if record.exc_info:
            # Rendered here, scrubbed, and kept as text only: a formatter would otherwise
            # render the raw exception (and its message) again.
            record.exc_text = _TRACEBACK.formatException(record.exc_info)
            record.exc_info = None
        if record.exc_text:
            record.exc_text = displayable(scrub(record.exc_text), lines=True)
        if record.stack_info:
            record.stack_info = displayable(scrub(record.stack_info), lines=True)
        return True
