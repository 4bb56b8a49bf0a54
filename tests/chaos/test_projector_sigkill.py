"""Kill -9 the real projector process mid-stream, again and again, then verify everything
(Kafka's streams_eos_test.py): the projections equal the independent fold of every record on the
topics, so nothing was lost and nothing was applied twice."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ledger.settings import Settings
from opledger.workload import Workload
from tests.support import (
    assert_projection_matches,
    end_offsets,
    env_for,
    free_port,
    independent_fold,
    produce,
    producer,
    stored_offsets,
    wait_caught_up,
)

OPERATIONS = 12000
CHUNK = 400
ROUNDS = 6
BURST = 300


def _start(settings: Settings, log: Path, faults: str = "") -> subprocess.Popen[bytes]:
    extra = {"OPLEDGER_FAULT_POINTS": faults} if faults else {}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "opledger.cli", "projector", "run"],
            env=env_for(settings, **extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _projected(settings: Settings) -> int:
    return sum(stored_offsets(settings).values())


def _wait_progress(
    settings: Settings,
    beyond: int,
    proc: subprocess.Popen[bytes],
    timeout: float = 60,
    *,
    armed: bool = False,
) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _projected(settings)
        if now > beyond:
            return now
        if armed and proc.poll() == -signal.SIGKILL:
            # Its fault point fired first. A commit can move no offset at all: deliveries read
            # before their executions are held back and read again (the projector's rewind),
            # so "N commits" need not mean "N batches of progress". The caller checks the kill.
            return now
        assert proc.poll() is None or proc.returncode == -signal.SIGKILL, (
            "projector exited on its own"
        )
        time.sleep(0.1)
    raise AssertionError(f"projector made no progress beyond {beyond} (exit {proc.poll()})")


def test_projector_survives_repeated_sigkill(isolated: Settings, tmp_path: Path) -> None:
    settings = isolated.with_(projector_web_port=free_port(), projector_batch=500)
    log = tmp_path / "projector.log"
    operations = list(Workload(seed=42).operations(OPERATIONS + ROUNDS * BURST))
    # A steady feed from a thread, plus one burst per round from here, so every kill lands
    # with records on the topics that the projection does not hold yet, however fast it runs.
    steady, bursts = operations[:OPERATIONS], operations[OPERATIONS:]
    total_events = sum(len(op) for op in operations)

    done = threading.Event()

    def feed() -> None:
        p = producer(settings)
        for start in range(0, len(steady), CHUNK):
            produce(settings, [e for op in steady[start : start + CHUNK] for e in op], p=p)
            time.sleep(0.2)
        done.set()

    def burst(round_: int) -> None:
        chunk = bursts[round_ * BURST : (round_ + 1) * BURST]
        produce(settings, [e for op in chunk for e in op], p=burst_producer)

    def behind() -> int:
        ends = end_offsets(settings, [settings.execution_topic, settings.delivery_topic])
        return sum(ends.values()) - _projected(settings)

    started_procs: list[subprocess.Popen[bytes]] = []

    def started(faults: str = "") -> subprocess.Popen[bytes]:
        started_procs.append(_start(settings, log, faults))
        return started_procs[-1]

    # Whatever fails, no projector outlives the test (its topics are about to be deleted).
    try:
        burst_producer = producer(settings)
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        rng = random.Random(1)
        kills_mid_stream = 0
        self_kills = 0
        proc = started()
        progress = 0
        # Four external SIGKILLs at random moments, then two at exact boundaries via fault points.
        for round_ in range(ROUNDS):
            progress = _wait_progress(settings, progress, proc, armed=round_ >= 4)
            burst(round_)
            if round_ < 4:
                time.sleep(rng.uniform(0.0, 0.3))
                if behind() > 0:
                    kills_mid_stream += 1
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                progress = _projected(settings)
                proc = started("projector.after_commit:kill@3" if round_ == 3 else "")
            else:
                # The armed process kills itself at the boundary; wait for it, then restart.
                proc.wait(60)
                assert proc.returncode == -signal.SIGKILL, (
                    f"fault point did not fire: {proc.returncode}"
                )
                self_kills += 1
                assert behind() > 0, "the fault point fired with nothing left to project"
                progress = _projected(settings)
                proc = started("projector.before_commit:kill@2" if round_ == 4 else "")
        feeder.join(120)
        assert done.is_set(), "the producer did not finish"
        wait_caught_up(settings, timeout=120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)

    finally:
        for leftover in started_procs:
            if leftover.poll() is None:
                os.killpg(leftover.pid, signal.SIGKILL)
                leftover.wait(10)
    assert kills_mid_stream == 4, f"only {kills_mid_stream} kills happened with records unprojected"
    assert self_kills == 2
    summary = assert_projection_matches(settings, independent_fold(settings))
    print(f"chaos: 6 SIGKILLs, {total_events} events, projection summary {summary}")
    assert summary["operations"] == len(operations)
    assert summary["history"] == total_events
