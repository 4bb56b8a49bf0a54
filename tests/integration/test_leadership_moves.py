"""Partition leadership moves for real while services call: a private three-node KRaft cluster
(``tests/cluster_support.py``), topics replicated three times with two in sync to acknowledge,
the projector worker running on it, and leaders moved by SIGKILLing a node, by a controlled
shutdown (SIGTERM, as a rolling restart does) and, once each node is back, by the admin API's
preferred-leader election.

Meanwhile threads make SDK calls (``execute`` with a known operation id, the first time),
others ``execute`` finished operations again with the same id, and others read their history
(``HistoryReader.load``). Leadership moving is routine for a Kafka cluster: no caller may see
an exception for it (a retriable Kafka error surfacing is a failure), every operation's
provider is called exactly once (counted at the provider: what the outside world saw), and
nothing acknowledged is lost (the log holds every outcome, the projection equals an
independent fold of the log).
"""

from __future__ import annotations

import collections
import functools
import json
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.admin._resource import ResourceType

from ledger.codec import default_codec
from ledger.domain.events import ExecutionTransitioned
from ledger.domain.states import ExecutionState
from ledger.history import HistoryReader
from ledger.log.clients import new_admin
from ledger.pg import open_pool
from ledger.settings import Settings
from ledger.topics import all_topic_specs
from producers import TransitionRecorder
from tests.cluster_support import KafkaCluster
from tests.integration.test_careless_callers import Tool
from tests.integration.test_execute import allow_all
from tests.process_support import kill, start_cli, wait_http
from tests.support import (
    assert_projection_matches,
    env_for,
    free_port,
    independent_fold,
    read_all,
    wait_caught_up,
)

X = ExecutionState
ROOT = Path(__file__).resolve().parents[2]
TENANT, ACTOR, TOOL = "acme", "agent-7", "tool"
#: Threads of each kind: new calls, calls again with a finished operation's id, history reads.
CALLERS, REPEATERS, READERS = 3, 2, 2
#: How long a node stays away while the calls go on (leaders elsewhere, two replicas in sync).
AWAY_S = 4.0
#: Calls go on for this long after each move, so every move meets calls in flight.
SETTLE_S = 3.0


@dataclass
class Failure:
    """An exception a caller saw: which kind of call, on which operation, and where."""

    kind: str
    operation_id: str
    error: BaseException
    trace: str
    #: when, in seconds since the traffic began, and in which thread
    at: float
    thread: str

    def site(self) -> str:
        """Where it surfaced (the innermost frame of opledger's own code, not the test's) and,
        for an error raised from another, where that one came from."""
        root = self.error
        while root.__cause__ is not None:
            root = root.__cause__
        raised, origin = _innermost(self.error), _innermost(root)
        return raised if origin == raised else f"{raised}, from {origin}"

    def shape(self) -> str:
        return f"{type(self.error).__name__}: {str(self.error)[:160]}"


def _innermost(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "/tests/" not in f.filename]
    if not (ours or frames):
        return "?"
    frame = (ours or frames)[-1]
    path = Path(frame.filename)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{where}:{frame.lineno} in {frame.name}"


