"""``opledger fake-provider run``; kept apart from the server so the CLI never imports aiohttp
until this subcommand runs."""

from __future__ import annotations

from typing import Any

from opledger.arguments import tcp_port

#: Next to the projector's 16066; tests pass a free port instead.
DEFAULT_PORT = 16077


def register(commands: Any) -> None:
    """``opledger fake-provider run [--host H] [--port N]``."""
    parser = commands.add_parser(
        "fake-provider", help="the fake tool provider (tests, chaos runs, the demo)"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run",
        help="serve the fake provider's tool and control API until SIGTERM/SIGINT; "
        "state is in memory",
    )
    run.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    run.add_argument(
        "--port",
        type=tcp_port,
        default=None,
        help="port to bind (default: the port of OPLEDGER_FAKE_PROVIDER_URL, "
        f"{DEFAULT_PORT} unless set; 0 picks a free one and prints it)",
    )
    run.set_defaults(handler="opledger.fakes.provider_server:run_command")
