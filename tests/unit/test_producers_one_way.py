"""The SDK's modules (``producers/``) import each other one way and keep out of each other's
private members, checked over the source with ``ast``.

A cycle hidden behind ``TYPE_CHECKING`` is still a cycle: the modules can then only be read,
and changed, together. And a module that reaches into another's ``_private`` members depends on
what that module is free to change without notice: what ``execute``'s steps need from a
recorder is a public object (``producers.execution.Collaborators``), not its attributes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "producers"
#: The modules a recorder is built from, which must never import a recorder back.
BELOW_THE_RECORDERS = ("execution", "planner", "steps", "operation")
#: Built-ins that reach a member by its name as a string.
BY_NAME = {"getattr", "setattr", "delattr", "hasattr"}


def _resolved(node: ast.ImportFrom, package: str, importer: str) -> str:
    """The absolute module an ``ImportFrom`` names (relative ones from ``importer``)."""
    if not node.level:
        return node.module or ""
    base = f"{package}.{importer}".split(".")[: -node.level]
    return ".".join([*base, node.module] if node.module else base)


def sibling_imports(source: str, package: str, importer: str, modules: set[str]) -> set[str]:
    """The modules of ``package`` (among ``modules``) that ``source`` imports, wherever the
    import is (``TYPE_CHECKING`` blocks and function bodies included)."""
    found: set[str] = set()
    prefix = f"{package}."
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolved(node, package, importer)
            if module == package:  # ``from producers import execution``: a module by name
                names = [f"{prefix}{alias.name}" for alias in node.names]
            else:
                names = [module]
        for name in names:
            if name.startswith(prefix):
                sibling = name[len(prefix) :].split(".")[0]
                if sibling in modules and sibling != importer:
                    found.add(sibling)
    return found


def import_graph(directory: Path, package: str) -> dict[str, set[str]]:
    """Which module of the package in ``directory`` imports which of its siblings."""
    sources = {path.stem: path.read_text() for path in sorted(directory.glob("*.py"))}
    modules = set(sources)
    return {
        name: sibling_imports(source, package, name, modules) for name, source in sources.items()
    }


def cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), or []."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            found = visit(imported)
            if found:
                return found
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module)
        if found:
            return found
    return []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(source: str) -> list[str]:
    """Where ``source`` touches a ``_private`` member of an object other than its own
    (``self``, ``cls``), directly or by name."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in {"self", "cls"}):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _sdk_modules() -> Iterator[Path]:
    yield from sorted(SDK.glob("*.py"))


# -- the SDK itself --------------------------------------------------------------------------


def test_the_sdk_modules_import_each_other_one_way() -> None:
    assert cycle(import_graph(SDK, "producers")) == []


def test_nothing_a_recorder_is_built_from_imports_a_recorder() -> None:
    graph = import_graph(SDK, "producers")
    back = {name: graph[name] & {"recorder", "aio"} for name in BELOW_THE_RECORDERS}
    assert back == {name: set() for name in BELOW_THE_RECORDERS}


def test_the_checker_sees_the_recorders_imports() -> None:
    # Guards the test above against a checker that sees nothing.
    graph = import_graph(SDK, "producers")
    assert {"execution", "planner", "steps", "operation"} <= graph["recorder"]
    assert "recorder" in graph["aio"]


def test_no_sdk_module_touches_another_objects_private_members() -> None:
    reaches = {
        str(path.relative_to(ROOT)): found
        for path in _sdk_modules()
        if (found := private_reaches(path.read_text()))
    }
    assert reaches == {}


def test_execute_steps_know_no_recorder() -> None:
    # They work with the Collaborators a recorder hands them, never with the recorder itself.
    tree = ast.parse((SDK / "execution.py").read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert named & {"RecorderCore", "TransitionRecorder", "AsyncTransitionRecorder"} == set()
    assert private_reaches(ast.unparse(tree)) == []


# -- the checkers fail on what they exist to stop -------------------------------------------


def _package(root: Path, files: Mapping[str, str]) -> Path:
    directory = root / "sdk"
    directory.mkdir()
    for name, source in files.items():
        (directory / f"{name}.py").write_text(source)
    return directory


def test_a_cycle_behind_type_checking_is_found(tmp_path: Path) -> None:
    directory = _package(
        tmp_path,
        {
            "__init__": "",
            "recorder": "from sdk import execution\nfrom sdk.steps import Record\n",
            "execution": "from sdk.steps import Record\n",
            "steps": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from sdk.recorder import Plan\n"
            ),
        },
    )
    graph = import_graph(directory, "sdk")
    assert graph["steps"] == {"recorder"}
    assert cycle(graph) == ["execution", "steps", "recorder", "execution"]


def test_relative_and_function_level_imports_count(tmp_path: Path) -> None:
    directory = _package(
        tmp_path,
        {
            "a": "def later():\n    from . import b\n",
            "b": "from .c import thing\n",
            "c": "import sdk.a\n",
        },
    )
    assert cycle(import_graph(directory, "sdk")) == ["a", "b", "c", "a"]


def test_one_way_imports_pass(tmp_path: Path) -> None:
    directory = _package(
        tmp_path,
        {
            "recorder": "from sdk import execution, planner\n",
            "execution": "from sdk.planner import Plan\nimport json\n",
            "planner": "from ledger.log import RecordBuilder\n",
        },
    )
    assert cycle(import_graph(directory, "sdk")) == []


def test_a_reach_into_private_members_is_found() -> None:
    source = (
        "def execute(core):\n"
        "    leases = core._leases\n"
        "    core.collaborators._policy = None\n"
        "    return getattr(core, '_drive')\n"
    )
    assert private_reaches(source) == [
        "line 2: core._leases",
        "line 3: core.collaborators._policy",
        "line 4: getattr(core, '_drive')",
    ]


def test_own_members_and_dunders_are_not_reaches() -> None:
    source = (
        "class Port:\n"
        "    def __init__(self, collaborators):\n"
        "        self._collaborators = collaborators\n"
        "    def read(self):\n"
        "        return self._collaborators.policy, type(self).__name__, cls_dict(self.__dict__)\n"
    )
    assert private_reaches(source) == []
