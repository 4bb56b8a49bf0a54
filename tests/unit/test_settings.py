"""Settings come from an explicit mapping; bad values name the variable the operator must fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ledger import settings as settings_module
from ledger.settings import Settings, SettingsError

HOME = {"OPLEDGER_HOME": "/srv/opledger"}


def test_defaults() -> None:
    s = Settings.from_env(HOME)
    assert s.home == Path("/srv/opledger")
    assert (s.kafka_port, s.kafka_controller_port, s.pg_port) == (19092, 19093, 15432)
    assert (s.partitions, s.projector_batch, s.projector_web_port) == (6, 5000, 16066)
    assert s.topic_prefix == "opledger"
    assert s.projector_group == "opledger-projector"
    assert (s.fault_points, s.log_level, s.kafka_version) == ("", "INFO", "4.4.0")
    assert s.bootstrap_servers == "127.0.0.1:19092"
    # The password is in the stack's passfile, never in the DSN (printed, logged).
    assert s.dsn == f"postgresql://opledger@127.0.0.1:15432/opledger?passfile={s.home}/keys/pgpass"
    assert s.replication_factor == 1, "the local stack's single broker"


def test_derived_topic_names() -> None:
    s = Settings.from_env({**HOME, "OPLEDGER_TOPIC_PREFIX": "test-42.a_b"})
    assert s.execution_topic == "test-42.a_b.execution.v1"
    assert s.delivery_topic == "test-42.a_b.delivery.v1"
    assert s.dead_letter_topic == "test-42.a_b.deadletter.v1"
    assert len({s.execution_topic, s.delivery_topic, s.dead_letter_topic}) == 3


def test_overrides() -> None:
    s = Settings.from_env(
        {
            **HOME,
            "OPLEDGER_KAFKA_PORT": "29092",
            "OPLEDGER_KAFKA_CONTROLLER_PORT": "29093",
            "OPLEDGER_PG_PORT": "25432",
            "OPLEDGER_PARTITIONS": "3",
            "OPLEDGER_PROJECTOR_BATCH": "10",
            "OPLEDGER_PROJECTOR_WEB_PORT": "26066",
            "OPLEDGER_PROJECTOR_GROUP": "g1",
            "OPLEDGER_FAULT_POINTS": "projector.after_commit:kill@3",
            "OPLEDGER_LOG_LEVEL": "DEBUG",
            "OPLEDGER_KAFKA_VERSION": "4.0.0",
            "OPLEDGER_REPLICATION_FACTOR": "3",
        }
    )
    assert (s.kafka_port, s.kafka_controller_port, s.pg_port) == (29092, 29093, 25432)
    assert (s.partitions, s.projector_batch, s.projector_web_port) == (3, 10, 26066)
    assert (s.projector_group, s.fault_points, s.log_level) == (
        "g1",
        "projector.after_commit:kill@3",
        "DEBUG",
    )
    assert s.kafka_version == "4.0.0"
    assert s.replication_factor == 3
    assert s.bootstrap_servers == "127.0.0.1:29092"
    assert s.dsn.startswith("postgresql://opledger@127.0.0.1:25432/opledger?passfile=")


def test_explicit_bootstrap_and_dsn_win_over_ports() -> None:
    s = Settings.from_env(
        {
            **HOME,
            "OPLEDGER_KAFKA_PORT": "1234",
            "OPLEDGER_KAFKA_BOOTSTRAP": "kafka-1:9092,kafka-2:9092",
            "OPLEDGER_PG_DSN": "postgresql://u@db:5432/ledger",
        }
    )
    assert s.bootstrap_servers == "kafka-1:9092,kafka-2:9092"
    assert s.dsn == "postgresql://u@db:5432/ledger"


def test_empty_integer_variable_means_default() -> None:
    assert Settings.from_env({**HOME, "OPLEDGER_PARTITIONS": ""}).partitions == 6


def test_only_the_given_mapping_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPLEDGER_KAFKA_PORT", "1111")
    assert Settings.from_env(HOME).kafka_port == 19092


@pytest.mark.parametrize(
    "name",
    [
        "OPLEDGER_KAFKA_PORT",
        "OPLEDGER_KAFKA_CONTROLLER_PORT",
        "OPLEDGER_PG_PORT",
        "OPLEDGER_PARTITIONS",
        "OPLEDGER_PROJECTOR_BATCH",
        "OPLEDGER_PROJECTOR_WEB_PORT",
    ],
)
@pytest.mark.parametrize("raw", ["abc", "1.5", "0x10"])
def test_non_integer_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({**HOME, name: raw})


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("OPLEDGER_KAFKA_PORT", "0"),
        ("OPLEDGER_KAFKA_PORT", "65536"),
        ("OPLEDGER_KAFKA_CONTROLLER_PORT", "-1"),
        ("OPLEDGER_PG_PORT", "70000"),
        ("OPLEDGER_PROJECTOR_WEB_PORT", "0"),
        ("OPLEDGER_PARTITIONS", "0"),
        ("OPLEDGER_REPLICATION_FACTOR", "0"),
        ("OPLEDGER_PROJECTOR_BATCH", "0"),
        ("OPLEDGER_TOPIC_PREFIX", "has space"),
        ("OPLEDGER_TOPIC_PREFIX", ""),
        ("OPLEDGER_DELIVERY_INLINE_MAX_BYTES", "-1"),
        ("OPLEDGER_DELIVERY_RESULTS_URL", "ftp://ledger.example"),
        ("OPLEDGER_DELIVERY_RESULTS_URL", "https://ledger.example/x?y=1"),
        ("OPLEDGER_DELIVERY_RESULTS_URL", "https://"),
        ("OPLEDGER_DELIVERY_ALLOW_NETWORKS", "10.0.0.1/8"),
    ],
)
def test_out_of_range_value_names_the_variable(name: str, raw: str) -> None:
    # The operator set an environment variable; the message must say which one to fix.
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({**HOME, name: raw})


@pytest.mark.parametrize("port", ["1", "65535"])
def test_port_bounds_are_inclusive(port: str) -> None:
    assert Settings.from_env({**HOME, "OPLEDGER_PG_PORT": port}).pg_port == int(port)


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


def test_settings_are_frozen_and_with_validates() -> None:
    s = Settings.from_env(HOME)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kafka_port = 1  # type: ignore[misc]  # proving it is refused
    changed = s.with_(topic_prefix="t1", pg_port=5432)
    assert (changed.execution_topic, changed.dsn) == (
        "t1.execution.v1",
        f"postgresql://opledger@127.0.0.1:5432/opledger?passfile={s.home}/keys/pgpass",
    )
    assert s.topic_prefix == "opledger"
    with pytest.raises(SettingsError):
        s.with_(partitions=0)


def test_home_expands_the_user() -> None:
    s = Settings.from_env({"OPLEDGER_HOME": "~/ledger-state"})
    assert s.home == Path("~/ledger-state").expanduser()
    assert "~" not in str(s.home)


def test_home_defaults_under_xdg_cache_for_ordinary_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module.os, "geteuid", lambda: 1000)
    assert Settings.from_env({"XDG_CACHE_HOME": "/c"}).home == Path("/c/opledger")


def test_home_defaults_outside_root_home_for_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module.os, "geteuid", lambda: 0)
    assert Settings.from_env({"XDG_CACHE_HOME": "/root/.cache"}).home == Path("/var/lib/opledger")


def test_every_field_maps_to_a_documented_variable() -> None:
    # Every field is documented with its OPLEDGER_* name in the class body.
    source = Path(settings_module.__file__).read_text(encoding="utf-8")
    for field in dataclasses.fields(Settings):
        assert f"#: OPLEDGER_{field.name.upper()}:" in source, field.name


def test_results_are_fetched_from_the_delivery_port_unless_a_url_is_given() -> None:
    assert Settings.from_env(HOME).results_base_url == "http://127.0.0.1:16069"
    given = Settings.from_env({**HOME, "OPLEDGER_DELIVERY_RESULTS_URL": "https://lb.example/l/"})
    assert given.results_base_url == "https://lb.example/l"
