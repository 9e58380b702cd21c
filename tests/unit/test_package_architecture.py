"""The import graph of vllm_edsd/, weights_convert/ and bench/, read from the code with ``ast``:
no import circles between modules, and no import that goes against the rooms' order below
(docs/architecture.md explains the rooms). Every import counts: module level, inside
functions, and modules named in strings (``importlib.import_module`` tables,
``"package.module:Class"`` registrations). And no function or method of theirs longer than
MAX_FUNCTION_LINES."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_edsd", "weights_convert", "bench")

# room -> the rooms it may import (besides itself). A module's room is the longest entry that is
# it or a package above it. Add a room here, with what it needs, before importing across rooms.
ROOMS: dict[str, set[str]] = {
    # what every stage stands on
    "vllm_edsd.errors": set(),
    "vllm_edsd.version": set(),
    "vllm_edsd.command": {"vllm_edsd.errors"},
    "vllm_edsd.data": {"vllm_edsd.errors"},
    "vllm_edsd.checkpoint": {"vllm_edsd.errors"},
    "vllm_edsd.methods": {"vllm_edsd.errors", "vllm_edsd.checkpoint"},
    "vllm_edsd.launch": {"vllm_edsd.errors", "vllm_edsd.checkpoint"},
    # the data flow: select -> regenerate -> features -> train -> convert -> serve
    "vllm_edsd.selection": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.data",
                            "vllm_edsd.launch", "vllm_edsd.features"},
    "vllm_edsd.regeneration": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.data",
                               "vllm_edsd.launch"},
    "vllm_edsd.features": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.data",
                           "vllm_edsd.launch", "vllm_edsd.regeneration"},
    "vllm_edsd.training": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.methods",
                           "vllm_edsd.data", "vllm_edsd.launch", "vllm_edsd.features"},
    "vllm_edsd.conversion": {"vllm_edsd.errors", "vllm_edsd.version", "vllm_edsd.command", "vllm_edsd.checkpoint",
                             "vllm_edsd.methods"},
    "vllm_edsd.serving.patching": set(),  # how a change to vLLM is made (a module as a room)
    "vllm_edsd.serving.repairs": {"vllm_edsd.launch", "vllm_edsd.serving.patching"},
    "vllm_edsd.serving.features": {"vllm_edsd.errors"},
    "vllm_edsd.serving": {"vllm_edsd.errors", "vllm_edsd.checkpoint", "vllm_edsd.methods", "vllm_edsd.launch",
                          "vllm_edsd.serving.patching", "vllm_edsd.serving.repairs", "vllm_edsd.serving.features"},
    # the flow as one command, the demo, the entry points
    "vllm_edsd.pipeline": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.methods",
                           "vllm_edsd.data", "vllm_edsd.selection", "vllm_edsd.regeneration", "vllm_edsd.features",
                           "vllm_edsd.training", "vllm_edsd.conversion"},
    "vllm_edsd.demo": {"vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.checkpoint", "vllm_edsd.methods",
                       "vllm_edsd.data", "vllm_edsd.launch", "vllm_edsd.training", "vllm_edsd.conversion",
                       "vllm_edsd.pipeline"},
    "vllm_edsd.cli": {"vllm_edsd.command", "vllm_edsd.conversion", "vllm_edsd.selection", "vllm_edsd.regeneration",
                      "vllm_edsd.features", "vllm_edsd.training", "vllm_edsd.pipeline", "vllm_edsd.demo"},
    "vllm_edsd": {"vllm_edsd.version", "vllm_edsd.serving"},  # the package itself: the vLLM plugin entry point
    "vllm_edsd.__main__": {"vllm_edsd.cli"},  # python -m vllm_edsd (torchrun -m vllm_edsd)
    "weights_convert": {"vllm_edsd.conversion", "vllm_edsd.cli"},
    # the measurements
    "bench": {"vllm_edsd", "vllm_edsd.errors", "vllm_edsd.command", "vllm_edsd.data", "vllm_edsd.checkpoint",
              "vllm_edsd.methods", "vllm_edsd.launch", "vllm_edsd.regeneration", "vllm_edsd.serving",
              "vllm_edsd.serving.features", "vllm_edsd.features", "vllm_edsd.training", "vllm_edsd.conversion",
              "vllm_edsd.pipeline", "vllm_edsd.demo"},
}


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def owning_module(name: str) -> str | None:
    """The module of ours that ``name`` (a module or a name inside one) refers to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.split(":", 1)[0]
            if name in MODULES:  # importlib.import_module("...") tables, "module:Class" registrations
                found.add(name)
    ours = {owning_module(name) for name in found if name.split(".")[0] in PACKAGES}
    return {name for name in ours if name and name != module}


