"""ledger.heap: the start-up heap is frozen, what comes later is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from ledger.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("thawed")
def test_startup_objects_frozen_and_later_cycles_still_collected() -> None:
    survivor = _Node()
    frozen = freeze_startup_heap()
    assert frozen >= 1
    assert gc.get_freeze_count() == frozen
    assert not any(obj is survivor for obj in gc.get_objects())  # out of every generation

    first, second = _Node(), _Node()
    first.other, second.other = second, first  # a cycle: only the collector frees it
    probe = weakref.ref(first)
    del first, second
    gc.collect()
    assert probe() is None