@dataclass
class Traffic:
    """What the threads did and saw (appended under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    began: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    #: every operation id a caller began, with the arguments it called with
    begun: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: operations a caller saw finish, their id and state (repeaters and readers take these)
    finished: list[tuple[str, ExecutionState]] = field(default_factory=list)
    repeats: list[tuple[str, Any]] = field(default_factory=list)
    reads: list[tuple[str, ExecutionState | None]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    slowest: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def attempt(self, kind: str, operation_id: str, call: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            return call()
        except Exception as exc:
            with self.lock:
                self.failures.append(
                    Failure(
                        kind,
                        operation_id,
                        exc,
                        traceback.format_exc(),
                        self.now(),
                        threading.current_thread().name,
                    )
                )
            return None
        finally:
            with self.lock:
                self.slowest[kind] = max(self.slowest[kind], time.monotonic() - started)

    def now(self) -> float:
        return round(time.monotonic() - self.began, 1)

    def summary(self) -> str:
        """Each kind of failure once: how often, when (seconds since the traffic began), in
        how many threads, and where it surfaced."""
        groups: dict[tuple[str, str, str], list[Failure]] = collections.defaultdict(list)
        for f in self.failures:
            groups[(f.kind, f.shape(), f.site())].append(f)
        return "\n".join(
            f"{len(fs)} x {kind}: {shape}\n      at {site}; between {fs[0].at}s and "
            f"{fs[-1].at}s, in {len({f.thread for f in fs})} thread(s)"
            for (kind, shape, site), fs in groups.items()
        )


def _caller(traffic: Traffic, recorder: TransitionRecorder, number: int) -> None:
    n = 0
    while not traffic.stop.is_set():
        n += 1
        operation_id = recorder.new_operation_id()
        arguments = {"caller": number, "n": n}
        with traffic.lock:
            traffic.begun[operation_id] = arguments
        call = functools.partial(
            recorder.execute, TENANT, ACTOR, TOOL, arguments, operation_id=operation_id
        )
        done = traffic.attempt("execute", operation_id, call)
        if done is not None:
            with traffic.lock:
                traffic.finished.append((operation_id, done.state))


def _repeater(traffic: Traffic, recorder: TransitionRecorder, number: int) -> None:
    """``execute`` again, with the same id and arguments, operations that finished: each
    repeater takes its own share of them, so no two calls of one recorder share an id (the
    recorder refuses that by design)."""
    rng = random.Random(number)
    while not traffic.stop.wait(0.05):
        with traffic.lock:
            mine = [op for i, (op, _s) in enumerate(traffic.finished) if i % REPEATERS == number]
        if not mine:
            continue
        operation_id = rng.choice(mine[-20:])
        with traffic.lock:
            arguments = traffic.begun[operation_id]
        call = functools.partial(
            recorder.execute, TENANT, ACTOR, TOOL, arguments, operation_id=operation_id
        )
        again = traffic.attempt("execute again", operation_id, call)
        if again is not None:
            with traffic.lock:
                traffic.repeats.append((operation_id, again))


def _reader(traffic: Traffic, settings: Settings, number: int) -> None:
    """``HistoryReader.load`` of a few operations that finished, with a reader of its own."""
    pool = open_pool(settings.dsn, name=f"leadership-reader-{number}", max_size=2)
    reader = HistoryReader(settings, pool, client_id=f"leadership-reader-{number}")
    rng = random.Random(1000 + number)
    try:
        while not traffic.stop.wait(0.05):
            with traffic.lock:
                recent = [op for op, _s in traffic.finished[-50:]]
            if not recent:
                continue
            wanted = rng.sample(recent, min(3, len(recent)))
            call = functools.partial(reader.load, [(op, TENANT) for op in wanted])
            loaded = traffic.attempt("history load", ",".join(wanted), call)
            if loaded is not None:
                with traffic.lock:
                    for op in wanted:
                        execution = loaded[op].execution
                        traffic.reads.append((op, None if execution is None else execution.state))
    finally:
        reader.close()
        pool.close()


@dataclass
class Moves:
    """What the mover did, and which partitions' leaders each step moved."""

    steps: list[dict[str, Any]] = field(default_factory=list)

    def moved(self, how: str) -> int:
        return sum(len(step["moved"]) for step in self.steps if step["how"] == how)


def _changed(before: dict[tuple[str, int], int], after: dict[tuple[str, int], int]) -> list[str]:
    return sorted(
        f"{t}[{p}] {before[(t, p)]}->{after[(t, p)]}"
        for (t, p) in before
        if before[(t, p)] != after.get((t, p))
    )