GRAPH = {module: imports_of(module, path) for module, path in MODULES.items()}


def room_of(module: str) -> str | None:
    candidates = [room for room in ROOMS if module == room or module.startswith(room + ".")]
    return max(candidates, key=len, default=None)


def test_every_module_has_a_room():
    assert [m for m in MODULES if room_of(m) is None] == []


def test_the_room_table_is_acyclic():
    seen: dict[str, int] = {}

    def visit(room: str, trail: tuple[str, ...]) -> None:
        assert room not in trail, f"rooms depend on each other in a circle: {' -> '.join((*trail, room))}"
        if seen.get(room):
            return
        for lower in ROOMS[room]:
            visit(lower, (*trail, room))
        seen[room] = 1

    for room in ROOMS:
        visit(room, ())


def test_no_import_goes_against_the_rooms():
    wrong = []
    for module, imported in GRAPH.items():
        room = room_of(module)
        for other in sorted(imported):
            other_room = room_of(other)
            if other_room != room and other_room not in ROOMS[room]:
                wrong.append(f"{module} ({room}) imports {other} ({other_room})")
    assert wrong == [], "imports the room table (ROOMS, above) does not allow:\n" + "\n".join(wrong)


def test_no_import_circles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strongly_connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                strongly_connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            strongly_connect(module)
    assert circles == [], f"import circles: {circles}"


def test_the_graph_sees_function_level_and_string_imports():
    """The reader itself: a lazy import and an importlib table are edges."""
    assert "vllm_edsd.serving.plugin" in GRAPH["vllm_edsd"]  # inside register()
    assert "vllm_edsd.demo.build" in GRAPH["vllm_edsd.cli"]  # the subcommand table
    assert "vllm_edsd.methods.edsd.vllm_model" in GRAPH["vllm_edsd.methods.edsd"]  # "module:Class"


def test_the_package_does_not_import_its_entries_or_the_tests():
    for module, imported in GRAPH.items():
        if module.startswith("vllm_edsd"):
            assert not {m for m in imported if m.split(".")[0] in ("weights_convert", "bench")}, module
    text = "\n".join(path.read_text() for module, path in MODULES.items() if module.startswith("vllm_edsd"))
    assert "support.toy" not in text and "toy_corpus" not in text


# A function longer than this does several things: give each a name of its own.
MAX_FUNCTION_LINES = 60
# A module longer than this holds more than one subject: give each a module of its own.
MAX_MODULE_LINES = 400
# Both limits hold for the scripts and the tests too.
SIZE_CHECKED = [*MODULES.values(), *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]


