"""Text from outside, made safe to show on an operator's terminal or in a log line.

A provider's reason, a destination's answer, an anomaly's quoted field: the log records them as
they were said, and ``opledger ops show`` or ``opledger stack logs`` prints them. A terminal acts
on some characters instead of showing them: ESC begins sequences that clear the screen, set the
window title, or write the clipboard (OSC 52); a carriage return or a newline lets a line pose as
another (a forged log line); the bidirectional overrides reorder what is shown ("Trojan Source").
:func:`displayable` writes each of those as a visible escape, and leaves every other character,
non-ASCII letters included, as it is. What is stored is never changed: only what is shown.
"""

from __future__ import annotations

import re

# C0 controls but tab, DEL, C1 controls; the bidirectional marks, embeddings, overrides and
# isolates; the line and paragraph separators some terminals and viewers break lines on.
_UNSAFE = re.compile(
    "[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
_UNSAFE_KEEPING_LINES = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def displayable(text: str, *, lines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as ``\\xNN`` or
    ``\\uNNNN``; with ``lines``, newlines are kept (a traceback's), carriage returns are not."""
    pattern = _UNSAFE_KEEPING_LINES if lines else _UNSAFE
    if pattern.search(text) is None:
        return text
    return pattern.sub(_escaped, text)
