"""Every Kafka client opledger builds takes its configuration from ``ledger.kafka``.

``ledger/kafka.py`` says so in its docstring: durability, partitioning and where librdkafka's
log goes are decided there once. A configuration spelled out elsewhere loses those silently (an
admin client without the factory's logger printed librdkafka's lines to stderr during
``opledger stack up``). Checked over the source with ``ast``: a dict literal with a
``"bootstrap.servers"`` key outside the factory is one such configuration.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ledger", "producers", "processors", "projections", "consumers", "opledger")
FACTORY = ROOT / "ledger" / "kafka.py"


def _spelled_out_configs(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        and any(
            isinstance(key, ast.Constant) and key.value == "bootstrap.servers" for key in node.keys
        )
    ]


def test_no_kafka_client_configuration_is_spelled_out_beside_the_factory() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != FACTORY
        for line in _spelled_out_configs(path)
    }
    assert not found, f"Kafka client configs built outside ledger/kafka.py: {sorted(found)}"


def test_the_check_sees_a_configuration_spelled_out(tmp_path: Path) -> None:
    source = tmp_path / "client.py"
    source.write_text('AdminClient({"bootstrap.servers": "x:9092", "log_level": 0})\n')
    assert _spelled_out_configs(source) == [1]
    assert _spelled_out_configs(FACTORY), "the factory itself spells the key: the check reads it"
