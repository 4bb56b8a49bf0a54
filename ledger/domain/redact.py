"""Keep credentials out of events and log lines: events are retained forever and replayed by
auditors, so a secret that enters a topic can never be taken back.

This is the contract-level detector the event models run on every error text, provider
reference and destination. It is a table of named credential shapes; each marks the span
that is secret (a value, not its key name, so "password=[REDACTED]" still says what was
removed). opledger's own identifiers are masked before any shape runs: they appear in error
texts legitimately and are never secrets. ``ledger.secrets.scrub`` adds the maintained
``detect-secrets`` plugins on top of this at the edge.
"""

from __future__ import annotations

import binascii
import functools
import math
import re
import unicodedata
from base64 import b64decode
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ledger.domain.ids import ULID_PATTERN

REDACTED = "[REDACTED]"

Span = tuple[int, int]

# Each starts with a literal, so the regex engine scans for it quickly; boundaries are
# checked in Python (a leading look-behind would make the engine try every position).
_OWN_IDS = (
    ("op_", re.compile(rf"op_{ULID_PATTERN}")),
    ("ev_", re.compile(rf"ev_{ULID_PATTERN}")),
    ("sha256:", re.compile(r"sha256:[0-9a-f]{64}")),
)


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def own_id_spans(text: str) -> list[Span]:
    """Where opledger's operation ids, event ids and ``sha256:`` references are in ``text``."""
    spans = []
    for prefix, pattern in _OWN_IDS:
        if prefix not in text:
            continue
        for m in pattern.finditer(text):
            start, end = m.span()
            if (start == 0 or not _is_word_char(text[start - 1])) and (
                end == len(text) or not text[end].isalnum()
            ):
                spans.append((start, end))
    return spans


# Masks an own id before the shapes run: not whitespace and in no value alphabet below, so a
# masked id can neither be a value ("idempotency_key=op_...") nor join a neighbouring token.
_MASK = "\x00"

# Key names that hold credentials (matched in lower case).
_SECRET_WORDS = (
    "key",
    "secret",
    "token",
    "passw",
    "pwd",
    "auth",
    "credential",
    "cookie",
    "session",
)
_SECRET_WORD = r"(?:key|secret|token|passw(?:or)?d|pwd|auth|credential|cookie|session)"
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

# Key names that contain a secret word but name something that is not a credential.
_NOT_A_SECRET_KEY = re.compile(
    r"""(?ix)
      (?:error|exception|warning|failed|failure|denied|expired|invalid|missing|required)$
        # exception names and prose: "KeyError: 'user_id'", "TokenExpired: ..."
    | (?:tokens|tokenizer|count|limit|length|size|ttl|timeout|expiry|expires(?:_?(?:in|at))?
       |type|name|version|url|uri|path|file|policy)$
        # metadata about a credential, not the credential: "max_tokens=4096", "token_type: bearer"
    | (?:partition|routing|sort|primary|foreign|cache|dedup|idempotency|message|object|record
       |group|lookup)[_.-]?key$
        # keys that address data; the idempotency key is the operation id
    | ^(?:author|authors|authority|monkey|keyboard|keyword)$
    """
)

# Placeholders that already stand for a removed value; redacting them again changes nothing.
_PLACEHOLDER = re.compile(
    r"(?i)\[REDACTED\]|\*+|x{3,}|<redacted>|redacted|\[filtered\]|null|none|nil|true|false|undefined"
)


def _entropy(token: str) -> float:
    """Shannon entropy in bits per character."""
    n = len(token)
    return -sum(c / n * math.log2(c / n) for c in Counter(token).values())


def _has_letter_and_digit(value: str) -> bool:
    return any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


def _secret(m: re.Match[str], text: str) -> str:
    return text[m.start("secret") : m.end("secret")]


def _not_placeholder(m: re.Match[str], text: str) -> bool:
    return not _PLACEHOLDER.fullmatch(_secret(m, text).strip())


def _key_name(m: re.Match[str], text: str) -> str:
    """The whole key whose secret word the match starts at ("x-api-key", not just "key")."""
    start = m.start("key")
    first = start
    while first > 0 and start - first < 40 and text[first - 1] in _KEY_CHARS:
        first -= 1
    return text[first : m.end("key")]


def _secret_key(m: re.Match[str], text: str) -> bool:
    return not _NOT_A_SECRET_KEY.search(_key_name(m, text)) and _not_placeholder(m, text)


