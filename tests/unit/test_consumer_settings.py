"""The consumer's settings: defaults, validation naming the variable, and a secret that is never
shown (not in repr, not in an error message)."""

from __future__ import annotations

import base64

import pytest

from ledger.settings import Settings, SettingsError
from tests.consumer_support import OTHER_SECRET, SECRET

HOME = {"OPLEDGER_HOME": "/srv/opledger"}


def test_consumer_defaults() -> None:
    s = Settings.from_env(HOME)
    assert (s.consumer_name, s.consumer_web_port, s.consumer_timestamp_tolerance_s) == (
        "reference",
        16068,
        300,
    )
    assert s.consumer_dsn == (
        f"postgresql://opledger@127.0.0.1:15432/opledger_consumer?passfile={s.home}/keys/pgpass"
    )
    assert s.consumer_secret_list == ()
    assert s.consumer_keys_topic == "opledger.consumer-keys.v1"
    assert (s.consumer_keepalive_timeout_s, s.consumer_request_timeout_s) == (75, 30)
    assert s.consumer_hold_limit_s == 3600
    assert s.consumer_dead_letter_topic == "opledger.consumer-deadletter.v1"


def test_consumer_overrides() -> None:
    s = Settings.from_env(
        {
            **HOME,
            "OPLEDGER_CONSUMER_NAME": "crm.v2",
            "OPLEDGER_CONSUMER_WEB_PORT": "26068",
            "OPLEDGER_CONSUMER_PG_DSN": "postgresql://u@db/inbox",
            "OPLEDGER_CONSUMER_SECRETS": f"{SECRET}  {OTHER_SECRET}",
            "OPLEDGER_CONSUMER_TIMESTAMP_TOLERANCE_S": "60",
            "OPLEDGER_CONSUMER_KEEPALIVE_TIMEOUT_S": "5",
            "OPLEDGER_CONSUMER_REQUEST_TIMEOUT_S": "7",
            "OPLEDGER_CONSUMER_MAX_CONNECTIONS": "64",
            "OPLEDGER_CONSUMER_MAX_CONNECTIONS_PER_CLIENT": "16",
            "OPLEDGER_CONSUMER_HOLD_LIMIT_S": "90",
            "OPLEDGER_TOPIC_PREFIX": "t1",
        }
    )
    assert (s.consumer_name, s.consumer_web_port, s.consumer_dsn) == (
        "crm.v2",
        26068,
        "postgresql://u@db/inbox",
    )
    assert s.consumer_secret_list == (SECRET, OTHER_SECRET)
    assert s.consumer_timestamp_tolerance_s == 60
    assert (s.consumer_keepalive_timeout_s, s.consumer_request_timeout_s) == (5, 7)
    assert (s.consumer_max_connections, s.consumer_max_connections_per_client) == (64, 16)
    assert s.consumer_keys_topic == "t1.consumer-keys.v1"
    assert s.consumer_hold_limit_s == 90
    assert s.consumer_dead_letter_topic == "t1.consumer-deadletter.v1"


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("OPLEDGER_CONSUMER_NAME", ""),
        ("OPLEDGER_CONSUMER_NAME", "a/b"),
        ("OPLEDGER_CONSUMER_NAME", "x" * 65),
        ("OPLEDGER_CONSUMER_WEB_PORT", "0"),
        ("OPLEDGER_CONSUMER_WEB_PORT", "abc"),
        ("OPLEDGER_CONSUMER_TIMESTAMP_TOLERANCE_S", "0"),
        ("OPLEDGER_CONSUMER_TIMESTAMP_TOLERANCE_S", "301"),
        ("OPLEDGER_CONSUMER_KEEPALIVE_TIMEOUT_S", "0"),
        ("OPLEDGER_CONSUMER_REQUEST_TIMEOUT_S", "0"),
        ("OPLEDGER_CONSUMER_REQUEST_TIMEOUT_S", "1.5"),
        ("OPLEDGER_CONSUMER_MAX_CONNECTIONS", "0"),
        ("OPLEDGER_CONSUMER_MAX_CONNECTIONS_PER_CLIENT", "0"),
        ("OPLEDGER_CONSUMER_HOLD_LIMIT_S", "0"),
        ("OPLEDGER_CONSUMER_HOLD_LIMIT_S", "1h"),
    ],
)
def test_bad_consumer_values_name_the_variable(name: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({**HOME, name: raw})


@pytest.mark.parametrize(
    "secret",
    [
        "c2VjcmV0LXdpdGhvdXQtcHJlZml4LTEyMzQ1Njc4OTA=",  # no whsec_ prefix
        "whsec_" + base64.b64encode(b"short").decode(),
        "whsec_" + base64.b64encode(bytes(65)).decode(),
        "whsec_not*base64*at*all*but*long*enough*xx",
        "whsec_",
    ],
)
def test_a_bad_secret_is_refused_without_showing_it(secret: str) -> None:
    with pytest.raises(SettingsError, match="OPLEDGER_CONSUMER_SECRETS") as raised:
        Settings.from_env({**HOME, "OPLEDGER_CONSUMER_SECRETS": f"{SECRET} {secret}"})
    assert "secret 2" in str(raised.value)
    for shown in (secret, secret.removeprefix("whsec_"), SECRET):
        if shown not in ("", "whsec_"):  # the message names the prefix itself
            assert shown not in str(raised.value)


def test_the_secret_is_not_in_the_settings_repr() -> None:
    s = Settings.from_env({**HOME, "OPLEDGER_CONSUMER_SECRETS": SECRET})
    assert SECRET not in repr(s)
    assert SECRET.removeprefix("whsec_") not in repr(s)
    assert "consumer_name='reference'" in repr(s)


def test_one_delivery_worker_fits_in_the_receivers_bound_per_client() -> None:
    """By default a delivery worker opens up to its concurrency in connections to one
    destination; the reference receiver's bound per client address must not refuse them."""
    defaults = Settings.from_env(HOME)
    assert defaults.consumer_max_connections_per_client >= defaults.delivery_concurrency
    assert defaults.consumer_max_connections_per_client < defaults.consumer_max_connections
