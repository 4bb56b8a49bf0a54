"""Wiring of the projector: settings -> PostgreSQL sink + batch reader -> faust worker."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from ledger import faults
from ledger.settings import Settings

if TYPE_CHECKING:
    from processors.batch_reader import BatchProjector
    from projections.writer import PostgresProjection


def build(settings: Settings) -> tuple[Any, BatchProjector, PostgresProjection]:
    """The faust app, its projector and its sink, wired but not started."""
    # Imported here, not at the top: `opledger stack up` must not pay for importing faust.
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from ledger.codec import default_codec  # noqa: PLC0415
    from ledger.metrics import Metrics  # noqa: PLC0415
    from processors.app import create_app  # noqa: PLC0415
    from processors.batch_reader import BatchProjector  # noqa: PLC0415
    from projections.writer import PostgresProjection  # noqa: PLC0415

    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    sink = PostgresProjection.connect(settings.dsn, lock_timeout_ms=settings.pg_lock_timeout_ms)
    projector = BatchProjector(settings, sink, default_codec(), metrics)
    return create_app(settings, projector, registry), projector, sink


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger projector run``: project until SIGTERM/SIGINT."""
    import faust  # noqa: PLC0415  # imported here so other subcommands start fast

    from ledger.topics import ensure_topics  # noqa: PLC0415

    faults.arm(settings.fault_points)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    ensure_topics(settings)
    app, _projector, sink = build(settings)
    try:
        worker = faust.Worker(app, loglevel=settings.log_level.lower(), quiet=True)
        worker.execute_from_commandline()
    finally:
        sink.close()
    return 0


def register(commands: Any) -> None:
    """``opledger projector run``."""
    parser = commands.add_parser("projector", help="the projector worker (topics -> PostgreSQL)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_parser = actions.add_parser(
        "run", help="fold both topics into the projections until stopped (SIGTERM/SIGINT)"
    )
    run_parser.set_defaults(handler="opledger.projector:run")