def _secret_key_in_prose(m: re.Match[str], text: str) -> bool:
    # Prose names a key far more often than it quotes one ("the api key is invalid"), so only
    # a value that is not a word (it mixes letters and digits) counts.
    return _secret_key(m, text) and _has_letter_and_digit(_secret(m, text))


def _basic_credentials(m: re.Match[str], text: str) -> bool:
    # "basic validation failed" must survive: a Basic value is base64 of "user:password".
    try:
        return b":" in b64decode(_secret(m, text), validate=True)
    except (binascii.Error, ValueError):
        return False


# The words of a camelCase or path-like name ("Kafka", "producer", "2024", "HTTP").
_NAME_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")


def _mean_word_length(value: str) -> float:
    words = _NAME_WORDS.findall(value)
    return sum(map(len, words)) / len(words) if words else 0.0


def _aws_secret_key(m: re.Match[str], text: str) -> bool:
    value = _secret(m, text)
    if len(value) != 40:
        return False
    mixed = any(c.islower() for c in value) and any(c.isupper() for c in value)
    if not (mixed and any(c.isdigit() or c in "+/" for c in value)):
        return False
    # Entropy alone let a few random keys in 10,000 through (the characters of 40 random
    # draws can repeat more than usual), so a key whose camelCase "words" are as short as
    # random text's also counts: random base64's are about two characters long, names' four
    # or more (tests/unit/test_redact.py holds both to it).
    return _entropy(value) >= 4.3 or _mean_word_length(value) < 3.0


# UUIDs and their cousins (SES message ids, trace ids): hex groups joined by dashes.
_DASHED_HEX = re.compile(r"[0-9a-fA-F]+(?:-[0-9a-fA-F]+){2,}")
_HEX = frozenset("0123456789abcdefABCDEF")


def _random_looking(m: re.Match[str], text: str) -> bool:
    """A long token whose characters are spread like random base64 or hex, not like words.

    Random text gains entropy with length faster than names do, so the bar rises with length:
    at 32 characters it passes ~99.5% of random keys that mix letters and digits, while
    camelCase/snake_case names stay below it. From 40 characters on, short "words" count too:
    no random mixed-case key of 40, 48 or 64 characters was missed in 300,000 of each (two
    draws), and 2 lowercase keys of 48 in 300,000 (tests/unit/test_redact.py holds a sample).
    """
    token = _secret(m, text)
    if _DASHED_HEX.fullmatch(token):
        return False  # ids, not keys; a UUID-shaped key is still caught by its key name
    separators = token.count("-") + token.count("_")
    if separators * 8 > len(token):
        return False  # kebab/snake identifiers: random base64url has ~3% separators, words ~15%
    core = token.replace("-", "").replace("_", "")
    if not _has_letter_and_digit(core):
        return False
    longer = min(len(token), 64) - 32
    if set(core) <= _HEX:
        return _entropy(core) >= 3.0  # random 32-hex: 3.3-3.8 bits; detect-secrets' hex limit
    entropy = _entropy(token)
    mixed_case = any(c.islower() for c in core) and any(c.isupper() for c in core)
    # Random 32 base64: 4.2-4.7 bits; one letter case: 3.9-4.4 bits.
    if entropy >= (4.15 + 0.015 * longer if mixed_case else 3.85 + 0.01 * longer):
        return True
    # From 40 characters on, a token whose "words" (letter runs, digit runs) are as short as
    # random text's also counts, as for AWS secret keys: entropy alone let about 3 random keys
    # in 100,000 through (their characters repeat more than usual). Random words are about 2
    # (mixed case) and 2.5 (one case) characters long, names' longer.
    return (
        len(core) >= 40
        and entropy >= (4.0 if mixed_case else 3.6)
        and _mean_word_length(core) < 2.6
    )


Accept = Callable[[re.Match[str], str], bool]


@dataclass(frozen=True)
class _Shape:
    """One credential shape. The secret part of a match is its group named "secret", or the
    whole match without one."""

    name: str
    pattern: re.Pattern[str]
    starts: tuple[str, ...] = ()  # lower-case literals a match starts with; () = search anywhere
    min_length: int = 0  # the shortest match; skip shorter texts
    lowercase: bool = False  # match the lower-cased text: case-insensitive, and fast
    word_start: bool = False  # the match must not continue a word on its left
    accept: Accept | None = None  # a check on the match (the original-case text is passed)

    @property
    def has_secret_group(self) -> bool:
        return "secret" in self.pattern.groupindex


