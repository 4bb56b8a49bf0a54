"""Who reads the process environment, checked over the source with ``ast``.

``ledger/settings.py`` builds the one settings object from ``OPLEDGER_*`` variables and says no
other module reads a setting from the environment. Any other read must be named here, with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ledger", "producers", "processors", "projections", "consumers", "opledger")
SETTINGS = Path("ledger/settings.py")

#: (file, what it reads) -> why it may.
ALLOWED = {
    # `destinations add --secret-env VAR`: a secret comes from a variable the operator names,
    # so it is not typed on a command line (and kept in shell history).
    ("opledger/deliver.py", "os.environ"): "--secret-env names the variable",
    # The audit actor of a CLI change is the operator's login name (LOGNAME, USER, ...).
    ("opledger/deliver.py", "getpass.getuser"): "the audit actor",
    ("opledger/policy.py", "getpass.getuser"): "the audit actor",
    # `analysts add --password-env VAR`: a new role's password, as --secret-env.
    ("opledger/analysts.py", "os.environ"): "--password-env names the variable",
    ("opledger/analysts.py", "getpass.getuser"): "the audit actor",
    # pg_dump and pg_restore run with the command's own environment, the DSN's password
    # added to it: a password on their command line is in every process listing.
    ("opledger/backup.py", "os.environ"): "passed on to pg_dump with the password added",
}

_READS = {("os", "environ"), ("os", "getenv"), ("os", "environb"), ("getpass", "getuser")}


def _reads(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) in _READS
        ):
            found.add(f"{node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "getpass"):
            for alias in node.names:
                if (node.module, alias.name) in _READS:
                    found.add(f"{node.module}.{alias.name}")
    return found


def test_only_the_settings_and_the_named_exceptions_read_the_environment() -> None:
    found = {
        (str(path.relative_to(ROOT)), read)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT) != SETTINGS
        for read in _reads(path)
    }
    assert found == set(ALLOWED), (
        f"unnamed reads: {sorted(found - set(ALLOWED))}; gone: {sorted(set(ALLOWED) - found)}"
    )


def test_the_check_sees_each_form_of_read(tmp_path: Path) -> None:
    source = tmp_path / "reads.py"
    source.write_text(
        "import os, getpass\nfrom os import getenv\n"
        "a = os.environ['X']\nb = os.getenv('Y')\nc = getpass.getuser()\n"
    )
    assert _reads(source) == {"os.environ", "os.getenv", "getpass.getuser"}
    assert "os.environ" in _reads(ROOT / SETTINGS), "the settings module itself is seen"
