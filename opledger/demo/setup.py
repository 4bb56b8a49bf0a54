"""The demo's setup on a running stack; every step sets a state, so running it twice is safe:
the fake provider's behaviour per tool, the queue destination's topic, each tenant's
destinations, and the grants, written to the policy topic as ``opledger policy grant`` writes
them and waited for until the projector has folded them (only then do the workers see them)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ledger.settings import Settings
from opledger.demo.plan import (
    DESTINATION_TIMEOUT_MS,
    PROVIDER_MIX,
    QUEUE,
    REVOKED,
    ROUTES,
    TENANTS,
    TOOLS,
    WEBHOOK,
    granted_destinations,
    queue_topic,
)

if TYPE_CHECKING:
    from ledger.domain.events import PolicyChanged
    from opledger.fakes.http_provider import FakeProviderControl

#: Who the demo's policy changes and destinations are recorded as changed by.
CHANGED_BY = "opledger-demo"
POLICY_WAIT_S = 30.0


class SetupError(RuntimeError):
    """The stack did not take the demo's setup; the message says what to look at."""


def configure_provider(control: FakeProviderControl, seed: int) -> None:
    """Every setting of every demo tool, so nothing a previous run changed lingers."""
    for number, (tool, mix) in enumerate(sorted(PROVIDER_MIX.items())):
        control.configure(
            tool,
            mode=mix.mode,
            fail_rate=mix.fail_rate,
            lose_response_rate=mix.lose_response_rate,
            lookup_unavailable_rate=mix.lookup_unavailable_rate,
            latency_ms=mix.latency_ms,
            seed=seed * 100 + number,
            attachment_rate=mix.attachment_rate,
        )


def ensure_queue_topic(settings: Settings) -> str:
    """The queue destination's topic (auto-creation is off on our brokers)."""
    from confluent_kafka import KafkaError, KafkaException  # noqa: PLC0415
    from confluent_kafka.cimpl import NewTopic  # noqa: PLC0415

    from ledger.log import new_admin  # noqa: PLC0415
    from opledger.stack import stack_admin  # noqa: PLC0415

    topic = queue_topic(settings.topic_prefix)
    # Topics are the broker admin's to create; the demo runs the local stack, so it may.
    admin = new_admin(stack_admin(settings), client_id="opledger-demo")
    futures = admin.create_topics([NewTopic(topic, num_partitions=settings.partitions)])
    for future in futures.values():
        try:
            future.result(timeout=30)
        except KafkaException as exc:
            error = exc.args[0]
            if not (
                isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
            ):
                raise SetupError(f"could not create the queue topic {topic}: {error}") from None
    return topic


def add_destinations(settings: Settings, *, consumer_url: str, secret: str, topic: str) -> None:
    """Each tenant's destinations (replacing the demo's own, leaving any other alone)."""
    from ledger.destinations import DestinationStore, Kind  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415
    from ledger.secret_box import ensure_local_secret_key  # noqa: PLC0415

    # As `stack up` makes it: a demo home whose workers were started without `up` has none.
    ensure_local_secret_key(settings)
    with open_pool(settings.dsn, name="opledger-demo", max_size=1) as pool:
        store = DestinationStore(pool, settings)
        for route in ROUTES:
            queue = route.name == QUEUE
            store.add(
                tenant_id=route.tenant_id,
                name=route.name,
                kind=Kind.QUEUE if queue else Kind.WEBHOOK,
                target=topic if queue else _webhook_url(route.name, consumer_url),
                tools=route.tools,
                changed_by=CHANGED_BY,
                # The queue's fetch secret (decision 016) is the local consumer's secret too:
                # one file for both of the demo's consumers to read.
                secret=secret,
                timeout_ms=DESTINATION_TIMEOUT_MS,
            )


def _webhook_url(name: str, consumer_url: str) -> str:
    if name == WEBHOOK:
        return consumer_url
    # UNPERMITTED: no grant lists it, so every delivery to it is refused before a send. The
    # discard port stands for "an archive nobody set up"; a send there would only fail.
    return "http://127.0.0.1:9/archive"


def _namespace(**fields: object) -> argparse.Namespace:
    # The options `opledger policy grant|revoke` would have parsed, so the change is built and
    # validated by the very code the CLI uses.
    defaults: dict[str, object] = {
        "actor": None,
        "tool": None,
        "destination": [],
        "repeat_safe": False,
        "expires": None,
        "credential": None,
        "scope": [],
        "credential_expires": None,
        "reason": None,
        "by": CHANGED_BY,
    }
    return argparse.Namespace(**(defaults | fields))


def grants(now: datetime) -> list[PolicyChanged]:
    """Per tenant and tool: every actor, the tool's destinations, repeat-safe as the tool is.

    The revoked subject gets a grant of its own: a previous run revoked it, and a revoked
    specific grant would otherwise keep refusing (no broader grant overrides it).
    """
    from opledger.policy import grant_change  # noqa: PLC0415

    subjects = [(tenant, "*", tool) for tenant in TENANTS for tool in TOOLS] + [REVOKED]
    return [
        grant_change(
            _namespace(
                tenant=tenant,
                actor=actor,
                tool=tool,
                destination=list(granted_destinations(tool)),
                repeat_safe=TOOLS[tool],
                reason="opledger demo: the tool and where its results may go",
            ),
            now,
            os.urandom(10),
        )
        for tenant, actor, tool in subjects
    ]


def revocation(subject: tuple[str, str, str], now: datetime) -> PolicyChanged:
    from opledger.policy import revoke_change  # noqa: PLC0415

    tenant, actor, tool = subject
    return revoke_change(
        _namespace(
            tenant=tenant,
            actor=actor,
            tool=tool,
            reason="opledger demo: revoked while one of its calls is in doubt (seed row 6)",
        ),
        now,
        os.urandom(10),
    )


def write_policy(settings: Settings, changes: Sequence[PolicyChanged]) -> float:
    """Append ``changes`` (acks=all) and wait until the projector has folded every one;
    returns the seconds waited."""
    from ledger import pg  # noqa: PLC0415
    from ledger.errors import RecordError  # noqa: PLC0415
    from ledger.log import LogWriter  # noqa: PLC0415
    from ledger.policy_keys import ensure_local_keys  # noqa: PLC0415
    from ledger.policy_store import read_fold_state  # noqa: PLC0415

    # The local stack's operator key (its workers trust it): the demo is that stack's operator.
    key = ensure_local_keys(settings)
    changes = [key.sign(change) for change in changes]
    # ... and writes as its principal, the only one the broker lets write the policy topic.
    writer = LogWriter.connect(settings.as_kafka_role("operator"), "demo")
    try:
        writer.append(list(changes))
    except RecordError as exc:
        raise SetupError(f"the policy changes were not written: {exc}") from None
    finally:
        writer.close()
    started = time.monotonic()
    waiting = list(changes)
    with pg.connect(settings.dsn, name="opledger-demo", read_only=True) as conn:
        while waiting:
            waiting = [c for c in waiting if not read_fold_state(conn, c).folded]
            if not waiting:
                break
            if time.monotonic() - started > POLICY_WAIT_S:
                raise SetupError(
                    f"{len(waiting)} policy changes not folded after {POLICY_WAIT_S:.0f}s: is "
                    f"the projector serving port {settings.projector_web_port} the one reading "
                    f"{settings.policy_topic} into this database? "
                    "(`opledger stack status`, logs/projector.log)"
                )
            time.sleep(0.1)
    return time.monotonic() - started


def now() -> datetime:
    return datetime.now(UTC)