_SHAPES = (
    # A PEM private key (also inside a GCP service-account JSON); a truncated key in an error
    # text has no END line, so everything after its header is key material.
    _Shape(
        "private_key",
        re.compile(
            r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|.*)",
            re.DOTALL,
        ),
        starts=("-----begin",),
    ),
    # k=v, k: v, "k": "v", 'k': 'v', X-Api-Key: v, Authorization: Bearer v. A quoted value may
    # hold spaces; an unquoted one ends at whitespace, a quote or the next query parameter.
    _Shape(
        "key_value",
        re.compile(
            rf"""(?x) (?P<key>{_SECRET_WORD}[a-z0-9_.-]{{0,40}}) ["']? \s* (?: :=|=>|[:=] ) \s*
            (?: (?: bearer|basic|digest|token|negotiate ) \s+ )?
            (?P<q>["'])?
            (?P<secret> (?(q) (?:(?!(?P=q))[^\n])+ | [^\s"'&\x00]+ ))"""
        ),
        starts=_SECRET_WORDS,
        lowercase=True,
        accept=_secret_key,
    ),
    # Prose that names the key before the value: "x-api-key header abcd1234...".
    _Shape(
        "key_named_in_prose",
        re.compile(
            rf"""(?x) (?P<key>{_SECRET_WORD}[a-z0-9_.-]{{0,40}}) \s+
            (?: (?: header|value|is|was|of|for ) \s+ )?
            (?P<secret>[a-z0-9+/=_.~-]{{8,}})"""
        ),
        starts=_SECRET_WORDS,
        lowercase=True,
        accept=_secret_key_in_prose,
    ),
    # A whole Cookie header: every cookie in it can be a session.
    _Shape(
        "cookie_header",
        re.compile(r"cookie\s*:\s*(?P<secret>[^\r\n]+)"),
        starts=("cookie",),
        lowercase=True,
        word_start=True,
        accept=_not_placeholder,
    ),
    _Shape(
        "bearer",
        re.compile(r"bearer\s+(?P<secret>[a-z0-9._~+/=-]{8,})"),
        starts=("bearer",),
        lowercase=True,
        word_start=True,
    ),
    _Shape(
        "basic_auth",
        re.compile(r"basic\s+(?P<secret>[a-z0-9+/]{4,}={0,2})(?![a-z0-9+/=])"),
        starts=("basic",),
        lowercase=True,
        word_start=True,
        accept=_basic_credentials,
    ),
    # scheme://user:password@host; the user name stays readable.
    _Shape(
        "url_credentials",
        re.compile(r"://[^/\s:@\x00]+:(?P<secret>[^/\s@\x00]+)@"),
        starts=("://",),
        accept=_not_placeholder,
    ),
    # AWS access key ids: long-term (AKIA), temporary (ASIA) and the rarer prefixes.
    _Shape(
        "aws_access_key_id",
        re.compile(r"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b"),
        starts=("akia", "asia", "abia", "acca", "a3t"),
        word_start=True,
    ),
    # AWS secret access keys: exactly 40 base64 characters, mixed case, random.
    _Shape(
        "aws_secret_access_key",
        re.compile(r"(?P<secret>[A-Za-z0-9/+]{40,})"),
        min_length=40,
        accept=_aws_secret_key,
    ),
    _Shape(
        "gcp_api_key",
        re.compile(r"AIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),
        starts=("aiza",),
        word_start=True,
    ),
    # Stripe secret, restricted and publishable keys, and webhook signing secrets.
    _Shape(
        "stripe_key",
        re.compile(r"(?:[spr]k_(?:live|test)_[0-9A-Za-z]{10,}|whsec_[0-9A-Za-z]{20,})"),
        starts=("sk_", "pk_", "rk_", "whsec_"),
        word_start=True,
    ),
    # OpenAI/Anthropic-style keys (sk-proj-..., sk-ant-...) and their pk-/rk- cousins.
    _Shape(
        "dash_prefixed_key",
        re.compile(r"[spr]k-[A-Za-z0-9_-]{12,}"),
        starts=("sk-", "pk-", "rk-"),
        word_start=True,
    ),
    _Shape(
        "github_token",
        re.compile(r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{22,})"),
        starts=("gh", "github_pat_"),
        word_start=True,
    ),
    _Shape(
        "slack_token",
        re.compile(r"xox[abposr]-[A-Za-z0-9-]{10,}"),
        starts=("xox",),
        word_start=True,
    ),
    # The path of a Slack incoming webhook is its credential; the host stays readable.
    _Shape(
        "slack_webhook",
        re.compile(r"hooks\.slack\.com/(?:services|workflows)/(?P<secret>[a-z0-9_/]+)"),
        starts=("hooks.slack.com",),
        lowercase=True,
    ),
    # JWT: base64url JSON header (eyJ...), payload, signature.
    _Shape(
        "jwt",
        re.compile(r"eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]*"),
        starts=("eyj",),
        word_start=True,
    ),
    # Anything else long and random: tokens of the base64/base64url alphabet; '/' and '.' split
    # tokens so that paths and host names are judged by their parts, and '=' is padding only
    # (so "sig=<hex>" is judged by its value).
    _Shape(
        "high_entropy",
        re.compile(r"(?P<secret>[A-Za-z0-9+_-]{32,}={0,2})"),
        min_length=32,
        accept=_random_looking,
    ),
)


