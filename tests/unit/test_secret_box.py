"""Sealing destinations' secrets at rest (decision 033): pure, with real AES-GCM."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ledger.secret_box import (
    SEALED_RE,
    SecretBox,
    SecretKeyError,
    key_lines,
    new_key_line,
    write_key_file,
)

SECRET = "whsec_c2VhbGVkLWJ5LXRoZS1vcGVyYXRvci0wMTIz"


def _box(tmp_path: Path, *lines: str) -> SecretBox:
    path = tmp_path / "secrets.key"
    write_key_file(path, list(lines))
    return SecretBox.load(path)


def test_a_sealed_secret_opens_for_its_destination_only(tmp_path: Path) -> None:
    box = _box(tmp_path, new_key_line())
    sealed = box.seal(SECRET, tenant_id="acme", name="crm")
    assert SEALED_RE.match(sealed) and SECRET not in sealed and "c2VhbGVk" not in sealed
    assert box.open(sealed, tenant_id="acme", name="crm") == SECRET
    assert box.seal(SECRET, tenant_id="acme", name="crm") != sealed  # a fresh nonce each time
    for tenant, name in (("globex", "crm"), ("acme", "crm2"), ("acme\x00crm", "")):
        with pytest.raises(SecretKeyError, match="copied from another destination") as refused:
            box.open(sealed, tenant_id=tenant, name=name)
        assert SECRET not in str(refused.value)


def test_an_altered_sealed_secret_does_not_open(tmp_path: Path) -> None:
    box = _box(tmp_path, new_key_line())
    sealed = box.seal(SECRET, tenant_id="acme", name="crm")
    flipped = sealed[:-5] + ("A" if sealed[-5] != "A" else "B") + sealed[-4:]
    with pytest.raises(SecretKeyError, match="does not open"):
        box.open(flipped, tenant_id="acme", name="crm")
    with pytest.raises(SecretKeyError, match="neither sealed nor"):
        box.open("sealed1:zz", tenant_id="acme", name="crm")


def test_the_first_key_seals_and_every_key_opens(tmp_path: Path) -> None:
    old_line, new_line = new_key_line(), new_key_line()
    old = _box(tmp_path, old_line)
    sealed_old = old.seal(SECRET, tenant_id="acme", name="crm")
    both = _box(tmp_path, new_line, old_line)
    assert both.current_id != old.current_id
    assert both.open(sealed_old, tenant_id="acme", name="crm") == SECRET
    assert not both.is_current(sealed_old)
    sealed_new = both.seal(SECRET, tenant_id="acme", name="crm")
    assert both.is_current(sealed_new)
    only_new = _box(tmp_path, new_line)
    assert only_new.open(sealed_new, tenant_id="acme", name="crm") == SECRET
    with pytest.raises(SecretKeyError, match=f"sealed with key {old.current_id}, not in"):
        only_new.open(sealed_old, tenant_id="acme", name="crm")


def test_a_secret_stored_before_sealing_is_read_until_rekeyed(tmp_path: Path) -> None:
    box = _box(tmp_path, new_key_line())
    assert box.open(SECRET, tenant_id="acme", name="crm") == SECRET
    assert not box.is_current(SECRET)


def test_key_files_are_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "k" / "secrets.key"
    line = new_key_line()
    write_key_file(path, [line])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text(f"# rotated 2026-12-06\n{line}  # current\n")
    assert key_lines(path) == [line]
    with pytest.raises(SecretKeyError, match="no secrets key at"):
        SecretBox.load(tmp_path / "missing.key")
    for bad in ("", "# only a comment\n", "aes256gcm:c2hvcnQ=\n", "hmac:" + line[10:] + "\n"):
        path.write_text(bad)
        with pytest.raises(SecretKeyError):
            SecretBox.load(path)
