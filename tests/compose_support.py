"""docker-compose.yml as the apache/kafka image reads it, for the tests that check the file
without Docker (tests/unit/test_compose.py) and run its broker from the jars
(tests/integration/test_compose_broker.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]

#: The image's `render-properties` (apache/kafka docker/resources/utility): KAFKA_ dropped, a
#: single _ between letters becomes ., ___ becomes -, __ becomes _, all lower case.
_SINGLE = re.compile(r"[^_]_[^_]")
#: What the image's scripts read themselves rather than pass on as properties.
_NOT_PROPERTIES = {"KAFKA_OPTS", "KAFKA_HEAP_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_JMX_OPTS"}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def image_properties(environment: dict[str, Any]) -> dict[str, str]:
    """``server.properties`` as the apache/kafka image renders it from ``environment``."""
    properties = {}
    for key, value in environment.items():
        if not key.startswith("KAFKA_") or key in _NOT_PROPERTIES:
            continue
        name = _SINGLE.sub(lambda m: m.group(0).replace("_", "."), key[len("KAFKA_") :])
        properties[name.replace("___", "-").replace("__", "_").lower()] = str(value)
    return properties
