"""One frozen settings object, built once at start-up from ``OPLEDGER_*`` variables.

No other module reads ``os.environ``: components receive a :class:`Settings` explicitly, which
keeps tests free to build as many differently-configured instances as they like.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Self

_TOPIC_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


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
    #: OPLEDGER_KAFKA_VERSION: the Apache Kafka release the local stack runs (Maven version).
    kafka_version: str = "4.4.0"
    #: OPLEDGER_TOPIC_PREFIX: prefix of every topic name; tests use their own to stay isolated.
    topic_prefix: str = "opledger"
    #: OPLEDGER_PARTITIONS: partitions of the execution, delivery and dead-letter topics.
    partitions: int = 6
    #: OPLEDGER_PG_PORT: the local PostgreSQL server's port on 127.0.0.1.
    pg_port: int = 15432
    #: OPLEDGER_PG_DSN: connection string of the projection database; defaults to the local one.
    pg_dsn: str = ""
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
    #: OPLEDGER_PROVIDERS: "module:function" returning the tool providers a worker may call
    #: (called with the settings); empty: none (the worker then only reports what it finds).
    providers: str = ""
    #: OPLEDGER_FAKE_PROVIDER_URL: where the demo's fake tool provider listens.
    fake_provider_url: str = "http://127.0.0.1:16077"
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
            topic_prefix=env.get("OPLEDGER_TOPIC_PREFIX", "opledger"),
            partitions=_int(env, "OPLEDGER_PARTITIONS", 6),
            pg_port=_int(env, "OPLEDGER_PG_PORT", 15432),
            pg_dsn=env.get("OPLEDGER_PG_DSN", ""),
            projector_group=env.get("OPLEDGER_PROJECTOR_GROUP", "opledger-projector"),
            projector_batch=_int(env, "OPLEDGER_PROJECTOR_BATCH", 5000),
            projector_web_port=_int(env, "OPLEDGER_PROJECTOR_WEB_PORT", 16066),
            projector_web_bind=env.get("OPLEDGER_PROJECTOR_WEB_BIND", "127.0.0.1"),
            recovery_group=env.get("OPLEDGER_RECOVERY_GROUP", "opledger-recovery"),
            recovery_web_port=_int(env, "OPLEDGER_RECOVERY_WEB_PORT", 16067),
            recovery_interval_ms=_int(env, "OPLEDGER_RECOVERY_INTERVAL_MS", 500),
            providers=env.get("OPLEDGER_PROVIDERS", ""),
            fake_provider_url=env.get("OPLEDGER_FAKE_PROVIDER_URL", "http://127.0.0.1:16077"),
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
        if self.providers and not re.fullmatch(r"[\w.]+:\w+", self.providers):
            raise SettingsError(
                f"{_var('providers')} must be 'package.module:function', got {self.providers!r}"
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
    def bootstrap_servers(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    @property
    def dsn(self) -> str:
        return self.pg_dsn or f"postgresql://opledger@127.0.0.1:{self.pg_port}/opledger"

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
