"""The result store's shared commits: who waits for what, and whose put fails when one does.

The commit itself is a stand-in here (what is grouped is pure bookkeeping); that the statement
stores every row of a group, duplicates included, is
``tests/integration/test_producer.py::test_result_store_serves_threads_concurrently`` and
``::test_one_commit_stores_a_group_with_the_same_payload_twice``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from ledger.errors import ResultStoreError
from ledger.pg import DatabaseError, DatabaseUnavailableError
from ledger.results import PreparedResult, ResultStore, _GroupCommit


def _result(text: str) -> PreparedResult:
    return ResultStore.prepare("acme", text.encode())


class _Commits:
    """A commit that records each group it is given; the first one waits for ``release``."""

    def __init__(self, refuse: Callable[[Sequence[PreparedResult]], BaseException | None]) -> None:
        self.groups: list[list[bytes]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self._refuse = refuse

    def __call__(self, results: Sequence[PreparedResult]) -> None:
        self.groups.append([r.payload for r in results])
        if len(self.groups) == 1:
            self.entered.set()
            assert self.release.wait(10)
        cause = self._refuse(results)
        if cause is not None:
            raise ResultStoreError(f"refused: {cause}") from cause


def _put_all(
    group: _GroupCommit, commits: _Commits, followers: list[str]
) -> dict[str, BaseException | None]:
    """A leader whose commit is held open, then ``followers`` queued behind it, then let go."""
    outcome: dict[str, BaseException | None] = {}

    def put(text: str) -> None:
        try:
            group.put(_result(text))
            outcome[text] = None
        except ResultStoreError as exc:
            outcome[text] = exc

    threads = [threading.Thread(target=put, args=("leader",))]
    threads[0].start()
    assert commits.entered.wait(10)
    for text in followers:
        threads.append(threading.Thread(target=put, args=(text,)))
        threads[-1].start()
    deadline = time.monotonic() + 10
    while len(group._queue) < len(followers):  # every follower is waiting in the queue
        assert time.monotonic() < deadline
        time.sleep(0.001)
    commits.release.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    return outcome


def test_callers_arriving_during_a_commit_share_the_next_one() -> None:
    commits = _Commits(lambda results: None)
    outcome = _put_all(_GroupCommit(commits), commits, ["a", "b", "c", "d"])
    assert outcome == dict.fromkeys(["leader", "a", "b", "c", "d"])
    assert commits.groups[0] == [b"leader"]
    assert sorted(commits.groups[1]) == [b"a", b"b", b"c", b"d"]
    assert len(commits.groups) == 2


def test_a_lone_caller_commits_at_once_and_alone() -> None:
    groups: list[int] = []
    group = _GroupCommit(lambda results: groups.append(len(results)))
    for number in range(3):
        group.put(_result(f"alone {number}"))
    assert groups == [1, 1, 1]


def test_a_refused_row_fails_only_its_own_caller() -> None:
    def refuse(results: Sequence[PreparedResult]) -> BaseException | None:
        poisoned = any(r.payload == b"poison" for r in results)
        return DatabaseError("value refused") if poisoned else None

    commits = _Commits(refuse)
    outcome = _put_all(_GroupCommit(commits), commits, ["a", "poison", "b"])
    assert outcome["leader"] is None and outcome["a"] is None and outcome["b"] is None
    refused = outcome["poison"]
    assert isinstance(refused, ResultStoreError) and "value refused" in str(refused)
    assert isinstance(refused.__cause__, DatabaseError)
    # The shared commit failed, then each of its rows was committed alone.
    assert sorted(commits.groups[1]) == [b"a", b"b", b"poison"]
    assert sorted(commits.groups[2:]) == [[b"a"], [b"b"], [b"poison"]]


def test_a_database_that_is_away_fails_the_whole_group_once() -> None:
    def refuse(results: Sequence[PreparedResult]) -> BaseException | None:
        first = results[0].payload == b"leader"
        return None if first else DatabaseUnavailableError("no answer within 30s")

    commits = _Commits(refuse)
    outcome = _put_all(_GroupCommit(commits), commits, ["a", "b"])
    assert outcome["leader"] is None
    for text in ("a", "b"):
        error = outcome[text]
        assert isinstance(error, ResultStoreError) and "no answer" in str(error)
    assert outcome["a"] is not outcome["b"]  # each caller raises its own exception
    assert len(commits.groups) == 2  # no row-by-row retry: each would wait out the window


def test_puts_queued_while_the_database_was_away_fail_with_it_instead_of_waiting_again() -> None:
    def refuse(results: Sequence[PreparedResult]) -> BaseException | None:
        return DatabaseUnavailableError("no answer within 30s")

    commits = _Commits(refuse)
    outcome = _put_all(_GroupCommit(commits), commits, ["a", "b"])
    for text in ("leader", "a", "b"):
        error = outcome[text]
        assert isinstance(error, ResultStoreError) and "no answer" in str(error)
    assert len(commits.groups) == 1  # "a" and "b" waited out the leader's window already


def test_a_group_stops_at_the_byte_limit_and_the_rest_goes_next() -> None:
    commits = _Commits(lambda results: None)
    outcome = _put_all(
        _GroupCommit(commits, byte_limit=8), commits, ["a", "bb", "cc", "dddddddddd"]
    )
    assert all(error is None for error in outcome.values())
    assert commits.groups[0] == [b"leader"]
    later = commits.groups[1:]
    # Each group stays within the limit unless it is one payload alone; 15 bytes need two.
    assert all(sum(map(len, group)) <= 8 or len(group) == 1 for group in later)
    assert len(later) >= 2
    assert sorted(p for group in commits.groups[1:] for p in group) == [
        b"a",
        b"bb",
        b"cc",
        b"dddddddddd",
    ]


def test_an_interrupted_commit_fails_its_followers_and_the_next_caller_still_commits() -> None:
    calls = 0

    def commit(results: Sequence[PreparedResult]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyboardInterrupt

    group = _GroupCommit(commit)
    with pytest.raises(KeyboardInterrupt):
        group.put(_result("interrupted"))
    group.put(_result("after"))  # the group is not left with a leader that is gone
    assert calls == 2


def test_a_caller_interrupted_while_waiting_does_not_leave_the_others_without_a_leader() -> None:
    """This (main) thread queues behind a held commit and is interrupted by a real SIGINT; the
    leader then hands the lead on, and a later put still commits instead of waiting for a
    leader who is gone."""
    commits = _Commits(lambda results: None)
    group = _GroupCommit(commits)
    leader = threading.Thread(target=group.put, args=(_result("leader"),))
    leader.start()
    assert commits.entered.wait(10)

    main = threading.get_ident()

    def interrupt_when_queued() -> None:
        deadline = time.monotonic() + 10
        while not group._queue and time.monotonic() < deadline:
            time.sleep(0.001)
        # To the main thread itself: os.kill lets the kernel pick any thread (librdkafka's,
        # this one), and a main thread blocked on its latch would not wake to run the handler
        # (failed once in CI: "DID NOT RAISE").
        signal.pthread_kill(main, signal.SIGINT)

    # Whatever an earlier test in this process left as SIGINT's handler, Python's own here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=interrupt_when_queued)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            group.put(_result("interrupted"))
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupter.join(10)
    commits.release.set()
    leader.join(10)
    assert not leader.is_alive()
    later = threading.Thread(target=group.put, args=(_result("later"),), daemon=True)
    later.start()
    later.join(10)
    assert not later.is_alive(), "a put waited for a leader that was interrupted"
    assert [b"later"] in commits.groups
