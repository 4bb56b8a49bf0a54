"""One way to the log (``ledger.log``), checked over the source with ``ast``.

Outside ``ledger/log/``, no module of opledger constructs a Kafka client, builds an
``OutgoingRecord``, encodes an event or produces a record: a fifth writer with its own headers
or its own idea of an acknowledged send is what this test exists to stop. Records that are not
events (dead letters, redriven records, key-store entries) are built by the modules that own
their contracts as ``RawRecord`` values and sent by ``ledger.log``'s ``RawWriter``; there is no
list of exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ledger", "producers", "processors", "projections", "consumers", "opledger")
LOG_PACKAGE = ROOT / "ledger" / "log"
CLIENTS = {"Producer", "Consumer", "AdminClient", "DeserializingConsumer", "SerializingProducer"}
#: Modules that once produced raw records with producers of their own; they must be scanned.
FORMER_RAW_PRODUCERS = (
    "processors/batch_reader.py",
    "consumers/dead_letters.py",
    "consumers/keystore.py",
)


def violations(source: str) -> list[str]:
    """What in ``source`` goes to the log another way."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in CLIENTS:
            found.append(f"line {node.lineno}: constructs a Kafka {name}")
        elif name == "OutgoingRecord":
            found.append(f"line {node.lineno}: builds an OutgoingRecord")
        elif name in {"encode", "encode_datum"} and isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if "codec" in owner.lower():
                found.append(f"line {node.lineno}: encodes an event ({owner}.{name})")
        elif name == "produce" and isinstance(func, ast.Attribute):
            found.append(f"line {node.lineno}: produces a record ({ast.unparse(func)})")
    return found


def _modules() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if LOG_PACKAGE not in path.parents and path.name != "codec.py"
    )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_the_log_module_writes_the_log(path: Path) -> None:
    found = violations(path.read_text())
    relative = str(path.relative_to(ROOT))
    assert not found, f"{relative} goes to the log without ledger.log: {found}"


def test_the_scan_reads_every_writer() -> None:
    """The check cannot pass by reading nothing: every package is scanned, the modules that
    once produced records themselves among them, and the log module's own sends are seen."""
    scanned = {str(path.relative_to(ROOT)) for path in _modules()}
    assert len(scanned) > 100
    assert {p.split("/")[0] for p in scanned} == set(PACKAGES)
    assert set(FORMER_RAW_PRODUCERS) <= scanned
    send = (LOG_PACKAGE / "send.py").read_text()
    assert any("produces a record" in f for f in violations(send))
    assert any(
        "constructs a Kafka" in f for f in violations((LOG_PACKAGE / "clients.py").read_text())
    )


@pytest.mark.parametrize(
    "source",
    [
        "from confluent_kafka import Producer\np = Producer({})",
        "import confluent_kafka\nc = confluent_kafka.Consumer({})",
        "from confluent_kafka.admin import AdminClient\na = AdminClient({})",
        "r = OutgoingRecord('t', b'k', b'v', [])",
        "value = self._codec.encode(event)",
        "value = default_codec().encode_datum('X', {})",
        "producer.produce('t', b'v')",
        "self._dlq.produce(topic, key=k, value=v, headers=h, on_delivery=cb)",
        "self._producer.produce(self._topic, value, key, partition=p, on_delivery=cb)",
    ],
)
def test_the_check_sees_each_way_around(source: str) -> None:
    assert violations(source)


def test_the_check_leaves_other_encodes_alone() -> None:
    assert not violations("data = text.encode('utf-8')\nkey = entry.encode()")
