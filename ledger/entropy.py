"""Random bytes for ids (ULIDs' 80 random bits), drawn from the operating system a block at a time.

``os.urandom`` lets go of the GIL around its system call, so every id a busy process made waited
to take the GIL back from whichever thread ran meanwhile: with one other thread busy, a call
took about a hundred times longer than one from a block (``bench/bench_entropy.py``; figures
in ``bench/README.md``). The bytes are the same kind (the kernel's CSPRNG), only fetched 4 KiB at a
time. A forked child starts from a fresh block, so a
parent and its child never hand out the same bytes.
"""

from __future__ import annotations

import os
import threading
import weakref

BLOCK = 4096

_pools: weakref.WeakSet[EntropyPool] = weakref.WeakSet()


class EntropyPool:
    """``pool(n)``: ``n`` bytes from ``os.urandom``, each byte handed out once; thread-safe."""

    __slots__ = ("__weakref__", "_block", "_buffer", "_lock", "_position")

    def __init__(self, block: int = BLOCK) -> None:
        if block < 1:
            raise ValueError("the block must hold at least one byte")
        self._block = block
        self._lock = threading.Lock()
        self._buffer = b""
        self._position = 0
        _pools.add(self)

    def __call__(self, n: int) -> bytes:
        if n > self._block:
            return os.urandom(n)
        with self._lock:
            position = self._position
            if position + n > len(self._buffer):
                self._buffer, position = os.urandom(self._block), 0
            self._position = position + n
            return self._buffer[position : position + n]

    def _forget(self) -> None:
        # In a forked child: the lock may have been held by a thread that does not exist here.
        self._lock = threading.Lock()
        self._buffer, self._position = b"", 0


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)

#: The process's pool: what the SDK and the workers draw their ids' randomness from.
entropy = EntropyPool()
