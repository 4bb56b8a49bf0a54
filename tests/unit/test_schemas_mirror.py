"""The .avsc files are the source of truth; the Python enums and pydantic events mirror them."""

from __future__ import annotations

import json
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from ledger.domain.events import (
    DeliveryTransitioned,
    ExecutionTransitioned,
    OwnershipTaken,
    PolicyChanged,
    ReconciliationDecided,
)
from ledger.domain.policy import PolicyChange
from ledger.domain.reconcile import Decision, LookupStatus
from ledger.domain.states import DeliveryState, ExecutionState

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"

MODELS: dict[str, type[BaseModel]] = {
    "opledger.v1.ExecutionTransitioned": ExecutionTransitioned,
    "opledger.v1.DeliveryTransitioned": DeliveryTransitioned,
    "opledger.v1.OwnershipTaken": OwnershipTaken,
    "opledger.v1.ReconciliationDecided": ReconciliationDecided,
    "opledger.v1.PolicyChanged": PolicyChanged,
}
ENUMS: dict[str, type[StrEnum]] = {
    "opledger.v1.ExecutionState": ExecutionState,
    "opledger.v1.DeliveryState": DeliveryState,
    "opledger.v1.Decision": Decision,
    "opledger.v1.LookupStatus": LookupStatus,
    "opledger.v1.PolicyChange": PolicyChange,
}
# The discriminator is a Python-side convenience; the topic (and the fingerprint) say the kind.
PYTHON_ONLY_FIELDS = {"kind"}


def _all_schema_files() -> list[Path]:
    return sorted(SCHEMAS.glob("*.avsc")) + sorted((SCHEMAS / "archive").glob("*.avsc"))


def _load(path: Path) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return schema


def _full_name(node: dict[str, Any], namespace: str) -> str:
    return f"{node.get('namespace', namespace)}.{node['name']}"


def _current() -> dict[str, dict[str, Any]]:
    schemas = {}
    for path in sorted(SCHEMAS.glob("*.avsc")):
        schema = _load(path)
        schemas[_full_name(schema, "")] = schema
    return schemas


def _enum_nodes(node: Any, namespace: str = "") -> list[tuple[str, list[str]]]:
    """Every enum declared anywhere inside a schema, as (full name, symbols)."""
    found: list[tuple[str, list[str]]] = []
    if isinstance(node, list):
        for branch in node:
            found += _enum_nodes(branch, namespace)
    elif isinstance(node, dict):
        namespace = node.get("namespace", namespace)
        if node.get("type") == "enum":
            found.append((_full_name(node, namespace), list(node["symbols"])))
        for field in node.get("fields", []):
            found += _enum_nodes(field["type"], namespace)
        if isinstance(node.get("type"), dict | list):
            found += _enum_nodes(node["type"], namespace)
    return found


def test_every_record_has_a_current_schema() -> None:
    assert set(_current()) == set(MODELS)


def test_python_enums_equal_the_avro_symbols_in_order() -> None:
    seen: dict[str, list[str]] = {}
    for schema in _current().values():
        seen.update(dict(_enum_nodes(schema)))
    assert set(seen) == set(ENUMS)
    for name, enum in ENUMS.items():
        assert [member.value for member in enum] == seen[name], name
        # Names and values agree, so `ExecutionState["X"]` and `ExecutionState("X")` are the same.
        assert [member.name for member in enum] == seen[name], name


@pytest.mark.parametrize("path", _all_schema_files(), ids=lambda p: p.name)
def test_enum_symbols_of_every_schema_version_are_known_to_python(path: Path) -> None:
    # An archived writer may only use symbols today's enum can represent (readers fail otherwise).
    for name, symbols in _enum_nodes(_load(path)):
        assert set(symbols) <= {m.value for m in ENUMS[name]}, (path.name, name)


def _python_type(annotation: Any) -> tuple[set[Any], bool]:
    """(non-None types, nullable) of a pydantic field annotation; a sequence is ("array", item)."""
    if get_origin(annotation) in (tuple, list):
        item = get_args(annotation)[0]
        return {("array", _bare(item))}, False
    if get_origin(annotation) in (Union, UnionType):
        args = {_bare(a) for a in get_args(annotation)}
        return {a for a in args if a is not NoneType}, NoneType in args
    return {_bare(annotation)}, False


def _bare(annotation: Any) -> Any:
    """``Annotated[str, constraints]`` -> ``str``."""
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _avro_type(avro: Any) -> tuple[Any, bool]:
    """(base Avro type or logical type, nullable) of a field type; an array is ("array", item)."""
    nullable = False
    if isinstance(avro, list):
        nullable = "null" in avro
        rest = [t for t in avro if t != "null"]
        assert len(rest) == 1, f"only [null, T] unions are used: {avro}"
        avro = rest[0]
    if isinstance(avro, dict):
        if avro["type"] == "array":
            return ("array", _avro_type(avro["items"])[0]), nullable
        return avro.get("logicalType", avro["type"]), nullable
    return avro, nullable


AVRO_TO_PYTHON = {
    "string": str,
    "int": int,
    "long": int,
    "boolean": bool,
    "timestamp-micros": datetime,
}


@pytest.mark.parametrize("record", sorted(MODELS))
def test_avro_fields_and_pydantic_fields_correspond(record: str) -> None:
    schema = _current()[record]
    model = MODELS[record]
    avro_fields = {f["name"]: f for f in schema["fields"]}
    model_fields = {
        name: info for name, info in model.model_fields.items() if name not in PYTHON_ONLY_FIELDS
    }
    assert set(avro_fields) == set(model_fields), "fields missing on one side"
    assert [f["name"] for f in schema["fields"]] == list(model_fields), "same order, easier review"

    for name, field in avro_fields.items():
        info = model_fields[name]
        py_types, py_nullable = _python_type(info.annotation)
        avro_base, avro_nullable = _avro_type(field["type"])
        assert py_nullable == avro_nullable, f"{record}.{name}: nullability differs"
        if avro_base == "enum":
            assert py_types == {ENUMS[_enum_nodes(field["type"], "opledger.v1")[0][0]]}
        elif isinstance(avro_base, tuple):
            # Arrays (of plain types) are immutable tuples on the Python side.
            assert py_types == {("array", AVRO_TO_PYTHON[avro_base[1]])}, f"{record}.{name}: array"
        else:
            assert py_types == {AVRO_TO_PYTHON[avro_base]}, f"{record}.{name}: type differs"
        # A field with a default in Avro has the same default in pydantic, and vice versa.
        assert ("default" in field) == (not info.is_required()), f"{record}.{name}: default"
        if "default" in field:
            default = list(info.default) if isinstance(info.default, tuple) else info.default
            assert default == field["default"], f"{record}.{name}: default value"


@pytest.mark.parametrize("path", _all_schema_files(), ids=lambda p: p.name)
def test_nullable_fields_default_to_null(path: Path) -> None:
    # Evolution rule: a field that may be absent gets a null default, so readers of this version
    # can read writers that predate it. Avro requires the default to match the FIRST branch.
    for field in _load(path)["fields"]:
        if isinstance(field["type"], list) and "null" in field["type"]:
            assert field["type"][0] == "null", f"{path.name}: {field['name']} null must come first"
            assert "default" in field, f"{path.name}: {field['name']} has no default"
            assert field["default"] is None, f"{path.name}: {field['name']} default is not null"
