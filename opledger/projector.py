"""Wiring of the projector: settings -> PostgreSQL sink + batch reader -> faust worker."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from prometheus_client import CollectorRegistry

from ledger import faults
from ledger.codec import default_codec
from ledger.metrics import Metrics
from ledger.settings import Settings
from ledger.topics import ensure_topics
from processors.app import create_app
from processors.batch_reader import BatchProjector
from projections.writer import PostgresProjection


def build(settings: Settings) -> tuple[Any, BatchProjector, PostgresProjection]:
    """The faust app, its projector and its sink, wired but not started."""
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    sink = PostgresProjection.connect(settings.dsn)
    projector = BatchProjector(settings, sink, default_codec(), metrics)
    return create_app(settings, projector, registry), projector, sink


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger projector run``: project until SIGTERM/SIGINT."""
    import faust  # noqa: PLC0415  # imported here so other subcommands start fast

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
