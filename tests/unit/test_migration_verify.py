"""``ledger.migrate.verify``: what the database was migrated with against the files."""

from __future__ import annotations

import pytest

from ledger.migrate import Applied, Migration, MigrationError, verify

FILES = {
    1: Migration(1, "results", "CREATE TABLE results (ref TEXT);\n"),
    2: Migration(2, "leases", "CREATE TABLE leases (op TEXT);\n"),
}
AT = "2026-12-01 10:00:00+00"


def _applied(version: int, checksum: str | None = "", name: str | None = None) -> Applied:
    migration = FILES[version] if version in FILES else Migration(version, "later", "")
    recorded = migration.checksum if checksum == "" else checksum
    return Applied(version, name or migration.name, recorded, AT)


def test_files_equal_to_what_was_applied_pass() -> None:
    assert verify("results", [_applied(1), _applied(2)], FILES) == []


def test_versions_applied_before_checksums_adopt_the_files() -> None:
    assert verify("results", [_applied(1, None), _applied(2)], FILES) == [FILES[1]]


def test_an_edited_applied_migration_refuses_the_start() -> None:
    with pytest.raises(MigrationError) as refused:
        verify("results", [_applied(1), _applied(2, "0" * 64)], FILES)
    message = str(refused.value)
    assert "002_leases.sql is not what this database was migrated with" in message
    assert "000000000000" in message and FILES[2].checksum[:12] in message
    assert "refusing to start" in message


def test_a_renamed_applied_migration_refuses_the_start() -> None:
    with pytest.raises(MigrationError, match=r"002_secret_rotation.sql applied"):
        verify("results", [_applied(1), _applied(2, None, name="secret_rotation")], FILES)


def test_a_version_only_a_newer_opledger_has_refuses_the_start() -> None:
    with pytest.raises(MigrationError, match=r"003_later .* a newer version migrated it"):
        verify("results", [_applied(1), _applied(2), _applied(3)], FILES)


def test_crlf_line_endings_are_the_same_migration() -> None:
    crlf = Migration(1, "results", FILES[1].sql.replace("\n", "\r\n"))
    assert crlf.checksum == FILES[1].checksum
