"""Every PostgreSQL session opledger opens comes from ``ledger/pg.py``.

The factory gives each session the same options (UTC, a bound on lock waits, a name in
``pg_stat_activity``). A session opened beside it loses them silently: ``opledger ops``,
``policy show`` and the demo's report once ran in the server's time zone. Checked over the
source with ``ast`` (nothing is imported): outside the factory, no module of the shipped packages
calls ``psycopg.connect`` (or ``Connection.connect``) or builds a psycopg_pool pool, under any
alias. The tests and benchmarks read the database as an analyst would and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ledger.pg import session_options

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ledger", "producers", "processors", "projections", "consumers", "opledger")
FACTORY = ROOT / "ledger" / "pg.py"

#: What opens a session or a pool of them, by its full dotted name.
OPENERS = frozenset(
    {
        "psycopg.connect",
        "psycopg.Connection.connect",
        "psycopg.AsyncConnection.connect",
        "psycopg.connection.Connection.connect",
        "psycopg.connection_async.AsyncConnection.connect",
        "psycopg_pool.ConnectionPool",
        "psycopg_pool.AsyncConnectionPool",
        "psycopg_pool.NullConnectionPool",
        "psycopg_pool.AsyncNullConnectionPool",
    }
)


def _bound_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in ``tree``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".", 1)[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def sessions_opened(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every call in ``path`` that opens a session or builds a pool."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = _bound_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = _dotted(node.func)
        if parts is None or parts[0] not in names:
            continue
        full = ".".join([names[parts[0]], *parts[1:]])
        if full in OPENERS:
            found.append((node.lineno, full))
    return found


def test_no_session_is_opened_beside_the_factory() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != FACTORY
        for line, what in sessions_opened(path)
    ]
    assert not found, (
        "sessions opened outside ledger/pg.py (use ledger.pg.connect, open_pool or "
        f"open_async_pool, which give every session the same options): {found}"
    )


def test_the_check_reads_the_factory_itself() -> None:
    # Guard against a check that passes because it recognises nothing.
    assert {what for _line, what in sessions_opened(FACTORY)} == {
        "psycopg.connect",
        "psycopg_pool.ConnectionPool",
        "psycopg_pool.AsyncConnectionPool",
    }


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("import psycopg\npsycopg.connect('x')\n", "psycopg.connect"),
        ("import psycopg as pg\npg.connect('x')\n", "psycopg.connect"),
        ("from psycopg import connect\nconnect('x')\n", "psycopg.connect"),
        ("from psycopg import connect as c\nc('x')\n", "psycopg.connect"),
        ("import psycopg\npsycopg.Connection.connect('x')\n", "psycopg.Connection.connect"),
        ("from psycopg import AsyncConnection as A\nA.connect('x')\n", "psycopg.AsyncConnection.connect"),  # noqa: E501  (one case per line reads best)
        ("from psycopg_pool import ConnectionPool\nConnectionPool('x')\n", "psycopg_pool.ConnectionPool"),  # noqa: E501
        ("import psycopg_pool\npsycopg_pool.AsyncConnectionPool('x')\n", "psycopg_pool.AsyncConnectionPool"),  # noqa: E501
        ("def f():\n    from psycopg_pool import NullConnectionPool as P\n    return P('x')\n", "psycopg_pool.NullConnectionPool"),  # noqa: E501
    ],
)  # fmt: skip
def test_the_check_sees_a_session_opened(tmp_path: Path, source: str, what: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(source, encoding="utf-8")
    assert [w for _line, w in sessions_opened(path)] == [what]


@pytest.mark.parametrize(
    "source",
    [
        "from ledger import pg\npg.connect('x', name='n')\n",
        "from ledger.pg import open_pool\nopen_pool('x', name='n')\n",
        "from producers import TransitionRecorder\nTransitionRecorder.connect(s)\n",
        "import socket\nsocket.socket().connect(('h', 1))\n",
        "from psycopg_pool import ConnectionPool\nx: ConnectionPool[int] | None = None\n",
    ],
)
def test_the_check_leaves_other_calls_alone(tmp_path: Path, source: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(source, encoding="utf-8")
    assert sessions_opened(path) == []


def test_session_options_keep_the_dsns_own_and_add_ours_after_them() -> None:
    options = session_options(dsn_options="-c search_path=x -c TimeZone=Asia/Tokyo")
    # libpq applies -c options in order: ours, last, win over the same name in the DSN.
    assert options.index("search_path=x") < options.index("TimeZone=Asia/Tokyo")
    assert options.endswith("-c TimeZone=UTC -c lock_timeout=30000")


def test_session_options_bound_what_the_caller_asks_for() -> None:
    assert session_options(lock_timeout_ms=None) == "-c TimeZone=UTC"
    assert session_options(lock_timeout_ms=500, statement_timeout_ms=2000, read_only=True) == (
        "-c TimeZone=UTC -c lock_timeout=500 -c statement_timeout=2000 "
        "-c default_transaction_read_only=on"
    )
