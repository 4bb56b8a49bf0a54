"""What ``opledger backup`` and ``restore`` decide without a database: a password never on a
client's command line, and a backup whose files are not the ones it wrote refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from opledger import backup


def test_a_password_goes_to_the_environment_not_the_command_line() -> None:
    dbname, env = backup.client_arguments(
        "host=db.example port=5433 dbname=ledger user=ops password=s3cr3t sslmode=require"
    )
    assert "s3cr3t" not in dbname
    assert env == {"PGPASSWORD": "s3cr3t"}
    assert conninfo_to_dict(dbname) == {
        "host": "db.example",
        "port": "5433",
        "dbname": "ledger",
        "user": "ops",
        "sslmode": "require",
    }
    local, none = backup.client_arguments("postgresql://opledger@127.0.0.1:5432/x?passfile=/k")
    assert none == {} and conninfo_to_dict(local)["passfile"] == "/k"


def _backup(directory: Path, dump: bytes) -> None:
    directory.mkdir()
    (directory / backup.LEDGER_DUMP).write_bytes(dump)
    manifest = {
        "format": backup.FORMAT,
        "files": {backup.LEDGER_DUMP: hashlib.sha256(dump).hexdigest()},
        "tables": {backup.LEDGER_DUMP: {"results": 1}},
    }
    (directory / backup.MANIFEST).write_text(json.dumps(manifest))


def test_a_backup_is_read_only_when_every_file_is_the_one_it_wrote(tmp_path: Path) -> None:
    _backup(tmp_path / "good", b"PGDMP the dump")
    assert backup.read_backup(tmp_path / "good")["tables"] == {"ledger.dump": {"results": 1}}

    _backup(tmp_path / "altered", b"PGDMP the dump")
    (tmp_path / "altered" / backup.LEDGER_DUMP).write_bytes(b"PGDMP another dump")
    with pytest.raises(backup.BackupError, match="not the file the backup wrote"):
        backup.read_backup(tmp_path / "altered")

    _backup(tmp_path / "missing", b"PGDMP the dump")
    (tmp_path / "missing" / backup.LEDGER_DUMP).unlink()
    with pytest.raises(backup.BackupError, match="missing"):
        backup.read_backup(tmp_path / "missing")

    (tmp_path / "none").mkdir()
    with pytest.raises(backup.BackupError, match="holds no backup manifest"):
        backup.read_backup(tmp_path / "none")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / backup.MANIFEST).write_text('{"format": "something else"}')
    with pytest.raises(backup.BackupError, match="is not an opledger-backup/1 manifest"):
        backup.read_backup(tmp_path / "other")
