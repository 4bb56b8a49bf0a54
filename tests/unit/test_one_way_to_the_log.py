"""One way to the log (``ledger.log``), checked over the source with ``ast``.

Outside ``ledger/log/``, no module of opledger constructs a Kafka client, builds an
``OutgoingRecord`` or encodes an event: a fifth writer with its own headers or its own idea of
an acknowledged send is what this test exists to stop. Raw records that are not events (dead
letters republished whole, the consumers' key-store entries) are produced by the modules that
own their contracts, through clients the factory made: they are named here, so a new one
cannot appear unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ledger", "producers", "processors", "projections", "consumers", "opledger")
LOG_PACKAGE = ROOT / "ledger" / "log"
CLIENTS = {"Producer", "Consumer", "AdminClient", "DeserializingConsumer", "SerializingProducer"}
#: Modules that produce raw records (not events) with a factory-made producer, and why.
RAW_PRODUCERS = {
    # the projector's dead letters: another record's own bytes and headers, with a reason
    "processors/batch_reader.py",
    # the queue consumers' dead letters and their redrive: records put back whole
    "consumers/dead_letters.py",
    # the key store: the consumers' own compacted contract, produced in bulk
    "consumers/keystore.py",
}


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
    if relative in RAW_PRODUCERS:
        found = [f for f in found if "produces a record" not in f]
    assert not found, f"{relative} goes to the log without ledger.log: {found}"


def test_the_raw_producers_still_produce() -> None:
    """The exceptions are real: a module that stopped producing is taken off the list."""
    for relative in RAW_PRODUCERS:
        assert any("produces" in f for f in violations((ROOT / relative).read_text())), relative


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
    ],
)
def test_the_check_sees_each_way_around(source: str) -> None:
    assert violations(source)


def test_the_check_leaves_other_encodes_alone() -> None:
    assert not violations("data = text.encode('utf-8')\nkey = entry.encode()")
