"""The entropy pool: every byte handed out once, across threads and across a fork."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ledger.entropy import EntropyPool


def test_draws_are_consecutive_slices_of_the_kernels_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks: list[bytes] = []

    def urandom(n: int) -> bytes:
        blocks.append(bytes((len(blocks) * 7 + i) % 256 for i in range(n)))
        return blocks[-1]

    monkeypatch.setattr(os, "urandom", urandom)
    pool = EntropyPool(block=32)
    draws = [pool(10) for _ in range(7)]
    assert all(len(d) == 10 for d in draws)
    # Three draws fit a 32-byte block; the fourth starts a new block; nothing is reused.
    assert draws[:3] == [blocks[0][0:10], blocks[0][10:20], blocks[0][20:30]]
    assert draws[3] == blocks[1][0:10]
    assert len(blocks) == 3
    assert pool(100) == blocks[3] and len(blocks[3]) == 100  # larger than a block: direct


def test_threads_sharing_a_pool_never_get_the_same_bytes() -> None:
    pool = EntropyPool(block=64)  # small blocks: many refills racing with draws
    seen: list[list[bytes]] = [[] for _ in range(8)]

    def draw(out: list[bytes]) -> None:
        for _ in range(5000):
            out.append(pool(10))

    threads = [threading.Thread(target=draw, args=(out,)) for out in seen]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    everything = [d for out in seen for d in out]
    assert len(everything) == 40_000
    assert len(set(everything)) == len(everything)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_bytes() -> None:
    pool = EntropyPool()
    pool(10)  # the parent holds a block with bytes still to hand out
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.write(writer, pool(10))
        finally:
            os._exit(0)
    os.close(writer)
    from_child = os.read(reader, 10)
    os.close(reader)
    os.waitpid(child, 0)
    assert len(from_child) == 10
    assert from_child != pool(10)
