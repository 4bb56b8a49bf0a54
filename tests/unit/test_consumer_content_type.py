"""``consumers.server.parse_content_type`` reads ``Content-Type`` as aiohttp did when it served
the receiver (``aiohttp.helpers.parse_content_type``), so the receiver's 415 checks keep their
meaning: same media type, same charset, for any header value."""

from __future__ import annotations

import pytest
from aiohttp.helpers import parse_content_type as aiohttp_parse
from hypothesis import given
from hypothesis import strategies as st

from consumers.server import parse_content_type

TYPICAL = [
    "application/json",
    "application/json; charset=utf-8",
    "Application/JSON; Charset=UTF-8",
    'application/json; charset="utf-8"',
    "application/json ; charset=utf8",
    "application/json;charset=latin-1",
    "application/json; boundary=x; charset=utf-8",
    "text/plain",
    "json",
    "application/json/extra",
    "",
    " ",
    ";",
    "application/json; charset=",
    "application/json; charset",
    "application/problem+json",
    "application/json; charset*=utf-8''utf-8",  # RFC 2231 forms
    "application/json; charset*0=utf; charset*1=-8",
]

header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60
) | st.builds(
    lambda media, params: media + "".join(params),
    st.sampled_from(["application/json", "APPLICATION/Json", "text/plain", "a/b/c", "x"]),
    st.lists(
        st.sampled_from(
            ["; charset=utf-8", ";charset=UTF8", '; charset="latin-1"', "; q=1", " ;", "; a"]
        ),
        max_size=3,
    ),
)


def _aiohttp(raw: str) -> tuple[str, object]:
    media_type, params = aiohttp_parse(raw)
    return media_type, params.get("charset")


@pytest.mark.parametrize("raw", TYPICAL)
def test_typical_values_read_as_aiohttp_read_them(raw: str) -> None:
    assert parse_content_type(raw) == _aiohttp(raw)


@given(header_text)
def test_any_value_reads_as_aiohttp_read_it(raw: str) -> None:
    assert parse_content_type(raw) == _aiohttp(raw)


def test_no_header_is_octet_stream_without_charset() -> None:
    assert parse_content_type(None) == ("application/octet-stream", None)
