"""One frozen settings object, built once at start-up from ``OPLEDGER_*`` variables.

No other module reads a setting from the environment: components receive a :class:`Settings`
explicitly, which keeps tests free to build as many differently-configured instances as they
like. ``tests/unit/test_environment_reads.py`` names the only other reads of the environment
(a secret from a variable the operator names, and the operator's login name for the audit).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Self
from urllib.parse import quote

from ledger.domain.schedule import RetryPolicy, parse_schedule

_TOPIC_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
# No "/": it separates the consumer from the operation id in the key store's record keys.
_CONSUMER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PRINCIPAL = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: What OPLEDGER_KAFKA_SECURITY may say (librdkafka's security.protocol values we support).
KAFKA_SECURITY_PROTOCOLS = ("plaintext", "sasl_plaintext", "sasl_ssl")
KAFKA_SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")

#: The local server's owner role: it runs the migrations and the admin commands.
PG_OWNER = "opledger"
#: The service roles on the local server (decision 034), each with only its own rights.
PG_SERVICE_ROLES = ("sdk", "projector", "recovery", "delivery")
PG_ROLES = ("owner", *PG_SERVICE_ROLES)
_PG_DATABASE = re.compile(r"[a-z][a-z0-9_]{0,62}")


def pg_role_name(role: str) -> str:
    """The database role of a service role name (``sdk`` → ``opledger_sdk``; ``owner`` →
    the owner)."""
    return PG_OWNER if role == "owner" else f"{PG_OWNER}_{role}"


#: standardwebhooks 1.1.0 refuses a webhook-timestamp more than 5 minutes from now, whatever its
#: caller wants (the window is a constant in its source), so a wider tolerance could not work.
MAX_TIMESTAMP_TOLERANCE_S = 300


def _var(field_name: str) -> str:
    return f"OPLEDGER_{field_name.upper()}"


class SettingsError(ValueError):
    """An ``OPLEDGER_*`` variable holds a value that cannot be used."""


def _default_home(env: Mapping[str, str]) -> Path:
    if "OPLEDGER_HOME" in env:
        return Path(env["OPLEDGER_HOME"]).expanduser()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # PostgreSQL runs as an unprivileged user when we are root, and that user cannot
        # traverse /root; keep the state where it can.
        return Path("/var/lib/opledger")
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "opledger"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[Network, ...]:
    """Comma-separated CIDRs (``10.1.0.0/16, fd00::/8``; a bare address is one host) as
    networks; ValueError naming the item that is not one (host bits set included: ``10.0.0.1/8``
    is a typo more often than a wish)."""
    networks: list[Network] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ValueError(f"not an IPv4 or IPv6 network in CIDR form: {exc}") from None
    return tuple(networks)


def _webhook_secret_ok(secret: str) -> bool:
    # Standard Webhooks: "whsec_" + base64 of a 24-64 byte key.
    encoded = secret.removeprefix("whsec_")
    if encoded == secret:
        return False
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False
    return 24 <= len(key) <= 64


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything configurable about opledger; every field maps to one ``OPLEDGER_*`` variable."""

    #: OPLEDGER_HOME: local state (Kafka jars and log dirs, PostgreSQL data, process logs).
    home: Path
    #: OPLEDGER_KAFKA_PORT: the broker's client listener on 127.0.0.1.
    kafka_port: int = 19092
    #: OPLEDGER_KAFKA_CONTROLLER_PORT: the KRaft controller listener on 127.0.0.1.
    kafka_controller_port: int = 19093
    #: OPLEDGER_KAFKA_BOOTSTRAP: bootstrap servers; defaults to the local broker.
    kafka_bootstrap: str = ""
    #: OPLEDGER_KAFKA_SECURITY: how clients reach the broker: ``sasl_plaintext`` (the local
    #: stack), ``sasl_ssl`` (TLS, with OPLEDGER_KAFKA_CA_FILE for a private CA) or
    #: ``plaintext``. Empty: for the local broker ``sasl_ssl`` when OPLEDGER_KAFKA_TLS_KEYSTORE
    #: names its certificate, else ``sasl_plaintext``; ``plaintext`` when
    #: OPLEDGER_KAFKA_BOOTSTRAP names another broker (decision 029).
    kafka_security: str = ""
    #: OPLEDGER_KAFKA_TLS_KEYSTORE: the local broker's own private key and certificate, which
    #: put its client listener on TLS (SASL_SSL): a ``.pem`` file (the key in PKCS#8, then the
    #: certificate chain), or a PKCS12 (``.p12``, ``.pfx``) or JKS (``.jks``) keystore, as
    #: keytool makes them. The certificate must name 127.0.0.1, the address the broker
    #: advertises. Empty: no TLS (decision 035).
    kafka_tls_keystore: str = ""
    #: OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE: a file whose first line is the password of
    #: that keystore (PKCS12, JKS) or of its PEM key, if the key is encrypted.
    kafka_tls_keystore_password_file: str = ""
    #: OPLEDGER_KAFKA_PRINCIPAL: the SCRAM user this process authenticates as. Empty: the role
    #: of the command that runs (``projector``, ``recovery``, ``delivery``, ``consumer``,
    #: ``operator`` for policy changes, ``sdk`` for everything else; ``ledger.kafka_access``).
    kafka_principal: str = ""
    #: OPLEDGER_KAFKA_PASSWORD_FILE: the file holding that user's password (its first line).
    #: Empty: ``kafka-<principal>.password`` in OPLEDGER_KAFKA_PASSWORD_DIR.
    kafka_password_file: str = ""
    #: OPLEDGER_KAFKA_PASSWORD_DIR: where each principal's ``kafka-<principal>.password`` is,
    #: which `opledger stack up` creates for the local stack. Empty: ``<home>/keys``.
    kafka_password_dir: str = ""
    #: OPLEDGER_KAFKA_SASL_MECHANISM: SCRAM-SHA-512 unless a broker asks for another.
    kafka_sasl_mechanism: str = "SCRAM-SHA-512"
    #: OPLEDGER_KAFKA_CA_FILE: PEM of the CA that signed the brokers' certificates
    #: (``sasl_ssl`` only); empty: the system's trust store.
    kafka_ca_file: str = ""
    #: OPLEDGER_KAFKA_VERSION: the Apache Kafka release the local stack runs (Maven version).
    kafka_version: str = "4.4.0"
    #: OPLEDGER_TOPIC_PREFIX: prefix of every topic name; tests use their own to stay isolated.
    topic_prefix: str = "opledger"
    #: OPLEDGER_PARTITIONS: partitions of the execution, delivery and dead-letter topics.
    partitions: int = 6
    #: OPLEDGER_REPLICATION_FACTOR: replicas of every topic opledger creates: 1 for the local
    #: single broker, 3 on a real cluster. A record is acknowledged once a majority of them
    #: hold it (the topics' min.insync.replicas), so losing a minority of brokers loses nothing
    #: acknowledged and writes go on.
    replication_factor: int = 1
    #: OPLEDGER_PG_PORT: the local PostgreSQL server's port on 127.0.0.1.
    pg_port: int = 15432
    #: OPLEDGER_PG_DSN: connection string of the projection database; defaults to the local one.
    pg_dsn: str = ""
    #: OPLEDGER_PG_DATABASE: the database on the local server (when OPLEDGER_PG_DSN is empty).
    pg_database: str = "opledger"
    #: OPLEDGER_PG_ROLE: the database role every process of this environment signs in as on the
    #: local server (``sdk``, ``projector``, ``recovery``, ``delivery``, ``owner``); empty, each
    #: component takes its own (decision 034) and admin commands the owner.
    pg_role: str = ""
    #: OPLEDGER_PG_PASSWORD_DIR: where the local server's roles' libpq password files are
    #: (``<home>/keys`` when empty).
    pg_password_dir: str = ""
    #: OPLEDGER_PROJECTOR_GROUP: consumer group the projector commits (informational) offsets under.
    projector_group: str = "opledger-projector"
    #: OPLEDGER_PROJECTOR_BATCH: most records the projector folds in one PostgreSQL transaction.
    projector_batch: int = 5000
    #: OPLEDGER_PROJECTOR_WEB_PORT: port of the projector's faust web server (/metrics).
    projector_web_port: int = 16066
    #: OPLEDGER_PROJECTOR_WEB_BIND: address the projector's web server binds; loopback unless a
    #: container must expose /metrics to its network.
    projector_web_bind: str = "127.0.0.1"
    #: OPLEDGER_RECOVERY_GROUP: consumer group of the recovery workers; its partition
    #: assignment decides which operations each worker looks after.
    recovery_group: str = "opledger-recovery"
    #: OPLEDGER_RECOVERY_WEB_PORT: port of the recovery worker's /metrics and /healthz.
    recovery_web_port: int = 16067
    #: OPLEDGER_RECOVERY_INTERVAL_MS: how often the recovery worker looks for work.
    recovery_interval_ms: int = 500
    #: OPLEDGER_RECOVERY_UNLEASED_GRACE_S: how long an intent whose lease (and stored request)
    #: is not in the database yet is left to its writer: a service whose lease commit met a
    #: database restart is still retrying it (for up to 10 s), and taken over before it has
    #: stored the request the intent could only be parked.
    recovery_unleased_grace_s: int = 30
    #: OPLEDGER_PROVIDERS: "module:function" returning the tool providers a worker may call
    #: (called with the settings); empty: none (the worker then only reports what it finds).
    providers: str = ""
    #: OPLEDGER_FAKE_PROVIDER_URL: where the demo's fake tool provider listens.
    fake_provider_url: str = "http://127.0.0.1:16077"
    #: OPLEDGER_FAKE_PROVIDER_CONTROL_TOKEN_FILE: the token the fake provider's ``/_control/``
    #: routes require. Empty: ``<home>/keys/fake-provider-control.token``.
    fake_provider_control_token_file: str = ""
    #: OPLEDGER_DELIVERY_GROUP: consumer group of the delivery workers (on the execution topic:
    #: the outbox reads it, and its partitions say which operations' deliveries are whose).
    delivery_group: str = "opledger-delivery"
    #: OPLEDGER_DELIVERY_WEB_PORT: port of the delivery worker's /metrics and /healthz.
    delivery_web_port: int = 16069
    #: OPLEDGER_DELIVERY_INTERVAL_MS: how often the delivery worker looks for due deliveries.
    delivery_interval_ms: int = 200
    #: OPLEDGER_DELIVERY_SCHEDULE: waits before the 2nd, 3rd, ... send of a delivery (units ms,
    #: s, m, h, d); past its end the last wait repeats. Standard Webhooks' example schedule.
    delivery_schedule: str = "5s,5m,30m,2h,5h,10h,10h"
    #: OPLEDGER_DELIVERY_MAX_ATTEMPTS: sends per round (the first included) before the delivery
    #: is dead-lettered; a redrive starts a new round.
    delivery_max_attempts: int = 8
    #: OPLEDGER_DELIVERY_HORIZON_S: no send is scheduled later than this after a round began.
    delivery_horizon_s: int = 3 * 24 * 3600
    #: OPLEDGER_DELIVERY_CONCURRENCY: the webhook sender's connections: requests in flight at
    #: once per worker. A pass records SENT for no more webhook sends than this; the other due
    #: ones wait for the next pass, no attempt spent (decision 026).
    delivery_concurrency: int = 256
    #: OPLEDGER_DELIVERY_INLINE_MAX_BYTES: a webhook delivery carries its result in its body
    #: up to this size; a larger one carries ``result_url`` instead, which the destination
    #: fetches from the delivery worker with a signed GET (decision 015).
    delivery_inline_max_bytes: int = 512 * 1024
    #: OPLEDGER_DELIVERY_RESULTS_URL: the base URL destinations reach the delivery workers'
    #: ``GET /results/...`` at (a load balancer in front of them); empty: this host's
    #: ``http://127.0.0.1:<delivery web port>``.
    delivery_results_url: str = ""
    #: OPLEDGER_DELIVERY_ALLOW_NETWORKS: comma-separated CIDRs (IPv4 or IPv6) a webhook may be
    #: sent to although they are refused by default (loopback, private, link-local, shared,
    #: unspecified, multicast, reserved, and their IPv6 forms; decision 019). Empty: every
    #: such address is refused, at registration for a literal IP and at every new connection.
    delivery_allow_networks: str = ""
    #: OPLEDGER_POLICY_MAX_STALENESS_MS: the longest the SDK and the workers act on the
    #: projected policy after they last saw it hold every change on the policy topic; past it
    #: a revocation may wait unfolded, so dispatches are refused and reconciliations and
    #: deliveries held until it is current again (decision 022).
    policy_max_staleness_ms: int = 5000
    #: OPLEDGER_POLICY_FRESHNESS_REFRESH_MS: how often each of them looks again (one watermark
    #: request and one indexed SELECT; calls in between read a clock).
    policy_freshness_refresh_ms: int = 500
    #: OPLEDGER_POLICY_SIGNING_KEY_FILE: the operator's private key policy changes are signed
    #: with (decision 032); only `opledger policy` and the demo's setup read it. Empty:
    #: ``<home>/keys/policy-operator.key``, which `opledger stack up` creates.
    policy_signing_key_file: str = ""
    #: OPLEDGER_POLICY_TRUSTED_KEYS_FILE: the public keys a policy change must be signed by to
    #: count, one ``ed25519:<base64>`` per line. Empty: ``<home>/keys/policy-trusted.pub``.
    #: No file: no change counts (every grant refused).
    policy_trusted_keys_file: str = ""
    #: OPLEDGER_SECRETS_KEY_FILE: the AES-256 keys destinations' signing secrets are sealed
    #: with at rest, one ``aes256gcm:<base64>`` per line, the first sealing (decision 033).
    #: Empty: ``<home>/keys/secrets.key``.
    secrets_key_file: str = ""
    #: OPLEDGER_PG_LOCK_TIMEOUT_MS: the longest a statement of the SDK, the workers or the
    #: projector waits for a lock another session holds (an analyst's LOCK TABLE, a
    #: transaction left open) before it fails and is retried or reported, rather than waiting
    #: silently for ever (decision 025).
    pg_lock_timeout_ms: int = 30_000
    #: OPLEDGER_WORKER_STUCK_AFTER_S: a worker whose loop has not turned for this long (blocked
    #: in a call whose own timeout failed) logs where it is and answers 503 "stuck" on /healthz.
    worker_stuck_after_s: int = 120
    #: OPLEDGER_WORKER_STUCK_EXIT_S: past this, the worker exits for its supervisor to start a
    #: fresh process (0: never; else at least OPLEDGER_WORKER_STUCK_AFTER_S).
    worker_stuck_exit_s: int = 600
    #: OPLEDGER_CONSUMER_NAME: the consumer's name in its inbox and in the key store (letters,
    #: digits, '.', '_', '-'); replicas of one consumer share it, different consumers must not.
    consumer_name: str = "reference"
    #: OPLEDGER_CONSUMER_WEB_PORT: port of the reference receiver (POST /events, /metrics,
    #: /healthz).
    consumer_web_port: int = 16068
    #: OPLEDGER_CONSUMER_PG_DSN: the consumer's own database (its inbox and its change); defaults
    #: to database ``opledger_consumer`` on the local server, which whoever runs the consumer
    #: creates (the consumer creates its tables, not its database).
    consumer_pg_dsn: str = ""
    #: OPLEDGER_CONSUMER_SECRETS: the ``whsec_...`` secret(s) webhook signatures are checked
    #: against, separated by spaces (two while a secret is rotated). Never logged nor shown in
    #: repr; a real deployment reads it from its secret store and passes it in, the environment
    #: is for the local stack and tests.
    consumer_secrets: str = field(default="", repr=False)
    #: OPLEDGER_CONSUMER_TIMESTAMP_TOLERANCE_S: how far a webhook-timestamp may be from now
    #: before the request is refused as stale, in seconds (1-300).
    consumer_timestamp_tolerance_s: int = MAX_TIMESTAMP_TOLERANCE_S
    #: OPLEDGER_CONSUMER_KEEPALIVE_TIMEOUT_S: the receiver closes a connection with no request
    #: being read and no answer owed after this many seconds (aiohttp's default, 75).
    consumer_keepalive_timeout_s: int = 75
    #: OPLEDGER_CONSUMER_REQUEST_TIMEOUT_S: a request whose head and body have not all arrived
    #: this many seconds after its first byte is answered 408 and its connection closed (the
    #: time the receiver takes to answer does not count).
    consumer_request_timeout_s: int = 30
    #: OPLEDGER_CONSUMER_MAX_CONNECTIONS: connections the receiver holds open at once; one more
    #: is answered 503 (Retry-After: 1) and closed before its request is read.
    consumer_max_connections: int = 512
    #: OPLEDGER_CONSUMER_MAX_CONNECTIONS_PER_CLIENT: of those, the most one client address may
    #: hold; one more from it is answered 429 (Retry-After: 1) and closed. The default is what one
    #: delivery worker opens to one destination; behind a proxy that connects from one address,
    #: or for several delivery workers on one host, raise it.
    consumer_max_connections_per_client: int = 256
    #: OPLEDGER_CONSUMER_HOLD_LIMIT_S: how long a queue consumer holds back a partition whose
    #: record names a result it cannot fetch, before it dead-letters that record and goes on
    #: (decision 017). Counted from the first failed fetch by any replica of the consumer (the
    #: clock is kept in its database, across restarts and rebalances).
    consumer_hold_limit_s: int = 3600
    #: OPLEDGER_FAULT_POINTS: comma-separated named fault points to arm (tests only), e.g.
    #: ``projector.after_commit:kill@3`` kills the process the third time that point is reached.
    fault_points: str = ""
    #: OPLEDGER_LOG_LEVEL: python logging level name for opledger processes.
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """Build settings from ``env`` (the process environment when omitted)."""
        env = os.environ if env is None else env
        settings = cls(
            home=_default_home(env),
            kafka_port=_int(env, "OPLEDGER_KAFKA_PORT", 19092),
            kafka_controller_port=_int(env, "OPLEDGER_KAFKA_CONTROLLER_PORT", 19093),
            kafka_bootstrap=env.get("OPLEDGER_KAFKA_BOOTSTRAP", ""),
            kafka_version=env.get("OPLEDGER_KAFKA_VERSION", "4.4.0"),
            kafka_security=env.get("OPLEDGER_KAFKA_SECURITY", ""),
            kafka_principal=env.get("OPLEDGER_KAFKA_PRINCIPAL", ""),
            kafka_password_file=env.get("OPLEDGER_KAFKA_PASSWORD_FILE", ""),
            kafka_password_dir=env.get("OPLEDGER_KAFKA_PASSWORD_DIR", ""),
            kafka_sasl_mechanism=env.get("OPLEDGER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
            kafka_ca_file=env.get("OPLEDGER_KAFKA_CA_FILE", ""),
            kafka_tls_keystore=env.get("OPLEDGER_KAFKA_TLS_KEYSTORE", ""),
            kafka_tls_keystore_password_file=env.get(
                "OPLEDGER_KAFKA_TLS_KEYSTORE_PASSWORD_FILE", ""
            ),
            topic_prefix=env.get("OPLEDGER_TOPIC_PREFIX", "opledger"),
            partitions=_int(env, "OPLEDGER_PARTITIONS", 6),
            replication_factor=_int(env, "OPLEDGER_REPLICATION_FACTOR", 1),
            pg_port=_int(env, "OPLEDGER_PG_PORT", 15432),
            pg_dsn=env.get("OPLEDGER_PG_DSN", ""),
            pg_database=env.get("OPLEDGER_PG_DATABASE", "opledger"),
            pg_role=env.get("OPLEDGER_PG_ROLE", ""),
            pg_password_dir=env.get("OPLEDGER_PG_PASSWORD_DIR", ""),
            projector_group=env.get("OPLEDGER_PROJECTOR_GROUP", "opledger-projector"),
            projector_batch=_int(env, "OPLEDGER_PROJECTOR_BATCH", 5000),
            projector_web_port=_int(env, "OPLEDGER_PROJECTOR_WEB_PORT", 16066),
            projector_web_bind=env.get("OPLEDGER_PROJECTOR_WEB_BIND", "127.0.0.1"),
            recovery_group=env.get("OPLEDGER_RECOVERY_GROUP", "opledger-recovery"),
            recovery_web_port=_int(env, "OPLEDGER_RECOVERY_WEB_PORT", 16067),
            recovery_interval_ms=_int(env, "OPLEDGER_RECOVERY_INTERVAL_MS", 500),
            recovery_unleased_grace_s=_int(env, "OPLEDGER_RECOVERY_UNLEASED_GRACE_S", 30),
            providers=env.get("OPLEDGER_PROVIDERS", ""),
            fake_provider_url=env.get("OPLEDGER_FAKE_PROVIDER_URL", "http://127.0.0.1:16077"),
            fake_provider_control_token_file=env.get(
                "OPLEDGER_FAKE_PROVIDER_CONTROL_TOKEN_FILE", ""
            ),
            delivery_group=env.get("OPLEDGER_DELIVERY_GROUP", "opledger-delivery"),
            delivery_web_port=_int(env, "OPLEDGER_DELIVERY_WEB_PORT", 16069),
            delivery_interval_ms=_int(env, "OPLEDGER_DELIVERY_INTERVAL_MS", 200),
            delivery_schedule=env.get("OPLEDGER_DELIVERY_SCHEDULE", "5s,5m,30m,2h,5h,10h,10h"),
            delivery_max_attempts=_int(env, "OPLEDGER_DELIVERY_MAX_ATTEMPTS", 8),
            delivery_horizon_s=_int(env, "OPLEDGER_DELIVERY_HORIZON_S", 3 * 24 * 3600),
            delivery_concurrency=_int(env, "OPLEDGER_DELIVERY_CONCURRENCY", 256),
            delivery_inline_max_bytes=_int(env, "OPLEDGER_DELIVERY_INLINE_MAX_BYTES", 512 * 1024),
            delivery_results_url=env.get("OPLEDGER_DELIVERY_RESULTS_URL", ""),
            delivery_allow_networks=env.get("OPLEDGER_DELIVERY_ALLOW_NETWORKS", ""),
            policy_max_staleness_ms=_int(env, "OPLEDGER_POLICY_MAX_STALENESS_MS", 5000),
            policy_freshness_refresh_ms=_int(env, "OPLEDGER_POLICY_FRESHNESS_REFRESH_MS", 500),
            policy_signing_key_file=env.get("OPLEDGER_POLICY_SIGNING_KEY_FILE", ""),
            policy_trusted_keys_file=env.get("OPLEDGER_POLICY_TRUSTED_KEYS_FILE", ""),
            secrets_key_file=env.get("OPLEDGER_SECRETS_KEY_FILE", ""),
            pg_lock_timeout_ms=_int(env, "OPLEDGER_PG_LOCK_TIMEOUT_MS", 30_000),
            worker_stuck_after_s=_int(env, "OPLEDGER_WORKER_STUCK_AFTER_S", 120),
            worker_stuck_exit_s=_int(env, "OPLEDGER_WORKER_STUCK_EXIT_S", 600),
            consumer_name=env.get("OPLEDGER_CONSUMER_NAME", "reference"),
            consumer_web_port=_int(env, "OPLEDGER_CONSUMER_WEB_PORT", 16068),
            consumer_pg_dsn=env.get("OPLEDGER_CONSUMER_PG_DSN", ""),
            consumer_secrets=env.get("OPLEDGER_CONSUMER_SECRETS", ""),
            consumer_timestamp_tolerance_s=_int(
                env, "OPLEDGER_CONSUMER_TIMESTAMP_TOLERANCE_S", MAX_TIMESTAMP_TOLERANCE_S
            ),
            consumer_keepalive_timeout_s=_int(env, "OPLEDGER_CONSUMER_KEEPALIVE_TIMEOUT_S", 75),
            consumer_request_timeout_s=_int(env, "OPLEDGER_CONSUMER_REQUEST_TIMEOUT_S", 30),
            consumer_max_connections=_int(env, "OPLEDGER_CONSUMER_MAX_CONNECTIONS", 512),
            consumer_max_connections_per_client=_int(
                env, "OPLEDGER_CONSUMER_MAX_CONNECTIONS_PER_CLIENT", 256
            ),
            consumer_hold_limit_s=_int(env, "OPLEDGER_CONSUMER_HOLD_LIMIT_S", 3600),
            fault_points=env.get("OPLEDGER_FAULT_POINTS", ""),
            log_level=env.get("OPLEDGER_LOG_LEVEL", "INFO"),
        )
        return settings.validated()

    def validated(self) -> Self:
        """Check ranges; errors name the ``OPLEDGER_*`` variable to fix."""
        for name in (
            "kafka_port",
            "kafka_controller_port",
            "pg_port",
            "projector_web_port",
            "recovery_web_port",
            "delivery_web_port",
            "consumer_web_port",
        ):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise SettingsError(f"{_var(name)} must be a TCP port (1-65535), got {port}")
        if self.partitions < 1:
            raise SettingsError(f"{_var('partitions')} must be at least 1, got {self.partitions}")
        if self.projector_batch < 1:
            raise SettingsError(
                f"{_var('projector_batch')} must be at least 1, got {self.projector_batch}"
            )
        if self.recovery_interval_ms < 10:
            raise SettingsError(
                f"{_var('recovery_interval_ms')} must be at least 10, "
                f"got {self.recovery_interval_ms}"
            )
        for name, least in (
            ("recovery_unleased_grace_s", 0),
            ("replication_factor", 1),
            ("delivery_interval_ms", 10),
            ("delivery_max_attempts", 1),
            ("delivery_horizon_s", 1),
            ("delivery_concurrency", 1),
            ("delivery_inline_max_bytes", 0),
            ("consumer_keepalive_timeout_s", 1),
            ("consumer_request_timeout_s", 1),
            ("consumer_max_connections", 1),
            ("consumer_max_connections_per_client", 1),
            ("consumer_hold_limit_s", 1),
            ("policy_max_staleness_ms", 10),
            ("policy_freshness_refresh_ms", 10),
            ("pg_lock_timeout_ms", 1),
            ("worker_stuck_after_s", 1),
            ("worker_stuck_exit_s", 0),
        ):
            if getattr(self, name) < least:
                raise SettingsError(
                    f"{_var(name)} must be at least {least}, got {getattr(self, name)}"
                )
        if self.policy_freshness_refresh_ms > self.policy_max_staleness_ms:
            raise SettingsError(
                f"{_var('policy_freshness_refresh_ms')} ({self.policy_freshness_refresh_ms}) must "
                f"not exceed {_var('policy_max_staleness_ms')} ({self.policy_max_staleness_ms}): "
                "the view would go stale between two looks"
            )
        if 0 < self.worker_stuck_exit_s < self.worker_stuck_after_s:
            raise SettingsError(
                f"{_var('worker_stuck_exit_s')} ({self.worker_stuck_exit_s}) must be 0 (never) or "
                f"at least {_var('worker_stuck_after_s')} ({self.worker_stuck_after_s})"
            )
        if self.delivery_results_url and not re.fullmatch(
            r"https?://[^\s/?#]+(/[^\s?#]*)?", self.delivery_results_url
        ):
            raise SettingsError(
                f"{_var('delivery_results_url')} must be an http(s) URL without query or "
                f"fragment, got {self.delivery_results_url!r}"
            )
        try:
            parse_networks(self.delivery_allow_networks)
        except ValueError as exc:
            raise SettingsError(f"{_var('delivery_allow_networks')}: {exc}") from None
        try:
            parse_schedule(self.delivery_schedule)
        except ValueError as exc:
            raise SettingsError(f"{_var('delivery_schedule')}: {exc}") from None
        if self.providers and not re.fullmatch(r"[\w.]+:\w+", self.providers):
            raise SettingsError(
                f"{_var('providers')} must be 'package.module:function', got {self.providers!r}"
            )
        if not _CONSUMER_NAME.fullmatch(self.consumer_name):
            raise SettingsError(
                f"{_var('consumer_name')} may hold letters, digits, '.', '_' and '-' only "
                f"(1-64 characters), got {self.consumer_name!r}"
            )
        if not 1 <= self.consumer_timestamp_tolerance_s <= MAX_TIMESTAMP_TOLERANCE_S:
            raise SettingsError(
                f"{_var('consumer_timestamp_tolerance_s')} must be 1-{MAX_TIMESTAMP_TOLERANCE_S} "
                f"seconds, got {self.consumer_timestamp_tolerance_s}"
            )
        for number, secret in enumerate(self.consumer_secret_list, start=1):
            # The message names the secret by position only: it must never show its value.
            if not _webhook_secret_ok(secret):
                raise SettingsError(
                    f"{_var('consumer_secrets')}: secret {number} is not 'whsec_' followed by "
                    "base64 of 24 to 64 bytes"
                )
        if self.kafka_security not in ("", *KAFKA_SECURITY_PROTOCOLS):
            raise SettingsError(
                f"{_var('kafka_security')} must be one of {', '.join(KAFKA_SECURITY_PROTOCOLS)}, "
                f"got {self.kafka_security!r}"
            )
        if (
            self.kafka_tls_keystore
            and not self.kafka_bootstrap
            and self.kafka_security not in ("", "sasl_ssl")
        ):
            raise SettingsError(
                f"{_var('kafka_tls_keystore')} puts the local broker on TLS, which "
                f"{_var('kafka_security')}={self.kafka_security} cannot reach: set it to "
                "sasl_ssl or leave it empty"
            )
        if self.kafka_principal and not _PRINCIPAL.fullmatch(self.kafka_principal):
            raise SettingsError(
                f"{_var('kafka_principal')} may hold letters, digits, '.', '_' and '-' only "
                f"(1-64 characters), got {self.kafka_principal!r}"
            )
        if self.pg_role not in ("", *PG_ROLES):
            raise SettingsError(
                f"{_var('pg_role')} must be one of {', '.join(PG_ROLES)}, got {self.pg_role!r}"
            )
        if not _PG_DATABASE.fullmatch(self.pg_database):
            raise SettingsError(
                f"{_var('pg_database')} may hold lowercase letters, digits and '_' only "
                f"(1-63 characters, a letter first), got {self.pg_database!r}"
            )
        if self.kafka_sasl_mechanism not in KAFKA_SASL_MECHANISMS:
            raise SettingsError(
                f"{_var('kafka_sasl_mechanism')} must be one of {', '.join(KAFKA_SASL_MECHANISMS)}"
                f", got {self.kafka_sasl_mechanism!r}"
            )
        if not _TOPIC_PREFIX.match(self.topic_prefix):
            raise SettingsError(
                f"{_var('topic_prefix')} may hold letters, digits, '.', '_' and '-' only "
                f"(1-100 characters), got {self.topic_prefix!r}"
            )
        return self

    def with_(self, **changes: object) -> Self:
        """A copy with some fields changed (tests use it for isolated topics and databases)."""
        return replace(self, **changes).validated()  # type: ignore[arg-type]  # dataclasses.replace is untyped on **kwargs

    @property
    def results_base_url(self) -> str:
        """Where destinations fetch results delivered by reference (no trailing slash)."""
        base = self.delivery_results_url or f"http://127.0.0.1:{self.delivery_web_port}"
        return base.rstrip("/")

    @property
    def delivery_allowed_networks(self) -> tuple[Network, ...]:
        """``delivery_allow_networks`` parsed (validated when the settings were built)."""
        return parse_networks(self.delivery_allow_networks)

    @property
    def delivery_retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            schedule=parse_schedule(self.delivery_schedule),
            max_attempts=self.delivery_max_attempts,
            horizon=timedelta(seconds=self.delivery_horizon_s),
        )

    @property
    def policy_signing_key_path(self) -> Path:
        return Path(self.policy_signing_key_file or self.home / "keys" / "policy-operator.key")

    @property
    def policy_trusted_keys_path(self) -> Path:
        return Path(self.policy_trusted_keys_file or self.home / "keys" / "policy-trusted.pub")

    @property
    def secrets_key_path(self) -> Path:
        return Path(self.secrets_key_file or self.home / "keys" / "secrets.key")

    @property
    def kafka_security_protocol(self) -> str:
        """``plaintext``, ``sasl_plaintext`` or ``sasl_ssl``: OPLEDGER_KAFKA_SECURITY, else
        SASL for the local broker (which asks for it; over TLS when it has a certificate) and
        plaintext for one named elsewhere."""
        if self.kafka_security:
            return self.kafka_security
        if self.kafka_bootstrap:
            return "plaintext"
        return "sasl_ssl" if self.kafka_tls_keystore else "sasl_plaintext"

    @property
    def kafka_user(self) -> str:
        """The principal this process's Kafka clients authenticate as (``sdk`` unless the
        command or OPLEDGER_KAFKA_PRINCIPAL names another)."""
        return self.kafka_principal or "sdk"

    @property
    def kafka_password_path(self) -> Path:
        if self.kafka_password_file:
            return Path(self.kafka_password_file)
        return self.kafka_password_path_of(self.kafka_user)

    @property
    def kafka_password_directory(self) -> Path:
        return Path(self.kafka_password_dir) if self.kafka_password_dir else self.home / "keys"

    def kafka_password_path_of(self, principal: str) -> Path:
        """Where ``principal``'s password is kept (``opledger stack up`` writes them there)."""
        return self.kafka_password_directory / f"kafka-{principal}.password"

    def as_kafka_role(self, role: str) -> Self:
        """These settings for a process of ``role`` (``projector``, ``operator``, ...): its
        Kafka principal, unless OPLEDGER_KAFKA_PRINCIPAL chose one for every process."""
        return self if self.kafka_principal else replace(self, kafka_principal=role)

    def readers_group(self, reader: str) -> str:
        """The consumer group of a reader that never joins it nor commits (it only assigns, or
        asks for watermarks): one shared prefix every Kafka role may use (``ledger.kafka_access``),
        holding no offsets of anyone's."""
        return f"{self.topic_prefix}-readers.{reader}"

    @property
    def bootstrap_servers(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    def as_pg_role(self, role: str) -> Self:
        """These settings for a process of ``role`` on the local server (decision 034): its
        database role, unless OPLEDGER_PG_ROLE chose one for every process. A DSN given in
        OPLEDGER_PG_DSN names its own user and is used as it is."""
        return self if self.pg_role else replace(self, pg_role=role)

    @property
    def pg_user(self) -> str:
        """The local server's role these settings sign in as: the owner unless a component
        named its own."""
        return pg_role_name(self.pg_role or "owner")

    @property
    def dsn(self) -> str:
        return self.pg_dsn or self._local_dsn(self.pg_database, self.pg_user)

    @property
    def consumer_dsn(self) -> str:
        # The reference consumer's database is its own application's: it owns it.
        return self.consumer_pg_dsn or self._local_dsn("opledger_consumer", PG_OWNER)

    @property
    def pg_passfile_path(self) -> Path:
        """The local stack's owner's libpq password file (``opledger stack up`` makes it,
        0600): its server asks every connection for a password (SCRAM), and the DSN names this
        file rather than holding the password, so no DSN printed or logged carries it."""
        return self.pg_passfile_path_of(PG_OWNER)

    def pg_passfile_path_of(self, user: str) -> Path:
        """Where the local server's role ``user`` keeps its password: one file per role, so a
        deployment can give each process its own file and no other (``opledger stack up``
        writes them; on the local stack one user of the machine holds them all)."""
        directory = Path(self.pg_password_dir) if self.pg_password_dir else self.home / "keys"
        return directory / ("pgpass" if user == PG_OWNER else f"pgpass-{user}")

    def _local_dsn(self, database: str, user: str) -> str:
        passfile = quote(str(self.pg_passfile_path_of(user)), safe="/")
        return f"postgresql://{user}@127.0.0.1:{self.pg_port}/{database}?passfile={passfile}"

    @property
    def consumer_secret_list(self) -> tuple[str, ...]:
        return tuple(self.consumer_secrets.split())

    @property
    def consumer_keys_topic(self) -> str:
        """The compacted key store of the consumers' accepted operation ids."""
        return f"{self.topic_prefix}.consumer-keys.v1"

    @property
    def consumer_dead_letter_topic(self) -> str:
        """Where the queue consumers put the records they cannot take, with the reason."""
        return f"{self.topic_prefix}.consumer-deadletter.v1"

    @property
    def execution_topic(self) -> str:
        return f"{self.topic_prefix}.execution.v1"

    @property
    def delivery_topic(self) -> str:
        return f"{self.topic_prefix}.delivery.v1"

    @property
    def dead_letter_topic(self) -> str:
        return f"{self.topic_prefix}.deadletter.v1"

    @property
    def policy_topic(self) -> str:
        """The compacted topic of policy changes (grants, revocations), keyed by subject."""
        return f"{self.topic_prefix}.policy.v1"
