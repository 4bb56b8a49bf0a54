"""Credentials never enter events: what looks secret, and what redaction leaves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.domain.redact import REDACTED, looks_secret, redact

SECRETS = {
    "bearer": ("Authorization: Bearer abcdefgh12345678", "abcdefgh12345678"),
    "bearer-lowercase": ("sent bearer eyJhbGciOiJIUzI1NiJ9.e30.sig to api", "eyJhbGciOiJIUzI1NiJ9"),
    "password=": ("login failed for user=bob password=hunter2!", "hunter2"),
    "passwd:": ("passwd: tr0ub4dor", "tr0ub4dor"),
    "api_key=": ("GET /v1?api_key=abc123xyz failed", "abc123xyz"),
    "token:": ("token: 9f8e7d6c5b4a", "9f8e7d6c5b4a"),
    "openai-style": ("invalid key sk-proj-AbCdEfGhIjKlMnOp1234 supplied", "AbCdEfGhIjKlMnOp1234"),
    "github": ("push with ghp_0123456789abcdefABCDEF denied", "0123456789abcdefABCDEF"),
    "slack": ("xoxb-123456789012-abcdef rejected", "123456789012-abcdef"),
    "aws": ("AccessDenied for AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
    "private-key": ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow", "BEGIN RSA PRIVATE KEY"),
    "private-key-plain": ("-----BEGIN PRIVATE KEY-----", "BEGIN PRIVATE KEY"),
    "url-userinfo": ("cannot reach https://admin:s3cr3t@db.internal:5432/x", "s3cr3t"),
    "amqp-userinfo": ("amqp://guest:guest@rabbit/", "guest:guest"),
}


@pytest.mark.parametrize(("text", "secret"), SECRETS.values(), ids=SECRETS.keys())
def test_credentials_are_flagged_and_redacted(text: str, secret: str) -> None:
    assert looks_secret(text)
    cleaned = redact(text)
    assert secret not in cleaned
    assert REDACTED in cleaned
    assert not looks_secret(cleaned)


NOT_SECRETS = [
    "provider timeout after 30s",
    "connection reset by peer",
    "HTTP 503 Service Unavailable from https://api.example.com/v1/refunds",
    "destination answered 410 Gone",
    "token expired; refresh required",
    "rate limited: retry after 2s",
    "bearer of bad news",  # too short to be a token
    "password reset email sent",
    "postgresql://opledger@127.0.0.1:15432/opledger refused the connection",  # user, no password
    "https://example.com:8443/path@v2 returned 404",
    "sk-short",
    "task-abcdefghijklmnopqrstuv finished",  # ends in "sk-" but is one word
    "AKIA is a prefix of AWS key ids",
    "public key rejected: -----BEGIN PUBLIC KEY-----",
    "",
]


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_ordinary_error_text_is_not_flagged(text: str) -> None:
    assert not looks_secret(text)
    assert redact(text) == text


def test_redaction_keeps_the_rest_of_the_message() -> None:
    cleaned = redact("refund failed: password=hunter2 (provider timeout after 30s)")
    assert cleaned.startswith("refund failed: ")
    assert cleaned.endswith(" (provider timeout after 30s)")


def test_several_secrets_in_one_text_are_all_redacted() -> None:
    text = "Bearer abcdefgh12345678 then AKIAIOSFODNN7EXAMPLE then https://u:p4ss@h/"
    cleaned = redact(text)
    assert cleaned.count(REDACTED) == 3
    for secret in ("abcdefgh12345678", "AKIAIOSFODNN7EXAMPLE", "p4ss"):
        assert secret not in cleaned


_FRAGMENTS = [s for s, _ in SECRETS.values()] + NOT_SECRETS + [" ", "\n", "=", ":", "@", "//"]


@given(st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=12), max_size=8))
def test_redacted_text_never_looks_secret(parts: list[str]) -> None:
    text = " ".join(parts)
    cleaned = redact(text)
    assert not looks_secret(cleaned)
    # Redaction only ever removes: text that did not look secret is left alone.
    if not looks_secret(text):
        assert cleaned == text