#: Every shape but the randomness heuristic: the shapes that name what they match.
_SHAPES_BY_NAME = tuple(shape for shape in _SHAPES if shape.name != "high_entropy")


def _lower_same_length(text: str) -> str:
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    # A few characters lower-case to two ("İ"); keep those as they are so spans line up.
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


# Every literal a shape can start with. Testing each with ``in`` (C speed) says which shapes
# can match at all: most texts hold none of them, and identifier fields are checked on every
# event the projector decodes.
_STARTS = frozenset(literal for shape in _SHAPES for literal in shape.starts)
# Shorter than this, a text without any of those literals cannot match any shape.
_SHORTEST_UNANCHORED = min(shape.min_length for shape in _SHAPES if not shape.starts)


def _candidates(shape: _Shape, masked: str, lowered: str, present: set[str]) -> list[re.Match[str]]:
    subject = lowered if shape.lowercase else masked
    if not shape.starts:
        return list(shape.pattern.finditer(subject))
    # str.find jumps to the few places a match can start; letting the regex engine try every
    # position instead costs ~30 us per 1000 characters per shape.
    found = []
    for literal in present.intersection(shape.starts):
        at = lowered.find(literal)
        while at != -1:
            m = shape.pattern.match(subject, at)
            if m is not None:
                found.append(m)
            at = lowered.find(literal, at + 1)
    return found


def secret_spans(text: str, *, heuristic: bool = True) -> list[Span]:
    """Sorted, non-overlapping ``(start, end)`` spans of ``text`` that hold credentials, as
    written and as read (:func:`folded`: a key split by a zero-width space, or spelt with
    fullwidth or Cyrillic letters, is found, and its span covers what hid it).

    ``heuristic=False`` leaves out the shape that judges by randomness alone (long high-entropy
    tokens): identifier fields such as a provider's own call id are random by nature."""
    found = _spans_as_written(text, heuristic=heuristic)
    if text.isascii():
        return found
    # The whole text folded at C speed first; where each character came from is worked out,
    # one character at a time, only for a text in which the folded reading finds something.
    read = _fold(text)
    if read == text:
        return found
    hidden = _spans_as_written(read, heuristic=heuristic)
    if not hidden:
        return found
    read, origin = folded(text)
    for start, end in _spans_as_written(read, heuristic=heuristic):
        found.append((origin[start], origin[end - 1] + 1))
    return merge_spans(found)


# -- what a text says, not how it is spelt --------------------------------------------------------

