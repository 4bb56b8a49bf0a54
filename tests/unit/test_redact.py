"""Credentials never enter events (or log lines): what looks secret, what redaction leaves,
and what the edge scrubber (detect-secrets + the domain shapes) removes."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import re
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest
from detect_secrets.plugins import keyword
from detect_secrets.plugins.cloudant import CloudantDetector
from detect_secrets.plugins.ibm_cloud_iam import IbmCloudIamDetector
from detect_secrets.plugins.ibm_cos_hmac import IbmCosHmacDetector
from detect_secrets.plugins.keyword import KeywordDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.softlayer import SoftlayerDetector
from detect_secrets.settings import get_settings
from factories import delivery, event_ids, execution, operation_ids, sha_refs
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger import secrets
from ledger.domain.events import MAX_ERROR_LENGTH
from ledger.domain.redact import (
    REDACTED,
    _entropy,
    _mean_word_length,
    looks_secret,
    redact,
    secret_spans,
)
from ledger.domain.states import DeliveryState, ExecutionState
from ledger.secrets import RedactingFilter, scrub

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


# --- the texts that used to pass unchanged ---------------------------------------------------

REGRESSIONS = {
    "json-api-key": ('{"api_key": "abcd1234efgh5678"}', "abcd1234efgh5678"),
    "aws-secret-in-prose": (
        "AWS secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ),
    "api-key-header-in-prose": ("x-api-key header abcd1234efgh5678ijkl", "abcd1234efgh5678ijkl"),
}


@pytest.mark.parametrize(("text", "secret"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_texts_that_used_to_pass_unchanged_are_now_redacted(text: str, secret: str) -> None:
    assert looks_secret(text)
    for cleaned in (redact(text), scrub(text)):
        assert secret not in cleaned
        assert REDACTED in cleaned
        assert not looks_secret(cleaned)
    with pytest.raises(ValidationError, match="credential"):
        execution(ExecutionState.FAILED, 1, error=text)


# --- one example per credential shape --------------------------------------------------------

_PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj"
SHAPES = {
    "single-quoted-dict": ("{'client_secret': 'Zm9vYmFyYmF6cXV4'}", "Zm9vYmFyYmF6cXV4"),
    "header": ("X-Api-Key: 9f8e7d6c5b4a3f2e", "9f8e7d6c5b4a3f2e"),
    "authorization-token-scheme": ("Authorization: token ghp_x1", "ghp_x1"),
    "basic-header": ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA=="),
    "basic-prose": ("sent basic dXNlcjpwYXNz to the proxy", "dXNlcjpwYXNz"),
    "cookie-header": ("Cookie: theme=dark; sid=s%3Aabc.def", "sid=s%3Aabc.def"),
    "session=": ("session=7c1f9a2b; path=/", "7c1f9a2b"),
    "aws-temporary-key-id": ("role ASIAY34FZKBOKMUTVV7A expired", "ASIAY34FZKBOKMUTVV7A"),
    "gcp-api-key": (
        "maps call with AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY refused",
        "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
    ),
    "gcp-service-account": (
        json.dumps(
            {
                "type": "service_account",
                "private_key": f"-----BEGIN PRIVATE KEY-----\n{_PEM_BODY}\n"
                "-----END PRIVATE KEY-----\n",
            }
        ),
        _PEM_BODY,
    ),
    "truncated-pem": (f"bad key -----BEGIN EC PRIVATE KEY-----\n{_PEM_BODY}", _PEM_BODY),
    "stripe-secret": (
        "charge failed with sk_live_4eC39HqLyjWDarjtT1zdp7dc",
        "4eC39HqLyjWDarjtT1zdp7dc",
    ),
    "stripe-restricted": ("rk_test_51H8x2bKq0aBcDeFgHiJ rejected", "51H8x2bKq0aBcDeFgHiJ"),
    "stripe-publishable": ("pk_live_abcdefghij0123456789", "abcdefghij0123456789"),
    "github-fine-grained": (
        "clone failed: github_pat_11AAAAAAA0abcdefghijklmnopqrstuvwxyz",
        "11AAAAAAA0abcdefghijklmnopqrstuvwxyz",
    ),
    "github-app": (
        "ghs_16C7e42F292c6912E7710c838347Ae178B4a expired",
        "16C7e42F292c6912E7710c838347Ae178B4a",
    ),
    "slack-webhook": (
        "POST https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXX failed",
        "T00000000/B00000000/XXXXXXXXXXXXXXXX",
    ),
    "slack-user-token": ("xoxp-1234567890-0987654321-abcdef", "1234567890-0987654321-abcdef"),
    "jwt": (
        "rejected eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0In0.dozjgNryP4J3jVmNHl0w5N_X"
        " again",
        "dozjgNryP4J3jVmNHl0w5N_X",
    ),
    "url-password-with-colon": ("redis://default:p:w0rd@cache:6379 down", "p:w0rd"),
    "hex-digest-like-key": (
        "signature mismatch for 3f786850e387550fdab836ed7e6dc881de23001b",
        "3f786850e387550fdab836ed7e6dc881de23001b",
    ),
    "base64-blob": (
        "echoed Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1u back",
        "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1u",
    ),
}


@pytest.mark.parametrize(("text", "secret"), SHAPES.values(), ids=SHAPES.keys())
def test_every_credential_shape_is_flagged_and_scrubbed(text: str, secret: str) -> None:
    assert looks_secret(text)
    for cleaned in (redact(text), scrub(text)):
        assert secret not in cleaned
        assert not looks_secret(cleaned)


ORDINARY = [
    "HTTP 503 from webhook:crm",
    "connection reset after dispatch of send_email",
    "provider rejected the request: 422",
    "TimeoutError: timed out after 5.0s",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "KeyError: 'user_id'",
    "No such payment_intent: 'pi_3MtwBwLkdIwHu7ix28a3tqPa'",
    "request 550e8400-e29b-41d4-a716-446655440000 timed out",
    "max_tokens=4096 exceeded the context window",
    "basic validation failed",
    "retry of op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3 (ev_01HZX3K5V8Q9R2T4W6Y8Z0A1B4)",
    "duplicate idempotency_key=op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3",
    "result sha256:" + "0123456789abcdef" * 4 + " already stored",
    "the api key is invalid",
    "session closed by peer",
    "TransitionRecorderConnectionError in producers.recorder",
    "/work/main/.venv/lib/python3.11/site-packages/confluent_kafka/cimpl.py line 42",
]


@pytest.mark.parametrize("text", [*ORDINARY, "token_type: bearer"])
def test_ordinary_error_text_survives_scrub_unchanged(text: str) -> None:
    assert not looks_secret(text)
    assert scrub(text) == text


# --- properties: generated credentials in generated surroundings ------------------------------


def _stretch(seed: bytes, alphabet: str, size: int) -> str:
    """``size`` characters of ``alphabet`` that look random whatever the seed (real keys do);
    hypothesis still picks and shrinks the seed."""
    out: list[str] = []
    block = 0
    while len(out) < size:
        digest = hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        out += [alphabet[byte % len(alphabet)] for byte in digest]
        block += 1
    return "".join(out[:size])


def _random_looking(alphabet: str, min_size: int, max_size: int) -> st.SearchStrategy[str]:
    return st.builds(
        _stretch, st.binary(max_size=8), st.just(alphabet), st.integers(min_size, max_size)
    )


def _has_letter_and_digit(value: str) -> bool:
    return any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LOWER = _UPPER.lower()
_DIGITS = "0123456789"
_ALNUM = _UPPER + _LOWER + _DIGITS
_URLSAFE = _ALNUM + "_-"


def _prefixed(
    prefixes: list[str], alphabet: str, min_size: int, max_size: int
) -> st.SearchStrategy[str]:
    return st.builds(
        str.__add__,
        st.sampled_from(prefixes),
        st.text(alphabet, min_size=min_size, max_size=max_size),
    )


# Fixed shapes take any body (even "AAAA..."); shapes found by their randomness get random-looking
# bodies that mix letters and digits, as the high-entropy shape requires.
TOKENS = {
    "aws_access_key_id": _prefixed(["AKIA", "ASIA"], _UPPER + _DIGITS, 16, 16),
    "aws_secret_access_key": _random_looking(_ALNUM + "+/", 40, 40).filter(
        lambda s: any(c in _DIGITS + "+/" for c in s)
    ),
    "gcp_api_key": _prefixed(["AIza"], _URLSAFE, 35, 35),
    "stripe": _prefixed(
        ["sk_live_", "sk_test_", "rk_live_", "rk_test_", "pk_live_", "pk_test_"], _ALNUM, 24, 99
    ),
    "openai_style": _prefixed(["sk-", "sk-proj-", "sk-ant-api03-"], _URLSAFE, 20, 80),
    "github": _prefixed(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"], _ALNUM, 36, 36)
    | _prefixed(["github_pat_"], _ALNUM + "_", 22, 82),
    "slack_token": _prefixed(["xoxb-", "xoxp-", "xoxa-", "xoxs-"], _ALNUM + "-", 10, 60),
    "jwt": st.builds(
        "eyJ{}.{}.{}".format,
        st.text(_URLSAFE, min_size=5, max_size=40),
        st.text(_URLSAFE, min_size=2, max_size=80),
        st.text(_URLSAFE, max_size=43),
    ),
    # From 48 characters on, all but about 2 lowercase keys in 300,000 are flagged
    # (test_random_keys_of_40_characters_and_more_are_flagged...); the rate at the minimum
    # length is checked by test_the_entropy_shape_flags_nearly_all_random_keys_...
    "high_entropy_base64": _random_looking(_ALNUM, 48, 64).filter(_has_letter_and_digit),
    "high_entropy_hex": _random_looking(_DIGITS + "abcdef", 40, 64).filter(_has_letter_and_digit),
    "high_entropy_lowercase": _random_looking(_LOWER + _DIGITS, 48, 64).filter(
        _has_letter_and_digit
    ),
}

_PROSE = st.lists(
    st.sampled_from(
        [
            "upstream",
            "failed",
            "after",
            "retry",
            "HTTP",
            "503",
            "from",
            "webhook:crm",
            "the",
            "provider",
            "said",
            "request",
            "timed",
            "out",
            "(attempt",
            "3)",
            "connection",
            "reset",
        ]
    ),
    max_size=6,
).map(" ".join)


def _surround(secret: str, form: str, before: str, after: str) -> str:
    """``secret`` where error texts carry one: prose, a JSON body, a header, a query string."""
    if form == "prose":
        return f"{before} {secret} {after}"
    if form == "json":
        return f"{before} {json.dumps({'detail': 'rejected', 'value': secret})} {after}"
    if form == "header":
        return f"{before}\r\nX-Upstream-Echo: {secret}\r\n{after}"
    return f"GET https://api.example.com/v1/items?id=7&sig={secret}&page=2 {after}"


_FORMS = st.sampled_from(["prose", "json", "header", "query"])


def _assert_gone_and_refused(text: str, secret: str) -> None:
    assert looks_secret(text)
    cleaned = scrub(text)
    assert secret not in cleaned
    assert secret not in redact(text)
    # The event model refuses the raw text and takes the scrubbed one.
    with pytest.raises(ValidationError, match="credential"):
        execution(ExecutionState.FAILED, 1, error=text)
    assert execution(ExecutionState.FAILED, 1, error=scrub(text, max_length=MAX_ERROR_LENGTH))


@pytest.mark.parametrize("shape", TOKENS.keys())
@given(data=st.data())
def test_a_generated_token_in_any_surrounding_text_is_flagged_and_scrubbed(
    shape: str, data: st.DataObject
) -> None:
    secret = data.draw(TOKENS[shape], label="secret")
    text = _surround(secret, data.draw(_FORMS), data.draw(_PROSE), data.draw(_PROSE))
    _assert_gone_and_refused(text, secret)


KEY_NAMES = [
    "api_key",
    "apiKey",
    "x-api-key",
    "X-Api-Key",
    "client_secret",
    "access_token",
    "refresh_token",
    "password",
    "db_password",
    "passwd",
    "pwd",
    "auth",
    "auth_token",
    "X-Auth-Token",
    "credentials",
    "session",
    "session_id",
    "sessionToken",
    "secret",
    "AWS_SECRET_ACCESS_KEY",
    "private_key",
    "Cookie",
]
# Realistic credential values: a letter and a digit (so never a placeholder such as "***").
_VALUES = st.text(_ALNUM + "!#$%*+/=_.~-", min_size=8, max_size=40).filter(_has_letter_and_digit)
_PROSE_VALUES = st.text(_ALNUM + "+/=_.~-", min_size=8, max_size=40).filter(_has_letter_and_digit)


@given(
    st.sampled_from(KEY_NAMES),
    _VALUES,
    st.sampled_from(["k=v", "k: v", "json", "python", "query"]),
    _PROSE,
    _PROSE,
)
def test_a_value_after_a_secret_key_name_is_flagged_and_scrubbed(
    key: str, value: str, form: str, before: str, after: str
) -> None:
    pair = {
        "k=v": f"{key}={value}",
        "k: v": f"{key}: {value}",
        "json": json.dumps({key: value}),
        "python": repr({key: value}),
        "query": f"https://api.example.com/v1/x?page=2&{key}={value}&limit=5",
    }[form]
    _assert_gone_and_refused(f"{before} {pair} {after}", value)


@given(st.sampled_from(KEY_NAMES), _PROSE_VALUES, st.sampled_from(["header", "is", ""]), _PROSE)
def test_a_value_named_in_prose_is_flagged_and_scrubbed(
    key: str, value: str, connector: str, after: str
) -> None:
    text = f"{key} {connector} {value} {after}".replace("  ", " ")
    _assert_gone_and_refused(text, value)


@given(
    st.sampled_from(["Authorization: Bearer ", "sent bearer ", "Authorization: Basic "]),
    st.text(_ALNUM + "._~+/-", min_size=8, max_size=64),
    st.text(_ALNUM, min_size=1, max_size=12),
    st.text(_ALNUM + "!$%*_.~-", min_size=1, max_size=24),
    _PROSE,
)
def test_authorization_values_are_flagged_and_scrubbed(
    scheme: str, token: str, user: str, password: str, after: str
) -> None:
    if "Basic" in scheme:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
    _assert_gone_and_refused(f"{scheme}{token}\r\n{after}", token)


@given(
    st.sampled_from(["https", "postgresql", "amqp", "redis", "mongodb+srv"]),
    st.text(_LOWER + _DIGITS + "._-", min_size=1, max_size=12),
    _VALUES.map(lambda v: v.replace("/", "")).filter(_has_letter_and_digit),
    _PROSE,
)
def test_a_password_inside_a_url_is_flagged_and_scrubbed(
    scheme: str, user: str, password: str, after: str
) -> None:
    # A password that is also the user name (or part of it) stays visible there.
    assume(password not in f"{scheme}://{user}")
    _assert_gone_and_refused(
        f"cannot reach {scheme}://{user}:{password}@db.internal/app {after}", password
    )


@given(
    st.sampled_from(["RSA ", "EC ", "OPENSSH ", "ENCRYPTED ", ""]),
    st.lists(_random_looking(_ALNUM + "+/", 16, 64), min_size=1, max_size=4),
    st.booleans(),
    st.booleans(),
)
def test_a_private_key_is_flagged_and_scrubbed(
    kind: str, body: list[str], complete: bool, in_service_account_json: bool
) -> None:
    pem = f"-----BEGIN {kind}PRIVATE KEY-----\n" + "\n".join(body)
    if complete:
        pem += f"\n-----END {kind}PRIVATE KEY-----\n"
    text = (
        json.dumps({"type": "service_account", "private_key": pem})
        if in_service_account_json
        else f"loading key failed: {pem}"
    )
    for line in body:
        _assert_gone_and_refused(text, line)


@given(
    st.text(_ALNUM, min_size=1, max_size=40).map("T{}".format),
    st.text(_ALNUM, min_size=1, max_size=40).map("B{}".format),
    st.text(_ALNUM, min_size=8, max_size=40),
    _PROSE,
)
def test_a_slack_webhook_path_is_flagged_and_scrubbed(
    team: str, bot: str, token: str, after: str
) -> None:
    path = f"{team}/{bot}/{token}"
    _assert_gone_and_refused(f"POST https://hooks.slack.com/services/{path} {after}", path)


@pytest.mark.parametrize(
    "alphabet", [_ALNUM, _LOWER + _DIGITS, _DIGITS + "abcdef"], ids=["base64", "lowercase", "hex"]
)
def test_the_entropy_shape_flags_nearly_all_random_keys_of_the_minimum_length(
    alphabet: str,
) -> None:
    # The thresholds in ledger.domain.redact._random_looking: ~99.5% of random 32-character
    # tokens that mix letters and digits (asserted with some slack).
    keys = [_stretch(str(i).encode(), alphabet, 32) for i in range(2000)]
    keys = [k for k in keys if _has_letter_and_digit(k)]
    flagged = sum(looks_secret(f"got {k} back") for k in keys)
    assert flagged >= 0.97 * len(keys)


@pytest.mark.parametrize(
    "key",
    [
        # Random keys that entropy alone let through (found by drawing 300,000 of each kind):
        # their characters repeat more than usual, but their "words" are as short as random.
        "J8vMO3NriM8IxdUvYYNIkrUiYWbCN78ik887UssMKUgA3Abr",
        "ykKmtDSlyRDQ2GKURDLDyDbBLBWNSLvVvLrwNVKw02KDc4S2",
        "81yck8ik9y2n1qptyy2lqozn2pzsk2lqjq81os8p8eyk2rns",
        "9ao2w596vi9bop02vio441lihoi2pcpw2o5969k4wx6429xv",
    ],
)
def test_random_keys_whose_characters_repeat_are_flagged(key: str) -> None:
    assert looks_secret(f"got {key} back")


@pytest.mark.parametrize(
    ("alphabet", "size"),
    [(_ALNUM, 40), (_ALNUM, 48), (_ALNUM, 64), (_LOWER + _DIGITS, 48), (_LOWER + _DIGITS, 64)],
)
def test_random_keys_of_40_characters_and_more_are_flagged(alphabet: str, size: int) -> None:
    keys = [_stretch(str(i).encode(), alphabet, size) for i in range(20000)]
    keys = [k for k in keys if _has_letter_and_digit(k)]
    missed = [k for k in keys if not looks_secret(f"got {k} back")]
    assert missed == []


def test_every_random_aws_secret_key_is_flagged_even_when_its_characters_repeat() -> None:
    # Found by hypothesis: 40 random base64 characters with entropy 4.19 bits, under the 4.3
    # the shape asked for alone (about 4 random keys in 10,000 were let through).
    assert looks_secret("got LhRRbLh2JDcR2jhRj5HFmbLHR87QHjF9R0OFNcd4 back")
    keys = [_stretch(str(i).encode(), _ALNUM + "+/", 40) for i in range(30000)]
    keys = [k for k in keys if any(c in _DIGITS + "+/" for c in k)]
    missed = [k for k in keys if not looks_secret(f"got {k} back")]
    assert missed == []
    # What the shape's comment says: entropy alone would miss some of them (15 of these), and
    # random keys' camelCase "words" are about two characters long.
    assert sum(_entropy(k) < 4.3 for k in keys) > 0
    assert statistics.median(_mean_word_length(k) for k in keys) < 2.0


@pytest.mark.parametrize(
    "name",
    [
        "AbstractSingletonProxyFactoryBean2Helper",
        "org/apache/kafka/clients/producer/Kafka2",
        "SimpleBeanFactoryAwareAspectInstance2Fac",
        "InternalServerErrorWhileProcessingReq500",
        "usr/local/lib/python3/site/packages/Abcd",
    ],
)
def test_forty_character_names_are_not_taken_for_aws_secret_keys(name: str) -> None:
    assert len(name) == 40
    assert not looks_secret(f"failed in {name} after 3 tries")


@pytest.mark.parametrize(
    "identifier",
    [
        "ProviderUnavailableExceptionHandlerFactoryBean",
        "HTTPConnectionPoolMaxRetryErrorWithBackoffTimeout2",
        "XMLHttpRequestNetworkError3CrossOriginResourceSharing",
        "connection_reset_after_dispatch_of_send_email_v2",
        "tenant-acme-eu-1-agent-7-tool-send_email-v3",
        "cache-key-v2-region-eu-west-1-shard-03",
        "010001789a1b2c3d-4e5f6a7b-8c9d-0e1f-2a3b-4c5d6e7f8a9b-000000",
        "550e8400-e29b-41d4-a716-446655440000",
    ],
)
def test_the_entropy_shape_leaves_long_identifiers_alone(identifier: str) -> None:
    assert not looks_secret(f"failed in {identifier} after 3 tries")


# --- properties: what must survive --------------------------------------------------------------

_ORDINARY_FRAGMENTS = st.one_of(
    st.sampled_from(ORDINARY),
    operation_ids,
    event_ids,
    sha_refs,
    st.uuids().map(str),
    st.sampled_from(["webhook:crm", "queue:billing", "send_email", "payments.refund", "HTTP 503"]),
    st.integers(0, 10**6).map(str),
)


@given(
    st.lists(_ORDINARY_FRAGMENTS, min_size=1, max_size=8),
    st.sampled_from([" ", ", ", "; ", " | ", "\n"]),
)
def test_opledger_ids_and_ordinary_prose_survive_scrub_unchanged(
    parts: list[str], separator: str
) -> None:
    text = separator.join(parts)
    assert not looks_secret(text)
    assert scrub(text) == text


@given(st.lists(st.sampled_from(_FRAGMENTS) | operation_ids | st.text(max_size=12), max_size=8))
def test_the_shortcuts_for_short_texts_find_what_the_full_scan_finds(parts: list[str]) -> None:
    # A text that is exactly one own id, or shorter than the token shapes and without any
    # literal a shape starts with, is answered without scanning. Newlines appended add nothing
    # a shape could use but force the full scan, which must find the same spans.
    text = " ".join(parts)
    padded = secret_spans(text + "\n" * 40)
    assert [(s, min(e, len(text))) for s, e in padded if s < len(text)] == secret_spans(text)


@given(
    st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=12), max_size=8),
    st.integers(10, 300),
)
def test_scrub_with_max_length_is_bounded_and_never_looks_secret(
    parts: list[str], max_length: int
) -> None:
    text = " ".join(parts)
    cleaned = scrub(text, max_length=max_length)
    assert len(cleaned) <= max_length
    assert not looks_secret(cleaned)
    if not looks_secret(text) and len(text) <= max_length:
        assert cleaned == scrub(text)


def test_a_cut_never_splits_a_placeholder() -> None:
    text = "x" * 985 + " password=hunter2"
    assert looks_secret(scrub(text)[:MAX_ERROR_LENGTH])  # what a plain cut would record
    cleaned = scrub(text, max_length=MAX_ERROR_LENGTH)
    assert cleaned.endswith(" password=")
    assert not looks_secret(cleaned)


# --- the event model guards its identifier fields too ------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("destination", "https://hooks.slack.com/services/T0001/B0001/XXXXabcd1234"),
        ("destination", "https://bot:s3cr3t@hooks.example.com/in"),
        ("provider_ref", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
        ("provider_ref", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"),
    ],
)
def test_an_identifier_field_holding_a_credential_is_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match="credential") as info:
        if field == "destination":
            delivery(DeliveryState.PENDING, 0, destination=value)
        else:
            execution(ExecutionState.DISPATCHED, 1, provider_ref=value)
    assert [e["loc"][0] for e in info.value.errors()] == [field]


@pytest.mark.parametrize(
    "ref",
    [
        "op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3",
        "ch_3MqLiJ2eZvKYlo2C/refund=1+2",
        "pi_3MtwBwLkdIwHu7ix28a3tqPa",
        "msg-123",
        "550e8400-e29b-41d4-a716-446655440000",
    ],
)
def test_ordinary_provider_refs_are_accepted(ref: str) -> None:
    assert execution(ExecutionState.DISPATCHED, 1, provider_ref=ref).provider_ref == ref


@pytest.mark.parametrize(
    "destination",
    ["webhook:crm", "queue:billing", "https://hooks.example.com/events", "kafka:downstream.topic"],
)
def test_ordinary_destinations_are_accepted(destination: str) -> None:
    event = delivery(DeliveryState.PENDING, 0, destination=destination)
    assert event.destination == destination


# --- logging --------------------------------------------------------------------------------


def test_a_logger_with_the_redacting_filter_writes_no_secret() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("opledger.test_redact")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logger.info("dispatch failed: %s", "x-api-key header abcd1234efgh5678ijkl")
        # A child logger's records reach the handler by propagation; the handler's filter
        # sees them (a filter on the parent logger would not).
        logging.getLogger("opledger.test_redact.child").warning(
            "retrying with %(key)s", {"key": "AKIAIOSFODNN7EXAMPLE"}
        )
        try:
            raise RuntimeError('upstream said {"api_key": "abcd1234efgh5678"}')
        except RuntimeError:
            logger.exception("call failed for op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3")
        # One argument for two slots, on purpose: the filter must not raise into the caller.
        logger.info("malformed %s %s", "password=hunter2")  # noqa: PLE1206
    finally:
        logger.removeHandler(handler)
    written = stream.getvalue()
    for secret in ("abcd1234efgh5678ijkl", "AKIAIOSFODNN7EXAMPLE", "abcd1234efgh5678", "hunter2"):
        assert secret not in written
    for kept in ("dispatch failed", "op_01HZX3K5V8Q9R2T4W6Y8Z0A1B3", "Traceback", "RuntimeError"):
        assert kept in written
    # Five: the traceback quotes the raising source line as well as the exception message.
    assert written.count(REDACTED) == 5


# --- how detect-secrets is used -----------------------------------------------------------------


def test_scrub_is_thread_safe_and_leaves_detect_secrets_settings_alone() -> None:
    texts = [t for t, _ in (*SECRETS.values(), *SHAPES.values(), *REGRESSIONS.values())] + ORDINARY
    expected = [scrub(t) for t in texts]
    settings = get_settings()
    before = json.dumps([settings.plugins, settings.filters], sort_keys=True)
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            assert list(pool.map(scrub, texts * 4)) == expected * 4
    assert json.dumps([settings.plugins, settings.filters], sort_keys=True) == before
    # Verification would send the found secrets over the network; it stays off.
    assert not any("verification" in path for path in get_settings().filters)


def _last_alternation(pattern: str) -> list[str]:
    """'(?:api|)(?:key|pwd|pass)' -> ['key', 'pwd', 'pass']"""
    groups: list[str] = re.findall(r"\(\?:([^()]*)\)", pattern)
    return groups[-1].split("|")


def test_plugin_gates_cover_every_key_name_the_gated_plugins_look_for() -> None:
    gates = {type(plugin): needs for plugin, needs in secrets._PLUGINS}

    def covered(word: str, plugin: type) -> bool:
        return any(literal in word.lower() for literal in gates[plugin])

    for entry in keyword.DENYLIST:
        assert covered(entry.replace("_?", "_"), KeywordDetector), entry
        assert covered(entry.replace("_?", ""), KeywordDetector), entry
    for plugin, alternation in (
        (IbmCloudIamDetector, IbmCloudIamDetector.key_or_pass),
        (SoftlayerDetector, SoftlayerDetector.key_or_pass),
        (CloudantDetector, CloudantDetector.cl_key_or_pass),
    ):
        for word in _last_alternation(alternation):
            assert covered(word, plugin), (plugin, word)
    assert covered(IbmCosHmacDetector.password_keyword, IbmCosHmacDetector)
    assert covered(CloudantDetector.cloudant_api_url.replace("\\", ""), CloudantDetector)
    assert covered(SoftlayerDetector.denylist[1].pattern, SoftlayerDetector)
    for gated in (MailchimpDetector, SlackDetector):
        for pattern in gated.denylist:
            assert covered(pattern.pattern.replace("\\", ""), gated), pattern
