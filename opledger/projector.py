"""Wiring of the projector: settings -> PostgreSQL sink + batch reader -> the workers' host."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from ledger import faults
from ledger.settings import Settings

if TYPE_CHECKING:
    from processors.batch_reader import BatchProjector
    from processors.host import Hosted
    from projections.writer import PostgresProjection


def build(settings: Settings) -> tuple[Hosted, BatchProjector, PostgresProjection]:
    """The hosted projector, the projector and its sink, wired but not started."""
    # Imported here, not at the top: `opledger stack up` must not pay for the workers' imports.
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from ledger.codec import default_codec  # noqa: PLC0415
    from ledger.metrics import Metrics  # noqa: PLC0415
    from processors.batch_reader import BatchProjector  # noqa: PLC0415
    from processors.host import Hosted  # noqa: PLC0415
    from projections.writer import PostgresProjection  # noqa: PLC0415

    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    sink = PostgresProjection.connect(settings.dsn, lock_timeout_ms=settings.pg_lock_timeout_ms)
    projector = BatchProjector(settings, sink, default_codec(), metrics)
    hosted = Hosted(projector, registry, name="projector", web_port=settings.projector_web_port)
    return hosted, projector, sink


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger projector run``: project until SIGTERM/SIGINT."""
    from ledger.secrets import RedactingFilter  # noqa: PLC0415
    from ledger.topics import ensure_topics  # noqa: PLC0415
    from processors.host import serve  # noqa: PLC0415

    faults.arm(settings.fault_points)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    ensure_topics(settings)
    hosted, _projector, sink = build(settings)
    try:
        return serve(settings, hosted)
    finally:
        sink.close()


def register(commands: Any) -> None:
    """``opledger projector run``."""
    parser = commands.add_parser("projector", help="the projector worker (topics -> PostgreSQL)")
    parser.set_defaults(kafka_role="projector", pg_role="projector")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_parser = actions.add_parser(
        "run", help="fold both topics into the projections until stopped (SIGTERM/SIGINT)"
    )
    run_parser.set_defaults(handler="opledger.projector:run")
