"""Files only their owner may read (keys, tokens, passwords), written one way: mode 0600 from
the first byte, never seen half-written, and, for a file made once, made by one process of
several racing to make it. Also what reads such a file again when it changes."""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (written aside, synced, renamed), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def create_private_once(path: Path, make: Callable[[], str]) -> None:
    """``path`` with ``make()``'s text unless it exists: written aside and linked into place,
    so a reader never sees half of it and, of processes making it at once, one wins."""
    if path.exists():
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.new")
    write_private(temporary, make())
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def reread_on_change(load: Callable[[Path], T]) -> Callable[[Path], T]:
    """``load(path)``, cached until the file's modification time changes (a rotation counts
    from the next read, without a restart). A failed load is not cached."""

    @functools.lru_cache(maxsize=8)
    def cached(path: Path, _mtime_ns: int) -> T:
        return load(path)

    def read(path: Path) -> T:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        return cached(path, mtime)

    return read


def key_file_lines(path: Path, text: str, prefix: str) -> list[bytes]:
    """The 32-byte keys of a key file's ``text``: one ``<prefix><base64>`` per line, ``#``
    comments and blank lines allowed. Raises ValueError naming the first line that is not."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        raw = entry.removeprefix(prefix)
        try:
            key = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            key = b""
        if raw == entry or len(key) != 32:
            raise ValueError(f"{path} line {number} is not '{prefix}<base64>'")
        keys.append(key)
    return keys
