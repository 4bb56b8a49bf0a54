"""``opledger analysts add|list|remove``: database roles for analysts, each bound to tenants.

A role made here reads the projections (and the documented views of schema ``analyst``) of its
tenants only, whatever SQL it writes: row-level security holds it (decision 030).
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import sys
from typing import Any

from ledger.settings import Settings
from opledger import arguments

EXIT_OK = 0
EXIT_USAGE = 2


def _role(raw: str) -> str:
    from projections.analysts import AnalystError, check_role  # noqa: PLC0415

    try:
        return check_role(raw)
    except AnalystError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _by(args: argparse.Namespace) -> str:
    return args.by or f"cli:{getpass.getuser()}"


def add_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger analysts add``."""
    from ledger import pg  # noqa: PLC0415
    from opledger import db  # noqa: PLC0415
    from projections.analysts import AnalystError, add_analyst  # noqa: PLC0415

    password = None
    if args.password_env:
        password = os.environ.get(args.password_env)
        if not password:
            print(f"--password-env: ${args.password_env} is not set", file=sys.stderr)
            return EXIT_USAGE
    made = password is None
    if made:
        password = secrets.token_urlsafe(24)
    db.migrate(settings.dsn)
    with pg.connect(settings.dsn, name="opledger-analysts") as conn:
        try:
            created = add_analyst(
                conn, role=args.role, tenants=args.tenant, password=password, bound_by=_by(args)
            )
        except AnalystError as exc:
            print(f"not added: {exc}", file=sys.stderr)
            return EXIT_USAGE
    print(
        f"{args.role}: reads tenant{'s' if len(args.tenant) > 1 else ''} {', '.join(args.tenant)}"
    )
    # Shown once, to whoever hands it to the analyst; never logged, never stored but hashed.
    if created and made:
        print(f"password (give it to the analyst; it is not shown again): {password}")
    elif not created:
        print("the role existed: its password is unchanged")
    return EXIT_OK


def list_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger analysts list``."""
    from ledger import pg  # noqa: PLC0415
    from projections.analysts import bindings  # noqa: PLC0415

    with pg.connect(settings.dsn, name="opledger-analysts", read_only=True) as conn:
        found = bindings(conn)
    if not found:
        print("no analyst is bound to a tenant in this database")
    for b in found:
        print(f"{b.role}\t{b.tenant_id}\tbound by {b.bound_by} at {b.bound_at.isoformat()}")
    return EXIT_OK


def remove_command(args: argparse.Namespace, settings: Settings) -> int:
    """``opledger analysts remove``."""
    from ledger import pg  # noqa: PLC0415
    from projections.analysts import unbind_analyst  # noqa: PLC0415

    with pg.connect(settings.dsn, name="opledger-analysts") as conn:
        gone = unbind_analyst(conn, role=args.role, tenants=args.tenant)
    print(f"{args.role}: {gone} binding{'' if gone == 1 else 's'} removed")
    return EXIT_OK


def register(commands: Any) -> None:
    """``opledger analysts``."""
    parser = commands.add_parser(
        "analysts",
        help="database roles for analysts, each reading only the tenants it is bound to",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser(
        "add", help="bind a role to tenants (made, with a password, if it does not exist)"
    )
    add.add_argument("--role", required=True, type=_role, help="the PostgreSQL role")
    add.add_argument(
        "--tenant",
        required=True,
        action="append",
        type=arguments.tenant,
        help="a tenant it may read (repeat for several)",
    )
    add.add_argument(
        "--password-env",
        metavar="VAR",
        help="a new role's password from this environment variable (default: one is made "
        "and printed once)",
    )
    add.add_argument(
        "--by", metavar="NAME", type=arguments.actor, help="who binds (default: cli:<login>)"
    )
    add.set_defaults(handler="opledger.analysts:add_command")
    listing = actions.add_parser("list", help="every role's tenants in this database")
    listing.set_defaults(handler="opledger.analysts:list_command")
    remove = actions.add_parser("remove", help="unbind a role from tenants (all by default)")
    remove.add_argument("--role", required=True, type=_role, help="the PostgreSQL role")
    remove.add_argument(
        "--tenant",
        action="append",
        type=arguments.tenant,
        help="only this tenant (repeat for several)",
    )
    remove.set_defaults(handler="opledger.analysts:remove_command")
