"""The local broker on TLS with certificates its user supplies (decision 035).

A stack of the test's own, in a private home on free ports, started by ``opledger stack up``
as a user starts it, with a keystore made by openssl or by keytool. What is checked is what a
client on the wire sees: the whole demo (services, projector, recovery, delivery, consumer,
each a real process) runs over SASL_SSL, while a client that speaks SASL without TLS, or that
trusts another CA, is refused by the broker's listener.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from confluent_kafka.admin import AdminClient

from ledger.kafka import connection_config
from ledger.settings import Settings
from opledger import stack
from opledger.stack.home import kafka_conf
from tests.own_stack_support import own_stack_env
from tests.process_support import run_cli
from tests.tls_support import (
    BrokerCertificate,
    keytool_pkcs12_keystore,
    openssl_ca,
    openssl_pem_keystore,
)

pytestmark = pytest.mark.integration


def _with_certificate(env: dict[str, str], certificate: BrokerCertificate) -> dict[str, str]:
    """``env`` with the broker's certificate named. No OPLEDGER_KAFKA_SECURITY: the local
    broker's keystore alone turns TLS on, for the stack and for every client."""
    env = {
        **env,
        "OPLEDGER_KAFKA_TLS_KEYSTORE": str(certificate.keystore),
        "OPLEDGER_KAFKA_CA_FILE": str(certificate.ca_file),
    }
    if certificate.password_file is not None:
        env["OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE"] = str(certificate.password_file)
    return env


@pytest.fixture
def own_env(stack_settings: Settings) -> Iterator[dict[str, str]]:
    """A stack of the test's own (``tests.own_stack_support``)."""
    with own_stack_env(stack_settings, "tls") as env:
        yield env


def _reaches(settings: Settings, **overrides: str) -> str | None:
    """None if a client with ``overrides`` lists the broker's topics, else librdkafka's
    reason. Its own logs are silenced: failing is what some of them are here for."""
    config = {**connection_config(settings), **overrides, "log_level": 0}
    try:
        AdminClient(config).list_topics(timeout=8)
    except Exception as exc:
        return str(exc)
    return None


def test_the_demo_runs_over_tls_with_an_openssl_key_and_clients_without_it_are_refused(
    own_env: dict[str, str], tmp_path: Path
) -> None:
    env = _with_certificate(own_env, openssl_pem_keystore(tmp_path / "certs"))
    up = run_cli(env, "stack", "up", timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    user = Settings.from_env(env)
    properties = (kafka_conf(user) / "server.properties").read_text()
    assert f"SASL_SSL://127.0.0.1:{env['OPLEDGER_KAFKA_PORT']}" in properties

    demo = run_cli(env, "demo", "--operations", "40", timeout=420)
    assert demo.returncode == 0, f"stdout:\n{demo.stdout}\nstderr:\n{demo.stderr}"
    assert "every invariant held" in demo.stdout, demo.stdout
    assert "operations lost or unfinished: 0 of 40" in demo.stdout, demo.stdout

    assert user.kafka_security_protocol == "sasl_ssl"
    admin = user.as_kafka_role("admin")
    assert _reaches(admin) is None
    # SASL without TLS on the same port: the broker's TLS listener never answers it.
    assert _reaches(admin, **{"security.protocol": "sasl_plaintext"}) is not None
    # TLS trusting another CA: the broker's certificate does not verify.
    other_ca, _key = openssl_ca(tmp_path / "other", name="other-ca")
    assert _reaches(admin, **{"ssl.ca.location": str(other_ca)}) is not None
    down = run_cli(env, "stack", "down")
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_keytool_keystore_turns_a_running_plaintext_broker_to_tls_on_the_next_up(
    own_env: dict[str, str], tmp_path: Path
) -> None:
    plain_env = own_env
    stack.up(Settings.from_env(plain_env), echo=lambda _line: None, workers=False)
    plain = Settings.from_env(plain_env).as_kafka_role("sdk")
    assert plain.kafka_security_protocol == "sasl_plaintext"
    assert _reaches(plain) is None

    certificate = keytool_pkcs12_keystore(tmp_path / "certs", password=uuid4().hex)
    tls_env = _with_certificate(plain_env, certificate)
    said: list[str] = []
    tls = Settings.from_env(tls_env)
    stack.up(tls, echo=said.append, workers=False)
    assert any("restarting it" in line for line in said), said
    sdk = tls.as_kafka_role("sdk")
    assert sdk.kafka_security_protocol == "sasl_ssl"
    assert _reaches(sdk) is None, "the SDK's principal over TLS"
    assert _reaches(plain) is not None, "SASL without TLS after the switch"
    # The keystore's password is the broker's secret: only the 0600 server.properties has it.
    password = certificate.password_file.read_text().strip() if certificate.password_file else ""
    assert password
    for log in (tls.home / "logs").glob("*.log"):
        assert password not in log.read_text(errors="replace"), log
