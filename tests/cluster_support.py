"""A private Kafka cluster for tests: three combined broker and controller KRaft nodes on
127.0.0.1, from the local stack's jars, each with its own ports and log dirs under one
directory, sharing one cluster id.

Tests move partition leadership on it (stop a node, bring it back, elect the preferred
leaders); scale-out tests can build on it. Nodes are configured as the local stack's single
node is (``opledger.stack.kraft_properties``), with the internal topics replicated to the
cluster's size and ``extra`` properties on top.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from confluent_kafka import ElectionType, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from opledger import stack
from tests.support import free_port

#: A node's heap: three of them share two cores and the shared stack's broker.
NODE_HEAP = "-Xmx384m"
#: How long the nodes may take to form a cluster, or one node to come back (slow machine).
START_TIMEOUT_S = 180.0
#: How long a node has to shut down on SIGTERM (a controlled shutdown) before it is killed.
STOP_TIMEOUT_S = 60.0

#: Lighter internal topics than the broker's defaults (50 partitions each), and no automatic
#: leader rebalancing: leadership moves when a test moves it, not every 5 minutes.
DEFAULT_EXTRA: Mapping[str, str] = MappingProxyType(
    {
        "offsets.topic.num.partitions": "6",
        "transaction.state.log.num.partitions": "6",
        "auto.leader.rebalance.enable": "false",
        "num.network.threads": "2",
        "num.io.threads": "2",
    }
)


class ClusterError(RuntimeError):
    """The cluster did not come up, or did not reach the state a test waits for."""


@dataclass(slots=True)
class Node:
    """One broker and controller: its id, listeners and files."""

    node_id: int
    port: int
    controller_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def config(self) -> Path:
        return self.directory / "server.properties"

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log(self) -> Path:
        return self.directory / "kafka.log"

    @property
    def stdout(self) -> Path:
        return self.directory / "kafka.out"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass(frozen=True, slots=True)
class PartitionState:
    """A partition as the cluster's metadata shows it."""

    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]

    @property
    def preferred(self) -> int:
        return self.replicas[0]


