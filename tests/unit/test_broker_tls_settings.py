"""The local broker's TLS settings (decision 035) without a broker: which listener it gets,
what its ``server.properties`` says, and which keystores are refused before Kafka sees them,
each with what to do (the broker's own answers are tests/integration/test_broker_tls.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ledger.settings import Settings, SettingsError
from opledger.stack.errors import StackError
from opledger.stack.kafka import BrokerSecrets, BrokerTls, broker_tls, kraft_properties
from tests.tls_support import keytool_pkcs12_keystore, openssl_pem_keystore

SECRETS = BrokerSecrets(admin_password="a", controller_password="c")


def _props(tls: BrokerTls | None) -> dict[str, str]:
    return kraft_properties(
        node_id=1,
        port=9092,
        controller_port=9093,
        voters="1@127.0.0.1:9093",
        log_dir=Path("/data"),
        secrets=SECRETS,
        tls=tls,
    )


def test_a_keystore_puts_the_local_broker_and_its_clients_on_tls() -> None:
    local = Settings(home=Path("/x"))
    assert local.kafka_security_protocol == "sasl_plaintext"
    assert local.with_(kafka_tls_keystore="/k.pem").kafka_security_protocol == "sasl_ssl"
    # A broker named elsewhere is reached as its own settings say, whatever the local one has.
    elsewhere = local.with_(kafka_bootstrap="kafka:9092", kafka_tls_keystore="/k.pem")
    assert elsewhere.kafka_security_protocol == "plaintext"
    with pytest.raises(SettingsError, match="OPLEDGER_KAFKA_TLS_KEYSTORE puts the local broker"):
        local.with_(kafka_tls_keystore="/k.pem", kafka_security="sasl_plaintext")


def test_the_client_listener_is_sasl_over_tls_and_the_controllers_stays_on_loopback() -> None:
    tls = BrokerTls(Path("/k.p12"), "PKCS12", "pw", Path("/ca.pem"))
    props = _props(tls)
    assert props["listeners"] == "SASL_SSL://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:9092"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config" in props
    assert "listener.name.sasl_plaintext.plain.sasl.jaas.config" not in props
    assert props["ssl.keystore.type"] == "PKCS12"
    assert props["ssl.keystore.password"] == "pw"
    assert props["ssl.truststore.location"] == "/ca.pem"
    assert props["ssl.client.auth"] == "none"
    assert "pw" not in repr(tls)
    # A PEM key's password is the key's: Kafka refuses a store password for a PEM file.
    pem = _props(BrokerTls(Path("/k.pem"), "PEM", "pw"))
    assert pem["ssl.key.password"] == "pw" and "ssl.keystore.password" not in pem
    assert "ssl.truststore.location" not in pem
    assert _props(None)["listeners"].startswith("SASL_PLAINTEXT://")
    with pytest.raises(ValueError, match="comes with SASL"):
        kraft_properties(
            node_id=1, port=1, controller_port=2, voters="1@127.0.0.1:2", log_dir=Path("/d"),
            tls=tls,
        )  # fmt: skip


def test_keystores_made_by_openssl_and_keytool_are_taken(tmp_path: Path) -> None:
    pem = openssl_pem_keystore(tmp_path / "pem")
    tls = broker_tls(Settings(home=tmp_path, kafka_tls_keystore=str(pem.keystore)))
    assert tls is not None and tls.keystore_type == "PEM" and tls.password is None
    encrypted = openssl_pem_keystore(tmp_path / "enc", encrypt_with="k3y-pass")
    tls = broker_tls(
        Settings(
            home=tmp_path,
            kafka_tls_keystore=str(encrypted.keystore),
            kafka_tls_keystore_password_file=str(encrypted.password_file),
            kafka_ca_file=str(encrypted.ca_file),
        )
    )
    assert tls is not None and tls.password == "k3y-pass"
    assert tls.truststore == encrypted.ca_file.resolve()
    p12 = keytool_pkcs12_keystore(tmp_path / "p12", password="st0re-pass")
    tls = broker_tls(
        Settings(
            home=tmp_path,
            kafka_tls_keystore=str(p12.keystore),
            kafka_tls_keystore_password_file=str(p12.password_file),
        )
    )
    assert tls is not None and tls.keystore_type == "PKCS12" and tls.password == "st0re-pass"
    assert broker_tls(Settings(home=tmp_path)) is None


def test_keystores_kafka_would_refuse_are_named_with_what_to_do(tmp_path: Path) -> None:
    def refusal(**fields: str) -> str:
        with pytest.raises(StackError) as caught:
            broker_tls(Settings(home=tmp_path, **fields))
        return str(caught.value)

    traditional = openssl_pem_keystore(tmp_path / "rsa", pkcs8=False)
    assert "openssl pkcs8 -topk8" in refusal(kafka_tls_keystore=str(traditional.keystore))

    encrypted = openssl_pem_keystore(tmp_path / "enc", encrypt_with="pw")
    assert "is encrypted" in refusal(kafka_tls_keystore=str(encrypted.keystore))

    plain = openssl_pem_keystore(tmp_path / "plain")
    assert "not encrypted" in refusal(
        kafka_tls_keystore=str(plain.keystore),
        kafka_tls_keystore_password_file=str(encrypted.password_file),
    )
    key_only = tmp_path / "key-only.pem"
    key_only.write_bytes((tmp_path / "plain" / "broker.key").read_bytes())
    os.chmod(key_only, 0o600)
    assert "no certificate" in refusal(kafka_tls_keystore=str(key_only))

    os.chmod(plain.keystore, 0o644)
    assert "chmod 600" in refusal(kafka_tls_keystore=str(plain.keystore))

    p12 = keytool_pkcs12_keystore(tmp_path / "p12", password="pw123456")
    assert "needs its password" in refusal(kafka_tls_keystore=str(p12.keystore))

    assert "name a .pem file" in refusal(kafka_tls_keystore=str(tmp_path / "broker.key"))
    assert "cannot read" in refusal(kafka_tls_keystore=str(tmp_path / "missing.pem"))
    os.chmod(plain.keystore, 0o600)
    assert "holds no PEM certificate" in refusal(
        kafka_tls_keystore=str(plain.keystore), kafka_ca_file=str(encrypted.password_file)
    )
