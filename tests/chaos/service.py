"""A service that runs tool calls through the SDK, as the chaos tests' victim: they start it as a
real process (its settings, fault points and providers from the environment) and SIGKILL it.

    python tests/chaos/service.py execute --count N [--tool send_email] [--tenant acme]
    python tests/chaos/service.py resume OP_ID... [--tenant acme]

Each operation id is printed (and flushed) before its call, so the test knows which operations
were in flight when the process died.
"""

from __future__ import annotations

import argparse
import sys
import time

from ledger import faults
from ledger.errors import LeaseLostError
from ledger.settings import Settings
from opledger.fakes.providers import from_settings
from producers import TransitionRecorder


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    execute = sub.add_parser("execute")
    execute.add_argument("--count", type=int, default=1)
    execute.add_argument("--tool", default="send_email")
    execute.add_argument("--tenant", default="acme")
    execute.add_argument("--actor", default="agent-7")
    resume = sub.add_parser("resume")
    resume.add_argument("operations", nargs="+")
    resume.add_argument("--tenant", default="acme")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    faults.arm(settings.fault_points)
    with TransitionRecorder.connect(
        settings, providers=from_settings(settings), owner=f"service-{args.mode}"
    ) as recorder:
        if args.mode == "execute":
            for n in range(args.count):
                op_id = recorder.new_operation_id()
                print(f"op {op_id}", flush=True)
                done = recorder.execute(
                    args.tenant,
                    args.actor,
                    args.tool,
                    {"n": n, "at": time.time_ns()},
                    operation_id=op_id,
                )
                print(f"done {op_id} {done.state} {done.attempt}", flush=True)
        else:
            for op_id in args.operations:
                try:
                    handle = recorder.take_over(op_id, args.tenant, reason="resume after a crash")
                except LeaseLostError:
                    print(f"lost {op_id}", flush=True)
                    continue
                done = recorder.resume(handle)
                print(f"resumed {op_id} {done.state}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
