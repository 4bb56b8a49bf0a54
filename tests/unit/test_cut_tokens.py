"""``ledger.secrets.cut_tokens``: text from outside is cut before the (super-linear) scrub, at a
whitespace, and a token the cut would split is dropped whole."""

from __future__ import annotations

import time

from hypothesis import example, given
from hypothesis import strategies as st

from ledger.secrets import cut_tokens, scrub

SECRET = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"


@given(st.text(max_size=300), st.integers(min_value=0, max_value=200))
# Found by this test: a head that is whitespace alone raised IndexError (a destination's answer
# could stop the delivery worker's pass), and leading whitespace made the kept text no prefix.
@example(text="\r0", limit=1)
@example(text="\r00", limit=2)
@example(text=" \t x", limit=3)
def test_the_cut_is_bounded_and_a_prefix_cut_at_a_whitespace(text: str, limit: int) -> None:
    cut = cut_tokens(text, limit)
    if len(text) <= limit:
        assert cut == text
        return
    assert len(cut) <= limit + len(" [cut]")
    kept = cut.removesuffix("[cut]").removesuffix(" ")
    assert text.startswith(kept)
    assert len(kept) == 0 or len(kept) == len(text) or text[len(kept)].isspace()


@given(st.integers(min_value=4, max_value=len(SECRET) - 1))
def test_a_secret_the_cut_would_split_is_dropped_whole(into: int) -> None:
    text = "503 upstream said " + SECRET + " and more"
    limit = text.index(SECRET) + into
    assert SECRET[:into] not in cut_tokens(text, limit)


def test_a_hostile_answer_is_scrubbed_in_bounded_time() -> None:
    hostile = "aPwd" * 2500  # 10,000 characters shaped for the keyword detector: 17 s whole
    started = time.perf_counter()
    scrub(cut_tokens("500 " + hostile, 128))
    assert time.perf_counter() - started < 1.0
