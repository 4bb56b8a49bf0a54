"""Text from outside cannot act on the terminal or the log it is shown in."""

from __future__ import annotations

import logging
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from ledger.domain.display import displayable
from ledger.secrets import RedactingFilter

ACTS = "\x1b\r\n\x07\x08\x7f\x9b\u202e\u2066\u2028"


def _acts_on_a_terminal(ch: str) -> bool:
    return (
        (unicodedata.category(ch) == "Cc" and ch != "\t")
        or ch in "\u061c\u200e\u200f\u2028\u2029"
        or "\u202a" <= ch <= "\u202e"
        or "\u2066" <= ch <= "\u2069"
    )


def test_escape_sequences_are_shown_not_run() -> None:
    said = "declined\x1b]52;c;ZXZpbA==\x07\x1b[2J\rOK"
    assert displayable(said) == "declined\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x0dOK"


def test_a_forged_log_line_stays_on_its_own_line() -> None:
    said = "boom\n2026-12-02 05:00:00 INFO opledger: all good"
    assert "\n" not in displayable(said)
    assert displayable(said, lines=True) == said


def test_trojan_source_overrides_are_visible() -> None:
    assert displayable("acme\u202egnp.exe") == "acme\\u202egnp.exe"


def test_letters_of_every_script_and_tabs_are_left_alone() -> None:
    text = "Zoë 東京 مرحبا\tdone 🙂"
    assert displayable(text) is text


@given(st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(ACTS)))
def test_nothing_that_acts_on_a_terminal_is_left(text: str) -> None:
    shown = displayable(text)
    assert not any(_acts_on_a_terminal(ch) for ch in shown)
    kept = displayable(text, lines=True)
    assert not any(_acts_on_a_terminal(ch) and ch != "\n" for ch in kept)


@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_text_without_such_characters_is_unchanged(text: str) -> None:
    if not any(_acts_on_a_terminal(ch) for ch in text):
        assert displayable(text) == text


def test_the_log_filter_shows_a_providers_words_without_running_them() -> None:
    record = logging.LogRecord(
        "opledger.recovery", logging.WARNING, __file__, 1, "lookup said: %s", ("\x1b[2Jx\ny",), None
    )
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "lookup said: \\x1b[2Jx\\x0ay"
