"""Argument types the CLI's subcommands share: each turns a bad value into argparse's usage
error (exit 2, the value named) before any command runs."""

from __future__ import annotations

import argparse


def tcp_port(raw: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a TCP port: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {raw}")
    return port
