"""Redaction reads a text as a person does: a credential hidden behind zero-width or other
format characters, combining marks, fullwidth forms or lookalike letters of other scripts is
found and redacted whole (an outside probe got ``sk_live_51HSplit\\u200bLeakProbe...`` into the
execution topic, ``agent_operations`` and ``operation_history`` unredacted)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.domain.redact import REDACTED, folded, looks_secret, redact
from ledger.domain.states import ExecutionState
from ledger.secrets import scrub
from tests.unit.factories import execution

ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
#: Credential shapes from the detector's table, each with the alphabet of its random part.
SHAPES = [
    ("sk_live_", ALNUM, 24),
    ("ghp_", ALNUM, 36),
    ("xoxb-", ALNUM, 24),
    ("AKIA", "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16),
    ("AIza", ALNUM + "_-", 35),
]
#: What hides a character from a regex but not from a reader.
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\u00ad", "\ufeff", "\u200e", "\u034f"]
CYRILLIC = {"a": "\u0430", "e": "\u0435", "o": "\u043e", "p": "\u0440", "c": "\u0441",
            "x": "\u0445", "A": "\u0410", "E": "\u0415", "K": "\u041a", "M": "\u041c"}  # fmt: skip


@st.composite
def hidden_secrets(draw: st.DrawFn) -> tuple[str, str]:
    """(the secret as a reader reads it, the same secret disguised)."""
    prefix, alphabet, length = draw(st.sampled_from(SHAPES))
    secret = prefix + draw(st.text(alphabet=alphabet, min_size=length, max_size=length))
    disguised = []
    for char in secret:
        way = draw(st.sampled_from(["as is", "as is", "fullwidth", "lookalike", "hidden after"]))
        if way == "fullwidth" and "!" <= char <= "~":
            disguised.append(chr(ord(char) + 0xFEE0))
        elif way == "lookalike" and char in CYRILLIC:
            disguised.append(CYRILLIC[char])
        elif way == "hidden after":
            disguised.append(char + draw(st.sampled_from(INVISIBLE)))
        else:
            disguised.append(char)
    # At least one disguise, or the case is the plain one other tests hold.
    at = draw(st.integers(min_value=1, max_value=len(secret) - 1))
    disguised.insert(at, draw(st.sampled_from(INVISIBLE)))
    return secret, "".join(disguised)


@given(hidden_secrets(), st.sampled_from(["card declined: {} (retry later)", "{}", "key={};"]))
def test_a_disguised_credential_is_found_and_redacted_whole(
    case: tuple[str, str], around: str
) -> None:
    secret, disguised = case
    text = around.format(disguised)
    assert folded(disguised)[0] == secret
    assert looks_secret(text)
    cleaned = redact(text)
    assert REDACTED in cleaned
    read = folded(cleaned)[0]
    assert secret not in read and secret[len(secret) // 2 :] not in read, cleaned
    assert not looks_secret(cleaned)
    assert not looks_secret(scrub(text))


def test_the_probes_key_cannot_be_recorded() -> None:
    said = "sk_live_51HSplit\u200bLeakProbe0123456789abcdef"
    with pytest.raises(ValueError, match="credential"):
        execution(ExecutionState.FAILED, 1, error=said)
    assert scrub(f"declined: {said}") == f"declined: {REDACTED}"


@pytest.mark.parametrize(
    "text",
    [
        "Карта отклонена: недостаточно средств на счёте клиента",
        "Ελληνικά: η συναλλαγή απορρίφθηκε από την τράπεζα",
        "注文は処理されました。ありがとうございます。",
        "Café crème, naïve façade, Ærøskøbing",
    ],
)
def test_prose_in_other_scripts_is_not_taken_for_a_credential(text: str) -> None:
    assert not looks_secret(text)
    assert redact(text) == text


def test_folding_keeps_where_each_character_came_from() -> None:
    read, origin = folded("a\u200b\uff42\u0441")
    assert read == "abc"
    assert origin == [0, 2, 3]
