"""``opledger demo service``: one of the demo's services, a real process running tool calls with
``recorder.execute`` against the fake provider, as an application would.

It reads its calls from a plan file (JSON lines) and prints, flushed, ``op INDEX OP_ID`` before
each call and ``done INDEX OP_ID STATE ATTEMPT refused|-`` after it, so whoever started it knows
which operation was in flight if it dies. ``--fault`` arms a named fault point
(``ledger.faults``): the process SIGKILLs itself there, at a real boundary.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ledger.settings import Settings
from opledger.demo.plan import Call

log = logging.getLogger("opledger.demo.service")


def read_plan(path: Path) -> list[Call]:
    return [Call.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


def write_plan(path: Path, calls: list[Call] | tuple[Call, ...]) -> None:
    path.write_text("".join(json.dumps(c.to_json(), sort_keys=True) + "\n" for c in calls))


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger demo service --plan FILE [--start N] [--fault POINT:kill@N] [--name S]``."""
    from ledger import faults  # noqa: PLC0415  # handlers import what they use
    from ledger.errors import RecordError  # noqa: PLC0415
    from ledger.secrets import RedactingFilter  # noqa: PLC0415
    from opledger.fakes.providers import from_settings  # noqa: PLC0415
    from producers import TransitionRecorder  # noqa: PLC0415

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    calls = read_plan(Path(args.plan))
    faults.arm(args.fault or settings.fault_points)
    with TransitionRecorder.connect(
        settings, providers=from_settings(settings), owner=args.name
    ) as recorder:
        for index in range(args.start, len(calls)):
            call = calls[index]
            op_id = recorder.new_operation_id()
            print(f"op {index} {op_id}", flush=True)
            try:
                done = recorder.execute(
                    call.tenant_id,
                    call.actor_id,
                    call.tool_name,
                    dict(call.arguments),
                    operation_id=op_id,
                )
            except RecordError as exc:
                # Recorded as far as it got; the recovery worker carries it on. The service
                # goes on with its next call, as a real one would.
                log.warning("%s (call %d): %s", op_id, index, exc)
                print(f"error {index} {op_id} {type(exc).__name__}", flush=True)
                continue
            refused = "refused" if done.refused else "-"
            print(f"done {index} {op_id} {done.state} {done.attempt} {refused}", flush=True)
    return 0