def _move_leaders(cluster: KafkaCluster, topics: list[str], traffic: Traffic) -> Moves:
    """Take each node away in turn (SIGKILL, SIGTERM, SIGKILL), calls going on; bring it back,
    wait until it is in sync again, and elect the preferred leaders (the node's leaderships
    move back to it). Every node runs again when this returns."""
    moves = Moves()
    for node_id, how in zip(cluster.nodes, ("SIGKILL", "SIGTERM", "SIGKILL"), strict=False):
        # Leaders as a node that stays up sees them (the cluster-wide client may ask any).
        witness = min(n for n in cluster.nodes if n != node_id)
        before = cluster.leaders(topics, witness)
        started = time.monotonic()
        at = traffic.now()
        if how == "SIGKILL":
            cluster.kill(node_id)
        else:
            cluster.terminate(node_id)
        cluster.wait_leaders_off(node_id, topics)
        after = cluster.leaders(topics, witness)
        moves.steps.append(
            {
                "how": how,
                "node": node_id,
                "at": at,
                "moved": _changed(before, after),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
        traffic.stop.wait(AWAY_S)
        restarted = cluster.restart(node_id)
        cluster.wait_in_sync(topics)
        traffic.stop.wait(SETTLE_S)
        before = cluster.leaders(topics, witness)
        at = traffic.now()
        elected = cluster.elect_preferred(topics)
        cluster.wait_in_sync(topics)
        after = cluster.leaders(topics, witness)
        moves.steps.append(
            {
                "how": "preferred election",
                "node": node_id,
                "at": at,
                "moved": _changed(before, after),
                "elected": len(elected),
                "restart_seconds": round(restarted, 1),
            }
        )
        traffic.stop.wait(SETTLE_S)
    return moves


def _run(
    cluster: KafkaCluster, settings: Settings, projector_port: int, tmp_path: Path
) -> tuple[Traffic, Tool]:
    """Start the threads, move the leaders, stop the threads; write what happened to
    ``tmp_path`` (report.json, failures.txt) and check that no caller saw an exception."""
    ours = [spec.name for spec in all_topic_specs(settings)]
    tool = Tool(TOOL)
    traffic = Traffic()
    threads: list[threading.Thread] = []
    callers = TransitionRecorder.connect(settings, providers=[tool], owner="callers")
    again = TransitionRecorder.connect(settings, providers=[tool], owner="repeaters")
    callers.collaborators.policy = again.collaborators.policy = allow_all
    try:
        wait_http(f"http://127.0.0.1:{projector_port}/healthz", timeout=120)
        cluster.wait_in_sync(ours)
        for target, count, first in (
            (_caller, CALLERS, callers),
            (_repeater, REPEATERS, again),
            (_reader, READERS, settings),
        ):
            threads += [
                threading.Thread(target=target, args=(traffic, first, n), daemon=True)
                for n in range(count)
            ]
        traffic.began = time.monotonic()
        for thread in threads:
            thread.start()
        traffic.stop.wait(SETTLE_S)
        # Consumers looking for their group coordinator made the cluster create its offsets
        # topic by now: its leaders move too.
        present = cluster.admin().list_topics(timeout=10).topics
        topics = ours + [t for t in ("__consumer_offsets",) if t in present]
        cluster.wait_in_sync(topics)
        started = time.monotonic()
        moves = _move_leaders(cluster, topics, traffic)
        moving_s = time.monotonic() - started
    finally:
        traffic.stop.set()
        for thread in threads:
            thread.join(120)
        callers.close()
        again.close()
        for node_id, node in cluster.nodes.items():
            if not node.running:  # the mover failed half-way: the next test needs every node
                cluster.restart(node_id)
    report = {
        "moving_seconds": round(moving_s, 1),
        "moves": moves.steps,
        "begun": len(traffic.begun),
        "finished": len(traffic.finished),
        "repeats": len(traffic.repeats),
        "reads": len(traffic.reads),
        "failures": len(traffic.failures),
        "failure_kinds": traffic.summary().splitlines(),
        "slowest_seconds": {k: round(v, 2) for k, v in traffic.slowest.items()},
        "provider_calls_not_once": {
            op: tool.calls.get(op, 0)
            for op in [*traffic.begun, *tool.calls]
            if tool.calls.get(op, 0) != 1 or op not in traffic.begun
        },
    }
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    (tmp_path / "failures.txt").write_text(
        "\n\n".join(
            f"{f.at}s {f.thread}: {f.kind} {f.operation_id}\n{f.trace}" for f in traffic.failures
        )
    )
    print(json.dumps(report, indent=1))  # the numbers of a run, shown with -s

    assert not [t.name for t in threads if t.is_alive()], "a caller hung"
    # The test moved leaders for real: the kills and the elections each moved some.
    assert moves.moved("SIGKILL") and moves.moved("SIGTERM"), moves.steps
    assert moves.moved("preferred election"), moves.steps
    assert len(traffic.finished) >= 10 and traffic.repeats and traffic.reads, report
    # No caller saw an exception.
    assert not traffic.failures, (
        f"{len(traffic.failures)} calls failed while leaders moved (traces in "
        f"{tmp_path / 'failures.txt'}):\n{traffic.summary()}"
    )
    return traffic, tool


def _replication(settings: Settings) -> dict[str, tuple[int, str]]:
    """Each topic's fewest replicas and its min.insync.replicas, as the cluster has them."""
    admin = new_admin(settings, client_id="tests-replication")
    names = [spec.name for spec in all_topic_specs(settings)]
    metadata = admin.list_topics(timeout=10).topics
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in names]
    configs = {r.name: f.result(10) for r, f in admin.describe_configs(resources).items()}
    return {
        name: (
            min(len(p.replicas) for p in metadata[name].partitions.values()),
            configs[name]["min.insync.replicas"].value,
        )
        for name in names
    }


def test_cluster_topics_are_replicated_to_every_node(
    kafka_cluster: KafkaCluster, cluster_isolated: Settings
) -> None:
    assert kafka_cluster.registered() == {1, 2, 3}
    replication = _replication(cluster_isolated)
    assert set(replication.values()) == {(3, "2")}, replication


def test_calls_repeats_and_reads_ride_out_leadership_moves(
    kafka_cluster: KafkaCluster, cluster_isolated: Settings, tmp_path: Path
) -> None:
    settings = cluster_isolated
    projector_port = free_port()
    env = env_for(settings, PYTHONPATH=str(ROOT), OPLEDGER_PROJECTOR_WEB_PORT=str(projector_port))
    projector = start_cli(["projector", "run"], env, tmp_path / "projector.log")
    try:
        traffic, tool = _run(kafka_cluster, settings, projector_port, tmp_path)
        wait_caught_up(settings, timeout=180)
        fold = independent_fold(settings)
    finally:
        kill(projector)

    # Each operation's provider was called exactly once; a repeat called nothing.
    assert dict(tool.calls) == dict.fromkeys(traffic.begun, 1)
    assert {state for _op, state in traffic.finished} == {X.SUCCEEDED}
    assert all(r.repeat and r.state is X.SUCCEEDED for _op, r in traffic.repeats)
    assert {op for op, r in traffic.repeats} <= {op for op, _s in traffic.finished}
    assert {state for _op, state in traffic.reads} == {X.SUCCEEDED}
    # Nothing lost: the log ends every operation SUCCEEDED, and the projection holds exactly
    # what an independent fold of the log does.
    codec = default_codec()
    last: dict[str, ExecutionState] = {}
    for _p, _o, _k, value in read_all(settings, settings.execution_topic):
        event = codec.decode(value or b"")
        if isinstance(event, ExecutionTransitioned):
            last[event.operation_id] = event.state
    assert last == dict.fromkeys(traffic.begun, X.SUCCEEDED)
    assert_projection_matches(settings, fold)
    with psycopg.connect(settings.dsn) as conn:
        states = conn.execute(
            "SELECT execution_state, count(*) FROM agent_operations GROUP BY 1"
        ).fetchall()
    assert states == [("SUCCEEDED", len(traffic.begun))]
