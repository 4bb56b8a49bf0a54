"""A service that runs tool calls through the SDK, as the chaos tests' victim: they start it as a
real process (its settings, fault points and providers from the environment) and SIGKILL it.

    python tests/chaos/service.py execute --count N [--tool send_email] [--tenant acme] [--asyncio]
    python tests/chaos/service.py resume OP_ID... [--tenant acme]

``--asyncio`` runs the calls as an asyncio service would: ``await recorder.execute`` on an
``AsyncTransitionRecorder`` with the asyncio (aiohttp) adapters of the same tools.

Each operation id is printed (and flushed) before its call, so the test knows which operations
were in flight when the process died.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from ledger import faults
from ledger.errors import LeaseLostError
from ledger.settings import Settings
from opledger.fakes.http_provider import AsyncHttpToolProvider
from opledger.fakes.providers import DEMO_TOOLS, from_settings, terms
from producers import AsyncTransitionRecorder, Execution, TransitionRecorder


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    execute = sub.add_parser("execute")
    execute.add_argument("--count", type=int, default=1)
    execute.add_argument("--tool", default="send_email")
    execute.add_argument("--tenant", default="acme")
    execute.add_argument("--actor", default="agent-7")
    execute.add_argument("--asyncio", action="store_true", help="as an asyncio service")
    resume = sub.add_parser("resume")
    resume.add_argument("operations", nargs="+")
    resume.add_argument("--tenant", default="acme")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    faults.arm(settings.fault_points)
    if args.mode == "execute" and args.asyncio:
        return asyncio.run(execute_asyncio(settings, args))
    with TransitionRecorder.connect(
        settings, providers=from_settings(settings), owner=f"service-{args.mode}"
    ) as recorder:
        if args.mode == "execute":
            for n in range(args.count):
                op_id = announced(recorder.new_operation_id())
                reported(recorder.execute(*nth_call(args, n), operation_id=op_id))
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


async def execute_asyncio(settings: Settings, args: argparse.Namespace) -> int:
    providers = [
        AsyncHttpToolProvider(settings.fake_provider_url, tool, terms(tool)) for tool in DEMO_TOOLS
    ]
    async with AsyncTransitionRecorder.connect(
        settings, providers=providers, owner="service-execute-asyncio"
    ) as recorder:
        for n in range(args.count):
            op_id = announced(recorder.new_operation_id())
            reported(await recorder.execute(*nth_call(args, n), operation_id=op_id))
    for provider in providers:
        await provider.close()
    return 0


def nth_call(args: argparse.Namespace, n: int) -> tuple[str, str, str, dict[str, Any]]:
    """Tenant, actor, tool and arguments of the n-th call (the arguments differ every time)."""
    return args.tenant, args.actor, args.tool, {"n": n, "at": time.time_ns()}


def announced(op_id: str) -> str:
    """Printed before the call, so the test knows which operation was in flight at a kill."""
    print(f"op {op_id}", flush=True)
    return op_id


def reported(done: Execution) -> None:
    print(f"done {done.operation_id} {done.state} {done.attempt}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
