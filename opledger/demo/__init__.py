"""``opledger demo``: the system doing its real work on the local stack, in a minute or two.

Service processes run a few hundred tool calls for three tenants through the SDK against the
fake provider; each service is SIGKILLed once at a real boundary, a grant is revoked while one
of those calls is in doubt, and the delivery worker is SIGKILLed once. The supervised workers
(projector, recovery, delivery, fake provider, reference consumer) do the rest. The demo waits
until everything is final, then prints what the projections say next to what the outside world
counted: the fake provider's own side effects per operation and the consumers' applied changes.

Registration only imports argparse; the handlers live in :mod:`opledger.demo.main` and
:mod:`opledger.demo.service`.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Exit codes: 1 when the run finished but an invariant failed (or it did not finish: an
#: operation lost or stuck); 2 when it could not run (stack, workers), with what to do.
EXIT_INVARIANT = 1
EXIT_USAGE = 2


class DemoError(RuntimeError):
    """The demo cannot run; the message says why and what to do."""


def _bounded(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def register(commands: Any) -> None:
    """``opledger demo [--operations N] [--seed S] [--timeout T]`` and ``opledger demo service``."""
    parser = commands.add_parser(
        "demo",
        help="run services, crashes and the workers on the local stack, then check the "
        "outside world's counts (the main job)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="exit codes: 0 every invariant held · 1 an invariant failed or the run did not "
        "finish · 2 the demo could not run",
    )
    parser.add_argument(
        "--operations",
        type=_bounded(30, 20_000),
        default=300,
        help="tool calls to run (default 300)",
    )
    parser.add_argument(
        "--seed", type=int, default=7, help="seed of the calls and the provider's draws"
    )
    parser.add_argument(
        "--timeout",
        type=_bounded(30, 3600),
        default=300,
        help="seconds the run and the wait for everything to be final may take (default 300)",
    )
    parser.set_defaults(handler="opledger.demo.main:run")
    modes = parser.add_subparsers(dest="mode", metavar="MODE")
    service = modes.add_parser(
        "service", help="one of the demo's services (the demo starts them; not for direct use)"
    )
    service.add_argument("--plan", required=True, help="its calls, JSON lines")
    service.add_argument("--start", type=int, default=0, help="first call to make (0-based)")
    service.add_argument("--name", default="demo-service", help="its name as a lease owner")
    service.add_argument(
        "--fault",
        default="",
        help="a fault point to arm, e.g. execute.after_dispatch_before_call:kill@5",
    )
    service.set_defaults(handler="opledger.demo.service:run")