def function_lengths(tree: ast.AST) -> Iterator[tuple[str, int, int]]:
    """(qualified name, ``def`` line, lines from the ``def`` to the body's end) of every function
    and method in ``tree``, nested ones too; decorators do not count."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from visit(child, name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def test_function_length_runs_from_def_to_the_end_of_the_body():
    source = "@cache\n@wraps(g)\ndef f():\n    x = 1\n\n    return x\nclass C:\n    def m(self):\n        pass\n"
    assert list(function_lengths(ast.parse(source))) == [("f", 3, 4), ("C.m", 8, 2)]


def test_no_module_is_longer_than_the_limit():
    too_long = [f"{path.relative_to(ROOT)}: {lines} lines" for path in SIZE_CHECKED
                if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert too_long == [], f"modules over {MAX_MODULE_LINES} lines (split them by subject):\n" + "\n".join(too_long)


def test_no_function_is_longer_than_the_limit():
    too_long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in SIZE_CHECKED
        for name, line, length in function_lengths(ast.parse(path.read_text(), str(path)))
        if length > MAX_FUNCTION_LINES
    ]
    assert too_long == [], f"functions over {MAX_FUNCTION_LINES} lines (split them into named parts):\n" + "\n".join(
        too_long
    )


# Standard modules Python 3.10 (pyproject's requires-python) lacks, each with its fallback.
NEW_IN_PYTHON_3_11 = {"tomllib": "tomli"}
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError")


def imported_modules(node: ast.AST) -> set[str]:
    """The top-level modules an import statement names (none for a relative import)."""
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom) and not node.level:
        return {(node.module or "").split(".")[0]}
    return set()


def unguarded_imports(path: Path, modules: set[str]) -> list[int]:
    """Lines of ``path`` that import one of ``modules`` outside a ``try`` that handles ImportError."""
    tree = ast.parse(path.read_text(), str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(handler.type, ast.Name) and handler.type.id in IMPORT_ERRORS for handler in node.handlers):
            guarded.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return [node.lineno for node in ast.walk(tree) if imported_modules(node) & modules and id(node) not in guarded]


def test_modules_new_in_python_3_11_are_imported_with_their_fallback():
    """Python 3.10 is supported: ``tomllib`` is imported only inside a ``try`` that falls back
    on ImportError, and its fallback (``tomli``) is a dependency on 3.10; the tests, scripts
    and bench included."""
    files = [path for folder in (*PACKAGES, "tests", "scripts") for path in sorted((ROOT / folder).rglob("*.py"))]
    unguarded = [f"{path.relative_to(ROOT)}:{line}" for path in files
                 for line in unguarded_imports(path, set(NEW_IN_PYTHON_3_11))]
    assert unguarded == [], f"imported without a fallback for Python 3.10: {unguarded}"
    requirements = (ROOT / "pyproject.toml").read_text().splitlines()
    for fallback in NEW_IN_PYTHON_3_11.values():
        assert any(line.strip().startswith(f'"{fallback}') and "python_version < '3.11'" in line
                   for line in requirements), f"pyproject.toml: no {fallback} requirement for Python 3.10"


# The one module where a drafting method's name is written; everything else reads the registry.
METHOD_NAMES_MODULE = "vllm_edsd.methods.registry"


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, owners) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def method_name_literals(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a string constant is exactly a method's name: docstrings aside, and the
    ``prog`` of the ``edsd`` command, which is named like the method it serves."""
    skip = docstring_nodes(tree)
    skip |= {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "prog"}
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip)


def test_method_names_are_written_only_in_the_registry():
    from vllm_edsd.methods import METHODS
    from vllm_edsd.methods.registry import VLLM_EAGLE3

    names = set(METHODS) | {VLLM_EAGLE3}
    found = [f"{MODULES[module].relative_to(ROOT)}:{line}"
             for module in MODULES if module != METHOD_NAMES_MODULE
             for line in method_name_literals(ast.parse(MODULES[module].read_text()), names)]
    assert found == [], "method names as literals outside the registry (use vllm_edsd.methods):\n" + "\n".join(found)


def test_the_literal_finder_sees_literals_and_skips_docstrings():
    tree = ast.parse('"""edsd"""\ndef f():\n    """eagle3"""\n    return {"edsd": 1}\nparser(prog="edsd")\n')
    assert method_name_literals(tree, {"edsd", "eagle3"}) == [4]


# The stages of the data flow, in its order (docs/architecture.md, "Data flow").
FLOW = ("vllm_edsd.selection", "vllm_edsd.regeneration", "vllm_edsd.features", "vllm_edsd.training",
        "vllm_edsd.conversion", "vllm_edsd.serving", "bench")


def documented_rooms() -> dict[str, set[str]]:
    """docs/architecture.md's rooms table, room -> what it may import, in the table's order."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]

    def full(name: str) -> str:
        name = name.strip().strip("`").rstrip("/")
        return "vllm_edsd" if name == "the package" else name if name.split(".")[0] in PACKAGES else f"vllm_edsd.{name}"

    rooms = {}
    for first, _what, imports in rows:
        allowed = set() if imports.strip(" |") == "—" else {full(n) for n in imports.strip(" |").split(",")}
        for room in re.findall(r"`([^`]+)`", first):
            rooms[full(room)] = allowed
    return rooms


def test_the_documented_rooms_are_the_rooms_in_data_flow_order():
    documented = documented_rooms()
    assert documented == ROOMS, "docs/architecture.md's rooms table and ROOMS differ"
    assert list(documented) == list(ROOMS), "docs/architecture.md lists the rooms in another order than ROOMS"
    order = list(ROOMS)
    assert [order.index(room) for room in FLOW] == sorted(order.index(room) for room in FLOW)