#: Cyrillic and Greek letters a reader takes for Latin ones (from Unicode's confusables, for the
#: letters credentials are written in); NFKC already folds fullwidth and compatibility forms.
_LOOKALIKES = str.maketrans(
    {
        "\u0430": "a",
        "\u0435": "e",
        "\u043e": "o",
        "\u0440": "p",
        "\u0441": "c",
        "\u0443": "y",
        "\u0445": "x",
        "\u0456": "i",
        "\u0458": "j",
        "\u0455": "s",
        "\u0501": "d",
        "\u04bb": "h",
        "\u04cf": "l",
        "\u051b": "q",
        "\u051d": "w",
        "\u0410": "A",
        "\u0412": "B",
        "\u0415": "E",
        "\u041a": "K",
        "\u041c": "M",
        "\u041d": "H",
        "\u041e": "O",
        "\u0420": "P",
        "\u0421": "C",
        "\u0422": "T",
        "\u0425": "X",
        "\u0423": "Y",
        "\u0406": "I",
        "\u0408": "J",
        "\u0405": "S",
        "\u0391": "A",
        "\u0392": "B",
        "\u0395": "E",
        "\u0396": "Z",
        "\u0397": "H",
        "\u0399": "I",
        "\u039a": "K",
        "\u039c": "M",
        "\u039d": "N",
        "\u039f": "O",
        "\u03a1": "P",
        "\u03a4": "T",
        "\u03a5": "Y",
        "\u03a7": "X",
        "\u03bf": "o",
        "\u03b9": "i",
        "\u03bd": "v",
        "\u03c1": "p",
        "\u03c4": "t",
    }
)
#: Invisible characters that are not format characters (Cf) or marks (Mn, Me) by category.
_INVISIBLE = "\u115f\u1160\u3164\uffa0"
#: Where the characters a reader does not see live: the BMP, the supplementary planes' marks and
#: the tag characters (U+E0000-U+E0FFF, invisible "ASCII" that has hidden text in prompts).
_UNSEEN_RANGES = (range(0x80, 0x30000), range(0xE0000, 0xE1000))


@functools.cache
def _reading_table() -> dict[int, str | None]:
    # Built on the first text that is not ASCII (about 0.1 s), not at import.
    table: dict[int, str | None] = {
        code: None
        for span in _UNSEEN_RANGES
        for code in span
        if unicodedata.category(chr(code)) in ("Cf", "Mn", "Me")
    }
    table.update(dict.fromkeys(map(ord, _INVISIBLE)))
    table.update(_LOOKALIKES)
    return table


def _fold(text: str) -> str:
    # NFKD, not NFKC: decomposing never joins two characters into one, so the text folded
    # whole equals the text folded character by character (folded), marks dropped either way.
    return unicodedata.normalize("NFKD", text).translate(_reading_table())


def folded(text: str) -> tuple[str, list[int]]:
    """``text`` as a reader sees it, with where each of its characters came from: format
    characters (zero-width spaces and joiners, the soft hyphen, bidirectional marks, tags),
    combining marks and other invisible characters dropped; compatibility forms (fullwidth
    letters, ligatures) decomposed by NFKD; lookalike letters of other scripts read as the
    Latin ones."""
    out: list[str] = []
    origin: list[int] = []
    for index, char in enumerate(text):
        if char.isascii():
            out.append(char)
            origin.append(index)
            continue
        for part in _fold(char):
            out.append(part)
            origin.append(index)
    return "".join(out), origin


def _spans_as_written(text: str, *, heuristic: bool) -> list[Span]:
    own = own_id_spans(text)
    if own == [(0, len(text))]:
        return []  # exactly one of our ids (the usual provider_ref): nothing else in it
    masked = text
    for start, end in own:
        masked = masked[:start] + _MASK * (end - start) + masked[end:]
    lowered = _lower_same_length(masked)
    present = {literal for literal in _STARTS if literal in lowered}
    if not present and len(text) < _SHORTEST_UNANCHORED:
        return []
    found: list[Span] = []
    for shape in _SHAPES if heuristic else _SHAPES_BY_NAME:
        if len(text) < shape.min_length or (shape.starts and present.isdisjoint(shape.starts)):
            continue
        for m in _candidates(shape, masked, lowered, present):
            if shape.word_start and m.start() > 0 and _is_word_char(masked[m.start() - 1]):
                continue
            if shape.accept is not None and not shape.accept(m, masked):
                continue
            start, end = m.span("secret") if shape.has_secret_group else m.span()
            if start < end and not any(s <= start and end <= e for s, e in own):
                found.append((start, end))
    return merge_spans(found) if found else found


def merge_spans(spans: list[Span]) -> list[Span]:
    """``spans`` sorted, with overlapping or touching spans joined."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def redact_spans(text: str, spans: list[Span]) -> str:
    """``text`` with each span (merged first) replaced by ``[REDACTED]``."""
    out: list[str] = []
    last = 0
    for start, end in merge_spans(spans):
        out += [text[last:start], REDACTED]
        last = end
    out.append(text[last:])
    return "".join(out)


def looks_secret(text: str, *, heuristic: bool = True) -> bool:
    """True when ``text`` contains something shaped like a credential (see secret_spans)."""
    return bool(secret_spans(text, heuristic=heuristic))


def redact(text: str) -> str:
    """``text`` with every credential-shaped span replaced by ``[REDACTED]``."""
    spans = secret_spans(text)
    return redact_spans(text, spans) if spans else text
