"""Changes to vLLM's objects in the code of vllm_edsd/ and weights_convert/, found by reading it
with ``ast`` (nothing is imported), for tests/unit/test_serving_patches.py. What the reader takes for
a vLLM object:

* a name imported from ``vllm`` (a module, a class, a function);
* ``self`` and ``super()`` in the methods of a class derived from such a name;
* ``self`` in a function that is not a method: the replacement of a vLLM method;
* a parameter named as vLLM's objects are named here (``VLLM_PARAMETERS``);
* whatever is reached from one: its attributes, items and the results of its methods, and the
  local names and ``self`` attributes assigned from one.

What counts as a change, found once per name and function:

* assigning, deleting or ``setattr`` an attribute of a vLLM object; the methods of a class
  derived from vLLM's may set public attributes on ``self`` (its own state);
* reading a private name (``_x``, not a dunder) from a vLLM object, by ``getattr``/``hasattr``
  too. In a class derived from vLLM's, that is every private name on ``self`` or ``super()``
  and every private method it defines: an override of vLLM's private name cannot be told from
  a name of the class's own without vLLM's source, so such a class keeps its own names public;
* ``os.environ[NAME] = ...``, ``os.environ.setdefault``/``update``, ``os.putenv`` of a ``VLLM_*``
  variable, or of a name the reader cannot resolve.

Names are resolved through string constants (``LIMITER_ATTRIBUTE``,
``draft_length.CONFIG_ATTRIBUTE``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_edsd", "weights_convert")
# Parameters that hold vLLM's objects wherever this package uses the name.
VLLM_PARAMETERS = frozenset({"proposer", "runner", "vllm_config", "speculative_config", "hf_config", "llm"})


@dataclass(frozen=True)
class Change:
    place: str  # "path/of/module.py:qualified.function"
    name: str  # the attribute or environment variable
    how: str
    line: int


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_nodes(node: ast.AST):
    """The nodes of a function or module, without those of the functions and classes inside it."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from own_nodes(child)