class KafkaCluster:
    """Three (``size``) KRaft nodes: :meth:`start` them, :meth:`kill` (SIGKILL) or
    :meth:`terminate` (SIGTERM, a controlled shutdown) one, :meth:`restart` it, :meth:`stop`
    them all. ``bootstrap`` names every node, as a client of a real cluster would."""

    def __init__(
        self,
        root: Path,
        java: str,
        libs: Path,
        *,
        size: int = 3,
        heap: str = NODE_HEAP,
        extra: Mapping[str, str] = DEFAULT_EXTRA,
    ) -> None:
        self.root = root
        self._java = java
        self._libs = libs
        self._heap = heap
        self._extra = dict(extra)
        self.nodes = {
            n: Node(n, free_port(), free_port(), root / f"node-{n}") for n in range(1, size + 1)
        }
        self._admins: dict[int | None, AdminClient] = {}

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.address for node in self.nodes.values())

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT_S) -> float:
        """Write each node's configuration, format its log dirs with one cluster id, start
        them all and wait until every broker is registered; returns the seconds it took."""
        started = time.monotonic()
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes.values())
        cluster_id = stack.random_cluster_id()
        for node in self.nodes.values():
            node.directory.mkdir(parents=True, exist_ok=True)
            properties = stack.kraft_properties(
                node_id=node.node_id,
                port=node.port,
                controller_port=node.controller_port,
                voters=voters,
                log_dir=node.data,
                replication=self.size,
            )
            stack.write_properties(node.config, {**properties, **self._extra})
            stack.format_kafka_storage(self._java, self._libs, node.config, cluster_id)
        for node in self.nodes.values():
            self._spawn(node)
        self.wait_registered(self.nodes, timeout=timeout - (time.monotonic() - started))
        return time.monotonic() - started

    def stop(self) -> None:
        """SIGKILL every node and wait for them; also when start-up failed half-way. Not a
        controlled shutdown: the data is thrown away, and the last brokers of a quorum that is
        leaving as a whole would wait for it, for a minute, before they give up."""
        self._admins.clear()  # admin clients close with their last reference
        for node in self.nodes.values():
            self._signal(node, signal.SIGKILL)
        for node in self.nodes.values():
            self._reap(node, 30)

    def kill(self, node_id: int) -> None:
        """SIGKILL a node (a crash: no controlled shutdown) and wait until it is gone."""
        node = self.nodes[node_id]
        self._signal(node, signal.SIGKILL)
        self._reap(node, 30)

    def terminate(self, node_id: int) -> None:
        """SIGTERM a node (a controlled shutdown, as a rolling restart does: its leaderships
        move first) and wait until it has exited (SIGKILL past STOP_TIMEOUT_S)."""
        node = self.nodes[node_id]
        self._signal(node, signal.SIGTERM)
        self._reap(node, STOP_TIMEOUT_S)

    def restart(self, node_id: int, timeout: float = START_TIMEOUT_S) -> float:
        """Start a node again (SIGTERMed first if it still runs) on its ports and log dirs, and
        wait until it answers as a registered broker; returns the seconds that took."""
        node = self.nodes[node_id]
        if node.running:
            self.terminate(node_id)
        started = time.monotonic()
        self._spawn(node)
        self.wait_registered([node_id], timeout=timeout)
        return time.monotonic() - started

    def _spawn(self, node: Node) -> None:
        argv = stack.kafka_command(self._java, self._libs, node.config, node.log, self._heap)
        with node.stdout.open("ab") as out:
            # A session of its own, so that a signal to its group reaches the JVM alone.
            node.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=node.directory,
            )

    @staticmethod
    def _signal(node: Node, signum: int) -> None:
        if node.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signum)

    @staticmethod
    def _reap(node: Node, timeout: float) -> None:
        if node.process is None:
            return
        try:
            node.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(timeout=30)

    # -- what the cluster says ------------------------------------------------------------------

    def admin(self, node_id: int | None = None) -> AdminClient:
        """An admin client on every node, or on ``node_id`` alone (quiet: nodes are expected
        to be away at times)."""
        if node_id not in self._admins:
            servers = self.bootstrap if node_id is None else self.nodes[node_id].address
            self._admins[node_id] = AdminClient({"bootstrap.servers": servers, "log_level": 0})
        return self._admins[node_id]

    def registered(self) -> set[int]:
        """The brokers the cluster's metadata lists now (registered and not fenced)."""
        return {
            node.id for node in self.admin().describe_cluster(request_timeout=10).result().nodes
        }

    def wait_registered(self, node_ids: Iterable[int], timeout: float = START_TIMEOUT_S) -> None:
        """Until each of ``node_ids`` runs, answers metadata on its own listener and is listed
        by the cluster as a broker."""
        wanted = set(node_ids)
        deadline = time.monotonic() + timeout
        while True:
            for node_id in wanted:
                node = self.nodes[node_id]
                if node.process is not None and node.process.poll() is not None:
                    raise ClusterError(
                        f"node {node_id} exited (code {node.process.returncode}) while starting; "
                        f"its log:\n{self.log_tail(node_id)}"
                    )
            with contextlib.suppress(KafkaException):
                if wanted <= self.registered() and all(self._answers(n) for n in wanted):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"brokers {sorted(wanted)} not all registered within {timeout:.0f}s; "
                    + "; ".join(f"node {n}: {self.log_tail(n, 5)}" for n in sorted(wanted))
                )
            time.sleep(0.5)

    def _answers(self, node_id: int) -> bool:
        # The cluster may still list a SIGKILLed broker until its session runs out: ask the
        # node itself too.
        try:
            self.admin(node_id).list_topics(timeout=5)
        except KafkaException:
            return False
        return True

    def partitions(
        self, topics: Iterable[str], node_id: int | None = None
    ) -> dict[tuple[str, int], PartitionState]:
        """Leader, replicas and in-sync replicas of every partition of ``topics``, as one
        broker's metadata has them (``node_id``, or any). Brokers learn changes a moment apart:
        :meth:`wait_in_sync` waits until every running one agrees."""
        metadata = self.admin(node_id).list_topics(timeout=10).topics
        states: dict[tuple[str, int], PartitionState] = {}
        for topic in topics:
            for partition in metadata[topic].partitions.values():
                states[(topic, partition.id)] = PartitionState(
                    partition.leader, tuple(partition.replicas), tuple(partition.isrs)
                )
        return states

    def leaders(
        self, topics: Iterable[str], node_id: int | None = None
    ) -> dict[tuple[str, int], int]:
        """The leader of each partition of ``topics``, as :meth:`partitions` sees it."""
        return {key: state.leader for key, state in self.partitions(topics, node_id).items()}

    def _each_running(self, topics: list[str]) -> list[dict[tuple[str, int], PartitionState]]:
        return [self.partitions(topics, n) for n, node in self.nodes.items() if node.running]

    def wait_in_sync(self, topics: Iterable[str], timeout: float = START_TIMEOUT_S) -> None:
        """Until every partition of ``topics`` has a leader and all its replicas in sync, as
        every running broker sees it."""
        names = list(topics)
        deadline = time.monotonic() + timeout
        behind: dict[tuple[str, int], PartitionState] = {}
        while True:
            # KeyError: a topic created a moment ago is not in a broker's metadata yet.
            with contextlib.suppress(KafkaException, KeyError):
                behind = {
                    key: state
                    for view in self._each_running(names)
                    for key, state in view.items()
                    if state.leader < 0 or set(state.isr) != set(state.replicas)
                }
                if not behind:
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"partitions not in sync within {timeout:.0f}s: {behind}")
            time.sleep(0.5)

    def wait_leaders_off(
        self, node_id: int, topics: Iterable[str], timeout: float = START_TIMEOUT_S
    ) -> None:
        """Until no running broker sees a partition of ``topics`` led by ``node_id`` or
        leaderless (the node is gone and its leaderships have moved to other replicas)."""
        names = list(topics)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KafkaException, KeyError):
                led = [
                    key
                    for view in self._each_running(names)
                    for key, state in view.items()
                    if state.leader in (node_id, -1)
                ]
                if not led:
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"node {node_id} still leads (or no leader) after {timeout}s")
            time.sleep(0.2)

    def elect_preferred(
        self, topics: Iterable[str], timeout: float = START_TIMEOUT_S
    ) -> list[tuple[str, int]]:
        """Ask the cluster (the admin API's preferred-leader election) to move each partition
        of ``topics`` back to its first replica, and wait until every running broker's metadata
        shows the move; returns the partitions whose leader moved. A partition already led by
        its first replica ("election not needed") is no error."""
        names = list(topics)
        wanted = [TopicPartition(t, p) for t, p in self.partitions(names)]
        # No timeouts passed: confluent-kafka 2.16.1's binding fails on either keyword
        # (SystemError "more argument specifiers than keyword list entries"); the result is
        # waited for with a bound instead.
        future = self.admin().elect_leaders(ElectionType.PREFERRED, wanted)
        moved: list[tuple[str, int]] = []
        for tp, error in future.result(timeout=120).items():
            if error is None:
                moved.append((tp.topic, tp.partition))
                continue
            # A KafkaError per partition (the docstring says KafkaException; accept either).
            reason = error.args[0] if isinstance(error, KafkaException) and error.args else error
            if (
                not isinstance(reason, KafkaError)
                or reason.code() != KafkaError.ELECTION_NOT_NEEDED
            ):
                raise ClusterError(f"preferred election of {tp.topic}[{tp.partition}]: {error}")
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KafkaException, KeyError):
                views = self._each_running(names)
                if all(view[key].leader == view[key].preferred for view in views for key in moved):
                    return sorted(moved)
            if time.monotonic() > deadline:
                raise ClusterError(f"elected leaders not seen by every broker after {timeout}s")
            time.sleep(0.2)

    def log_tail(self, node_id: int, lines: int = 30) -> str:
        node = self.nodes[node_id]
        parts = []
        for path in (node.log, node.stdout):
            with contextlib.suppress(OSError):
                parts.append("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)
