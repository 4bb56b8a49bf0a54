"""How a client proves who it is (decision 029): the settings, the configuration every client
is built from, and the ACLs each role gets, without a broker (the broker's own answers are
``tests/integration/test_kafka_access.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.kafka import KafkaCredentialsError, admin_config, connection_config
from ledger.kafka_access import OPERATOR, SERVICE_ROLES, access_rules
from ledger.settings import Settings, SettingsError


def _home(tmp_path: Path, principal: str = "sdk", password: str = "s3cret") -> Settings:
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    (keys / f"kafka-{principal}.password").write_text(f"{password}\n")
    return Settings(home=tmp_path)


def test_the_local_broker_is_reached_over_sasl_and_another_as_its_settings_say() -> None:
    assert Settings(home=Path("/x")).kafka_security_protocol == "sasl_plaintext"
    elsewhere = Settings(home=Path("/x"), kafka_bootstrap="kafka:9092")
    assert elsewhere.kafka_security_protocol == "plaintext"
    assert elsewhere.with_(kafka_security="sasl_ssl").kafka_security_protocol == "sasl_ssl"


def test_a_process_signs_in_as_its_role_unless_one_principal_is_named() -> None:
    settings = Settings(home=Path("/x"))
    assert settings.kafka_user == "sdk"
    assert settings.as_kafka_role("projector").kafka_user == "projector"
    named = settings.with_(kafka_principal="svc-billing")
    assert named.as_kafka_role("projector").kafka_user == "svc-billing"
    assert named.kafka_password_path == Path("/x/keys/kafka-svc-billing.password")


def test_every_client_carries_the_credential_from_its_file(tmp_path: Path) -> None:
    settings = _home(tmp_path).as_kafka_role("sdk")
    config = admin_config(settings)
    assert config["security.protocol"] == "sasl_plaintext"
    assert config["sasl.mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl.username"], config["sasl.password"]) == ("sdk", "s3cret")


def test_a_missing_password_file_is_one_sentence_naming_it(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path).as_kafka_role("delivery")
    with pytest.raises(KafkaCredentialsError, match=r"kafka-delivery\.password.*stack up"):
        connection_config(settings)
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "kafka-delivery.password").write_text("\n")
    with pytest.raises(KafkaCredentialsError, match="empty"):
        connection_config(settings)


def test_tls_names_the_ca_and_plaintext_carries_no_credential(tmp_path: Path) -> None:
    settings = _home(tmp_path).with_(kafka_security="sasl_ssl", kafka_ca_file="/etc/ca.pem")
    assert connection_config(settings)["ssl.ca.location"] == "/etc/ca.pem"
    plain = connection_config(Settings(home=tmp_path, kafka_security="plaintext"))
    assert not any(key.startswith("sasl") for key in plain)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kafka_security", "ssl-ish"),
        ("kafka_principal", "bad user"),
        ("kafka_principal", "x\x1b[2J"),
        ("kafka_sasl_mechanism", "GSSAPI"),
    ],
)
def test_bad_kafka_settings_are_refused_naming_the_variable(field: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"OPLEDGER_{field.upper()}"):
        Settings(home=Path("/x")).with_(**{field: value})


def test_services_may_not_write_the_policy_topic_and_only_the_operator_may() -> None:
    settings = Settings(home=Path("/x"), topic_prefix="p")
    rules = access_rules(settings)
    policy_writes = [
        r for r in rules if r.operation == "WRITE" and r.name in ("p.", settings.policy_topic)
    ]
    for role in SERVICE_ROLES:
        mine = {(r.permission, r.pattern, r.name) for r in policy_writes if r.principal == role}
        assert ("DENY", "LITERAL", settings.policy_topic) in mine, role
    operator = [r for r in rules if r.principal == OPERATOR]
    assert {r.name for r in operator if r.operation == "WRITE"} == {settings.policy_topic}
    assert not [r for r in rules if r.permission == "DENY" and r.principal == OPERATOR]


def test_no_role_gets_delete_alter_or_cluster_rights() -> None:
    rules = access_rules(Settings(home=Path("/x")))
    assert {r.operation for r in rules} <= {"READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS"}
    assert {r.resource for r in rules} == {"TOPIC", "GROUP"}


def test_each_worker_joins_only_its_own_groups() -> None:
    settings = Settings(home=Path("/x"), topic_prefix="p")
    groups: dict[str, set[str]] = {}
    for rule in access_rules(settings):
        if rule.resource == "GROUP":
            groups.setdefault(rule.principal, set()).add(rule.name)
    shared = settings.readers_group("")
    assert groups["projector"] == {settings.projector_group, "p-projector", shared}
    assert groups["recovery"] == {settings.recovery_group, "p-recovery", shared}
    assert groups["delivery"] == {settings.delivery_group, "p-delivery", shared}
    assert groups["consumer"] == {"p-consumer", "p-keystore", shared}
    assert groups["sdk"] == {"p-sdk", shared}
    # No role's prefixes cover another's group.
    for role, mine in groups.items():
        for other, theirs in groups.items():
            if other != role:
                owned = theirs - {shared}
                assert not {g for g in owned if any(g.startswith(m) for m in mine)}, (role, other)
