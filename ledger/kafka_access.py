"""Who may do what on the broker: opledger's Kafka principals, the ACLs each gets, and the
SCRAM users behind them (decision 029).

Every process authenticates as the principal of its role (``Settings.as_kafka_role``). The
broker denies whatever no ACL allows (``allow.everyone.if.no.acl.found=false``), so the
bindings below are the whole of what a service may do:

- every service role reads, writes and describes the topics under ``<prefix>.`` (the
  execution, delivery and dead-letter logs, the consumers' key store, queue destinations under
  the prefix) but is *denied* writing the policy topic: a DENY beats any ALLOW, so no later
  grant on the prefix can give it back by accident;
- only ``operator`` may write the policy topic (and nothing else);
- each worker role joins only its own consumer groups; the readers that never join a group
  (watermark probes, the history reader) share ``<prefix>-readers``, which holds no offsets;
- no role may delete records or topics, alter configurations or create ACLs: those belong to
  ``admin``, the broker's super user, which only ``opledger stack up`` and tests use.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException

# confluent_kafka.admin re-exports these implicitly, which mypy strict rejects.
from confluent_kafka.admin._acl import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
)
from confluent_kafka.admin._resource import ResourcePatternType, ResourceType
from confluent_kafka.admin._scram import (
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from ledger.log.clients import new_admin
from ledger.private_files import create_private_once
from ledger.settings import Settings

_log = logging.getLogger("opledger.kafka.access")

#: The broker's super user (``super.users``): creates topics, users and ACLs; never a service.
ADMIN = "admin"
#: The only principal whose writes to the policy topic the broker accepts.
OPERATOR = "operator"
#: The roles services run as, each with its own consumer groups.
SERVICE_ROLES = ("sdk", "projector", "recovery", "delivery", "consumer")
#: Every SCRAM user the local stack creates.
PRINCIPALS = (ADMIN, OPERATOR, *SERVICE_ROLES)

#: SCRAM iterations: Kafka's minimum is 4096; 8192 as its documentation's examples.
SCRAM_ITERATIONS = 8192

_TOPIC_USE = (
    AclOperation.READ,
    AclOperation.WRITE,
    AclOperation.DESCRIBE,
    AclOperation.DESCRIBE_CONFIGS,
)
_GROUP_USE = (AclOperation.READ, AclOperation.DESCRIBE)


def role_groups(settings: Settings, role: str) -> tuple[str, ...]:
    """The consumer-group prefixes ``role`` may join (besides the shared readers' one): its
    configured group, and ``<prefix>-<role>`` (where workers on a topic prefix of their own,
    a test's or a tenant's deployment, put theirs)."""
    prefix = settings.topic_prefix
    configured = {
        "projector": (settings.projector_group,),
        "recovery": (settings.recovery_group,),
        "delivery": (settings.delivery_group,),
        "consumer": (f"{prefix}-keystore",),
    }.get(role, ())
    return tuple(dict.fromkeys((*configured, f"{prefix}-{role}")))


@dataclass(frozen=True, slots=True)
class Rule:
    """One ACL binding, as data (tests and ``opledger stack`` print them)."""

    principal: str
    permission: str  # "ALLOW" | "DENY"
    operation: str  # an AclOperation name
    resource: str  # "TOPIC" | "GROUP"
    pattern: str  # "LITERAL" | "PREFIXED"
    name: str

    def binding(self) -> AclBinding:
        return AclBinding(
            ResourceType[self.resource],
            self.name,
            ResourcePatternType[self.pattern],
            f"User:{self.principal}",
            "*",
            AclOperation[self.operation],
            AclPermissionType[self.permission],
        )


def access_rules(settings: Settings) -> list[Rule]:
    """Every ACL binding the topics of ``settings`` need (see the module docstring)."""
    topics = f"{settings.topic_prefix}."
    readers = settings.readers_group("")
    rules: list[Rule] = []
    for role in SERVICE_ROLES:
        rules += [Rule(role, "ALLOW", op.name, "TOPIC", "PREFIXED", topics) for op in _TOPIC_USE]
        rules.append(Rule(role, "DENY", "WRITE", "TOPIC", "LITERAL", settings.policy_topic))
        for group in (*role_groups(settings, role), readers):
            rules += [Rule(role, "ALLOW", op.name, "GROUP", "PREFIXED", group) for op in _GROUP_USE]
    # The operator writes the policy topic and may look at (not write) the rest, which
    # `opledger policy` checks exists before it signs a change.
    rules += [
        Rule(OPERATOR, "ALLOW", op.name, "TOPIC", "LITERAL", settings.policy_topic)
        for op in _TOPIC_USE
    ]
    rules += [
        Rule(OPERATOR, "ALLOW", op, "TOPIC", "PREFIXED", topics)
        for op in ("DESCRIBE", "DESCRIBE_CONFIGS")
    ]
    rules += [Rule(OPERATOR, "ALLOW", op.name, "GROUP", "PREFIXED", readers) for op in _GROUP_USE]
    return rules


def _ignorable(exc: KafkaException) -> bool:
    # A broker without an authorizer (a plaintext cluster) has no ACLs to make; a principal
    # that is not the admin cannot make them, and whoever provisions the cluster does.
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and error.code() in (
        KafkaError.SECURITY_DISABLED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    )


def ensure_access(settings: Settings, timeout: float = 30.0) -> bool:
    """Create :func:`access_rules` (creating an existing binding is a no-op). False when this
    broker has no authorizer or this principal may not create ACLs; other errors raise."""
    if settings.kafka_security_protocol == "plaintext":
        return False
    if settings.kafka_user in (OPERATOR, *SERVICE_ROLES):
        # Their rules give them no ALTER on the cluster: asking would only be refused, and
        # every refusal is a stack trace in the broker's log.
        return False
    admin = new_admin(settings, client_id="opledger-access")
    bindings = [rule.binding() for rule in access_rules(settings)]
    try:
        for future in admin.create_acls(bindings, request_timeout=timeout).values():
            future.result()
    except KafkaException as exc:
        if _ignorable(exc):
            _log.debug("ACLs not created as %s: %s", settings.kafka_user, exc)
            return False
        raise
    return True


def drop_access(settings: Settings, names_starting: str, timeout: float = 30.0) -> int:
    """Delete the bindings of :func:`access_rules` whose resource name starts with
    ``names_starting`` (a test's own prefix: the stack's shared group names stay); how many."""
    if settings.kafka_security_protocol == "plaintext":
        return 0
    filters = [
        AclBindingFilter(
            ResourceType[rule.resource],
            rule.name,
            ResourcePatternType[rule.pattern],
            f"User:{rule.principal}",
            "*",
            AclOperation[rule.operation],
            AclPermissionType[rule.permission],
        )
        for rule in access_rules(settings)
        if rule.name.startswith(names_starting)
    ]
    if not filters:
        return 0
    admin = new_admin(settings, client_id="opledger-access")
    deleted = 0
    for future in admin.delete_acls(filters, request_timeout=timeout).values():
        deleted += len(future.result())
    return deleted


def password_file(settings: Settings, principal: str) -> Path:
    """Where the local stack keeps ``principal``'s password."""
    return settings.kafka_password_path_of(principal)


def make_passwords(settings: Settings, principals: Iterable[str] = PRINCIPALS) -> None:
    """A password file per principal under ``<home>/keys`` (0600), made once."""
    for principal in principals:
        create_private_once(
            password_file(settings, principal), lambda: secrets.token_urlsafe(32) + "\n"
        )


def ensure_users(
    admin_settings: Settings, principals: Sequence[str] = PRINCIPALS, timeout: float = 30.0
) -> list[str]:
    """Create (or set again) the SCRAM-SHA-512 credential of each principal from its password
    file, as the admin; the principals it wrote."""
    upserts: list[UserScramCredentialAlteration] = []
    for principal in principals:
        password = (
            password_file(admin_settings, principal).read_text().splitlines()[0].strip().encode()
        )
        upserts.append(
            UserScramCredentialUpsertion(
                principal,
                ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS),
                password,
            )
        )
    admin = new_admin(admin_settings, client_id="opledger-access")
    futures = admin.alter_user_scram_credentials(upserts, request_timeout=timeout)
    for future in futures.values():
        future.result()
    return list(principals)
