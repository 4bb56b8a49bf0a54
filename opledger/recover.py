"""Wiring of the recovery worker: ``opledger recover run``.

Any number of these may run: they form one consumer group on the execution topic, and each looks
after the operations of the partitions it was assigned (adding a process adds throughput; killing
one hands its partitions to the others).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from typing import TYPE_CHECKING, Any

from ledger import faults
from ledger.settings import Settings

if TYPE_CHECKING:
    from ledger.tools import Provider
    from processors.host import Hosted
    from processors.recovery.worker import RecoveryWorker


def load_providers(settings: Settings, default: str = "") -> list[Provider]:
    """The providers ``OPLEDGER_PROVIDERS`` (else ``default``) names: "module:function", called
    with the settings."""
    entry = settings.providers or default
    if not entry:
        return []
    module, _, name = entry.partition(":")
    factory = getattr(importlib.import_module(module), name)
    providers: list[Provider] = list(factory(settings))
    return providers


def build(
    settings: Settings, default_providers: str = ""
) -> tuple[Hosted, RecoveryWorker, list[Any]]:
    """The hosted worker, the worker, and what to close afterwards; wired, not started."""
    # Imported here: other subcommands must not pay for psycopg_pool and the rest.
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from ledger.history import HistoryReader  # noqa: PLC0415
    from ledger.leases import LeaseStore, process_identity  # noqa: PLC0415
    from ledger.log import KafkaTransport  # noqa: PLC0415
    from ledger.metrics import Metrics  # noqa: PLC0415
    from ledger.pg import open_pool  # noqa: PLC0415
    from ledger.policy_store import PolicyStore  # noqa: PLC0415
    from ledger.results import ResultStore  # noqa: PLC0415
    from processors.host import Hosted  # noqa: PLC0415
    from processors.recovery.worker import RecoveryWorker  # noqa: PLC0415

    registry = CollectorRegistry()
    pool = open_pool(
        settings.dsn,
        name="opledger-recovery",
        max_size=40,
        lock_timeout_ms=settings.pg_lock_timeout_ms,
    )
    transport = KafkaTransport(settings)
    history = HistoryReader(settings, pool, client_id="opledger-recovery-history")
    worker = RecoveryWorker(
        settings,
        pool=pool,
        transport=transport,
        leases=LeaseStore(pool, process_identity("recover")),
        history=history,
        results=ResultStore(pool),
        # Reconciliation re-checks policy as it is now (seed rule 3): read in each pass, once
        # per subject, right before its decisions; never cached.
        policy=PolicyStore(pool, settings).evaluate_many,
        providers=load_providers(settings, default_providers),
        metrics=Metrics.create(registry),
    )
    hosted = Hosted(worker, registry, name="recovery", web_port=settings.recovery_web_port)
    return hosted, worker, [history, transport, pool]


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger recover run``: recover operations until SIGTERM/SIGINT."""
    from ledger.secrets import RedactingFilter  # noqa: PLC0415
    from ledger.topics import ensure_topics  # noqa: PLC0415
    from opledger import db  # noqa: PLC0415
    from processors.host import serve  # noqa: PLC0415

    faults.arm(settings.fault_points)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    ensure_topics(settings)
    db.migrate(settings.dsn)
    hosted, _worker, owned = build(settings, args.default_providers or "")
    try:
        return serve(settings, hosted)
    finally:
        for item in owned:
            item.close()


def register(commands: Any) -> None:
    """``opledger recover run``."""
    parser = commands.add_parser(
        "recover", help="the recovery worker: resume, detect UNKNOWN, reconcile with policy"
    )
    parser.set_defaults(kafka_role="recovery", pg_role="recovery")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_parser = actions.add_parser(
        "run", help="look after operations whose owner went away, until stopped (SIGTERM/SIGINT)"
    )
    run_parser.add_argument(
        "--default-providers",
        metavar="MODULE:FUNCTION",
        help="providers to use when OPLEDGER_PROVIDERS is not set (the local stack passes the "
        "fake provider's adapters)",
    )
    run_parser.set_defaults(handler="opledger.recover:run")
