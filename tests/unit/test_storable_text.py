"""ledger.domain.events.storable_text: outside text made storable, and nothing else changed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ledger.domain.events import storable_text, storable_text_problem

# Every code point, surrogates among them (st.text() leaves those out by default), with the
# unstorable ones and the halves of a pair drawn often.
ANY_TEXT = st.text(
    st.one_of(
        st.characters(exclude_categories=()),
        st.sampled_from(["\x00", "\ud800", "\udfff", "\ud83d", "\ude00"]),
    )
)


@given(ANY_TEXT)
def test_any_text_comes_out_storable_and_storable_text_unchanged(text: str) -> None:
    out = storable_text(text)
    assert storable_text_problem(out) is None
    assert len(out) <= len(text)  # a code point for a code point (a pair may join into one)
    if storable_text_problem(text) is None:
        assert out == text


def test_nul_and_lone_surrogates_become_replacement_characters() -> None:
    assert storable_text("a\x00b\ud800c\udfffd") == "a\ufffdb\ufffdc\ufffdd"
    assert storable_text("\U0001f600 and \x01") == "\U0001f600 and \x01"