def assigned_pairs(node: ast.AST):
    """(target, value) of an assignment, tuples unpacked pairwise."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return
    for target in targets:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            yield from zip(target.elts, value.elts)
        else:
            yield target, value


def string_constants(tree: ast.Module) -> dict[str, str]:
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


class Reader(ast.NodeVisitor):
    """The changes to vLLM's objects in one module's source (the rules: the module docstring)."""

    def __init__(self, place: str, source: str, constants_of=lambda module: {}) -> None:
        self.place, self.tree, self.constants_of = place, ast.parse(source), constants_of
        self.constants = string_constants(self.tree)
        self.vllm: set[str] = set()
        self.modules: dict[str, str] = {}  # alias -> a module of ours
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._imported(node)
        self.scope: list[str] = []
        self.names: set[str] = set()  # local names that hold vLLM objects
        self.self_attributes: set[str] = set()  # attributes of a class's self that hold vLLM objects
        self.in_vllm_class = False
        self.changes: dict[tuple[str, str], Change] = {}

    def _imported(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    self.vllm.add(alias.asname or alias.name.split(".")[0])
                elif alias.asname:
                    self.modules[alias.asname] = alias.name
            return
        base = node.module or ""
        for alias in node.names:
            if base.split(".")[0] == "vllm":
                self.vllm.add(alias.asname or alias.name)
            elif base.split(".")[0] in PACKAGES:
                self.modules[alias.asname or alias.name] = f"{base}.{alias.name}"
                if alias.name in self.constants_of(base):
                    self.constants.setdefault(alias.asname or alias.name, self.constants_of(base)[alias.name])

    def run(self) -> list[Change]:
        self.visit(self.tree)
        return list(self.changes.values())

    def resolve(self, node: ast.AST) -> str:
        """The string an expression names, or its source where it is not a known constant."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.constants[node.id]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.modules:
            return self.constants_of(self.modules[node.value.id]).get(node.attr, ast.unparse(node))
        return ast.unparse(node)

    def is_vllm(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names or node.id in self.vllm
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.self_attributes:
                return True
            return self.is_vllm(node.value)
        if isinstance(node, ast.Subscript):
            return self.is_vllm(node.value)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "super":
                return self.in_vllm_class
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
                return self.is_vllm(node.args[0])
            return self.is_vllm(node.func)
        return False

    def found(self, node: ast.AST, name: str, how: str) -> None:
        place = f"{self.place}:{'.'.join(self.scope) or '<module>'}"
        self.changes.setdefault((place, name), Change(place, name, how, node.lineno))

    # ----------------------------------------------------------------- scopes

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = (self.in_vllm_class, self.self_attributes, self.names)
        self.in_vllm_class = any(self.is_vllm(base) for base in node.bases)
        self.self_attributes, self.names = set(), set()
        self.scope.append(node.name)
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for _ in range(2):  # self attributes assigned from vLLM objects, in any method
            for method in methods:
                self.names = self._local_names(method, set(), is_method=True)
                self.self_attributes |= {target.attr for n in own_nodes(method) for target, value in assigned_pairs(n)
                                         if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                         and target.value.id == "self" and self.is_vllm(value)}
        self.names = set()
        for child in node.body:
            if child in methods:
                self._function(child, is_method=True)
            else:
                self.visit(child)
        self.scope.pop()
        self.in_vllm_class, self.self_attributes, self.names = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, is_method=False)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _function(self, node: ast.FunctionDef, is_method: bool) -> None:
        outer = (self.names, self.in_vllm_class, self.self_attributes)
        if not is_method and node.args.args[:1] and node.args.args[0].arg == "self":
            self.in_vllm_class, self.self_attributes = False, set()  # a replacement: self is vLLM's own
        self.names = self._local_names(node, self.names, is_method)
        self.scope.append(node.name)
        if is_method and self.in_vllm_class and is_private(node.name):
            self.found(node, node.name, "defines")
        for child in node.body:
            self.visit(child)
        self.scope.pop()
        self.names, self.in_vllm_class, self.self_attributes = outer

    def _local_names(self, node: ast.FunctionDef, inherited: set[str], is_method: bool) -> set[str]:
        arguments = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
        names = {*inherited, *(a for a in arguments if a in VLLM_PARAMETERS)} - ({"self"} if is_method else set())
        if arguments[:1] == ["self"] and (self.in_vllm_class if is_method else True):
            names.add("self")
        saved, self.names = self.names, names
        for _ in range(3):  # names assigned from names assigned from vLLM objects...
            names |= {target.id for n in own_nodes(node) for target, value in assigned_pairs(n)
                      if isinstance(target, ast.Name) and self.is_vllm(value)}
        self.names = saved
        return names

    # ----------------------------------------------------------------- changes

    def _assigned(self, target: ast.AST, how: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._assigned(element, how)
        elif isinstance(target, ast.Attribute) and self.is_vllm(target.value):
            own_state = (self.in_vllm_class and isinstance(target.value, ast.Name) and target.value.id == "self"
                         and not is_private(target.attr))
            if not own_state:
                self.found(target, target.attr, how)
        elif isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ":
            self._environment(target, target.slice)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._assigned(target, "assigns")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign | ast.AnnAssign) -> None:
        self._assigned(node.target, "assigns")
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._assigned(target, "deletes")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and is_private(node.attr) and self.is_vllm(node.value):
            self.found(node, node.attr, "reads")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = ast.unparse(node.func)
        if function in ("setattr", "delattr", "getattr", "hasattr") and len(node.args) >= 2 \
                and self.is_vllm(node.args[0]):
            name = self.resolve(node.args[1])
            if function in ("setattr", "delattr") or is_private(name):
                self.found(node, name, function)
        elif function in ("os.environ.setdefault", "os.putenv") and node.args:
            self._environment(node, node.args[0])
        elif function == "os.environ.update":
            keys = node.args[0].keys if node.args and isinstance(node.args[0], ast.Dict) else [None]
            for key in [*keys, *(ast.Constant(k.arg) for k in node.keywords if k.arg)]:
                self._environment(node, key)
        self.generic_visit(node)

    def _environment(self, node: ast.AST, key: ast.AST | None) -> None:
        name = "**" if key is None else self.resolve(key)
        if name.startswith("VLLM_") or not re.fullmatch(r"[A-Z0-9_]+", name):
            self.found(node, name, "sets the environment variable")


def module_paths() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_of(path): path for path in module_paths()}
CONSTANTS = {module: string_constants(ast.parse(path.read_text())) for module, path in SOURCES.items()}


def changes_in(path: Path) -> list[Change]:
    return Reader(path.relative_to(ROOT).as_posix(), path.read_text(), lambda m: CONSTANTS.get(m, {})).run()


CHANGES = [change for path in module_paths() for change in changes_in(path)]
