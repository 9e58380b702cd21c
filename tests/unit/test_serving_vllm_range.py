"""scripts/check_vllm_range.py's source reader on a tiny vLLM-shaped tree written here (no network):
a method found with its signature, a missing one, an inherited one, a changed signature, a
subclass a replacement would miss, a hook on the class vLLM instantiates, an attribute vLLM's
code sets, an environment variable, a row whose versions and run-time condition disagree; and
the plugin's side of the range: every row of PATCHES has a check, no name is both a row and
read, the drafter sets what vLLM's EAGLE-3 constructor would, and the ``"edsd"`` alias leaves
every other method to vLLM."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_edsd.serving.patches import PATCHES
from vllm_edsd.serving.patching import CONFIG, ENVIRONMENT, EXCEPTION, INSTANCE_HOOK, OVERRIDE, PRIVATE, Patch
from vllm_edsd.serving.vllm_names import EAGLE3_ATTRIBUTES, READ, VllmName, expected

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("check_vllm_range", ROOT / "scripts" / "check_vllm_range.py")
check = importlib.util.module_from_spec(_SPEC)
sys.modules["check_vllm_range"] = check
_SPEC.loader.exec_module(check)

MODULES = {
    "vllm/__init__.py": """
        MODULE_ATTRS = {"Runner": ".worker.runner:Runner"}

        def __getattr__(name):
            if name == "current_platform":
                return None
    """,
    "vllm/envs.py": """
        environment_variables = {"VLLM_X": lambda: 0}
    """,
    "vllm/worker/__init__.py": "",
    "vllm/worker/base.py": """
        from dataclasses import dataclass
        from typing import Literal

        Extra = Literal["c"]
        Kinds = Literal["a", "b", Extra]

        class Base:
            def __init__(self, config):
                self.config = config
                self.config.size = 0
                self._cache = None

            def step(self, batch, sampling):
                return batch

            def load(self, model):
                pass

        @dataclass
        class Settings:
            name: str
            size: int = 0
    """,
    "vllm/worker/runner.py": """
        from vllm.worker.base import Base

        class Runner(Base):
            def step(self, batch, sampling, *, draft=None):
                return super().step(batch, sampling)

            def load(self, model):
                return model

            def run(self, requests, k=1):
                self.drafter = None
    """,
}


@pytest.fixture
def tree(tmp_path):
    for name, source in MODULES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return check.SourceTree(tmp_path)


def judged(tree, owner, name, signature=None, **fields):
    return check.judge(tree, VllmName(owner, name, "test", signature, **fields))


def test_a_method_with_the_expected_signature(tree):
    assert judged(tree, "vllm.worker.runner:Runner", "run", "self, requests, k").status == check.OK
    assert judged(tree, "vllm.worker.runner:Runner", "run", "self, requests, ...").status == check.OK
    assert judged(tree, "vllm.worker.runner:Runner", "drafter").status == check.OK  # assigned to self


def test_a_missing_method_is_broken_unless_optional(tree):
    cell = judged(tree, "vllm.worker.runner:Runner", "propose")
    assert cell.status == check.BROKEN and "Runner has no propose" in cell.reason
    cell = judged(tree, "vllm.worker.runner:Runner", "propose", optional="the plugin goes without")
    assert cell.status == check.ABSENT and "the plugin goes without" in cell.reason
    assert judged(tree, "vllm.worker.gone", "x").reason == "no module vllm.worker.gone"


def test_an_inherited_method_is_found_in_the_base_class(tree):
    found, _, _ = check.resolve(tree, VllmName("vllm.worker.runner:Runner", "_cache", ""))
    assert found.owner == "vllm.worker.base:Base"
    assert judged(tree, "vllm.worker.runner:Runner", "__init__", "self, config").status == check.OK
    assert judged(tree, "vllm:Runner", "config").status == check.OK  # through vllm/__init__.py's lazy table


def test_a_changed_signature_is_broken(tree):
    cell = judged(tree, "vllm.worker.runner:Runner", "step", "self, batch, sampling")
    assert cell.status == check.BROKEN and "(self, batch, sampling, draft)" in cell.reason
    cell = judged(tree, "vllm.worker.runner:Runner", "run", "self, requests, ..., temperature")
    assert cell.status == check.BROKEN and "lacks temperature" in cell.reason


def test_a_dataclass_init_has_its_fields_as_parameters(tree):
    assert judged(tree, "vllm.worker.base:Settings", "", "self, name, size").status == check.OK


def test_literal_members_absent_names_and_lazy_module_names(tree):
    assert judged(tree, "vllm.worker.base:Kinds", "c").status == check.OK
    assert judged(tree, "vllm.worker.base:Kinds", "edsd", absent=True).status == check.OK
    assert judged(tree, "vllm.worker.base:Kinds", "a", absent=True).status == check.BROKEN
    assert judged(tree, "vllm:current_platform", "").status == check.OK


def test_a_replacement_must_reach_the_subclasses_vllm_uses(tree):
    inherits_or_calls_super = judged(tree, "vllm.worker.base:Base", "step", "self, ...", reaches=("vllm:Runner",))
    assert inherits_or_calls_super.status == check.OK
    cell = judged(tree, "vllm.worker.base:Base", "load", "self, model", reaches=("vllm.worker.runner:Runner",))
    assert cell.status == check.BROKEN and "overrides load without calling super()" in cell.reason


def test_the_newest_final_patch_release_of_each_minor_is_read():
    def sdist(yanked=False):
        return [{"packagetype": "sdist", "url": "../../packages/x.tar.gz", "yanked": yanked, "size": 1,
                 "digests": {"sha256": "0"}}]

    listing = {"releases": {"0.23.9": sdist(), "0.24.0": sdist(), "0.24.1": sdist(), "0.24.2": sdist(yanked=True),
                            "0.25.0rc1": sdist(), "0.25.0": sdist(), "0.34.0": sdist()}}
    chosen = check.releases_from_listing(listing, None)
    assert [r.version for r in chosen] == ["0.24.1", "0.25.0"]
    assert chosen[0].url == "https://pypi.org/packages/x.tar.gz"  # relative to PyPI's JSON, as PyPI gives it


def test_every_patch_has_its_expected_shape_recorded():
    unchecked = [f"{row.kind} {row.label}" for row in check.rows() if row.entry is None]
    assert unchecked == [], "add each row's entry to vllm_names.PATCHED"


def made_by(kind, owner="vllm.worker.runner:Runner", attribute="_cache"):
    return Patch.made_by(kind, owner, attribute, "test", where=("vllm_edsd/x.py:f",), when="test")


def test_a_row_is_checked_from_itself_only_where_its_kind_says_all():
    """A replacement, a hook, an override or a config attribute needs what it expects recorded:
    a new such row has no check until PATCHED has its entry (and the test above fails)."""
    for kind in (INSTANCE_HOOK, OVERRIDE, CONFIG):
        assert expected(made_by(kind)) is None
    assert expected(Patch("vllm.worker.runner:Runner", "run", "test", lambda original: original)) is None
    assert expected(made_by(ENVIRONMENT, "vllm.envs", "VLLM_X")).owner == "vllm.envs:environment_variables"
    for kind in (PRIVATE, EXCEPTION):
        entry = expected(made_by(kind))
        assert (entry.owner, entry.name, entry.signature) == ("vllm.worker.runner:Runner", "_cache", None)


def test_no_vllm_name_is_both_a_row_and_read():
    rows = {(patch.owner, patch.attribute) for patch in PATCHES}
    rows |= {(entry.owner, entry.name) for entry in map(expected, PATCHES) if entry is not None}
    assert [f"{e.owner}.{e.name}" for e in READ if (e.owner, e.name) in rows] == []


def test_a_hook_is_checked_on_the_class_vllm_instantiates(tree):
    cell = judged(tree, "vllm.worker.base:Base", "step", "self, batch, sampling", used_as=("vllm:Runner",))
    assert cell.status == check.BROKEN and cell.reason.startswith("on vllm:Runner: signature")
    assert judged(tree, "vllm.worker.base:Base", "load", "self, model", used_as=("vllm:Runner",)).status == check.OK


def test_config_attributes_environment_variables_and_rows_with_nothing_to_check(tree):
    assert judged(tree, "vllm:Config.hf", "size", set_by="vllm.worker.base:Base.__init__").status == check.OK
    cell = judged(tree, "vllm:Config.hf", "width", set_by="vllm.worker.base:Base.__init__")
    assert cell.status == check.BROKEN and "no longer sets width" in cell.reason
    assert judged(tree, "vllm.envs:environment_variables", "VLLM_X").status == check.OK
    assert judged(tree, "vllm.envs:environment_variables", "VLLM_Y").status == check.BROKEN
    cell = judged(tree, "vllm:Config.hf", "ours", not_checked="our own attribute")
    assert (cell.status, cell.reason) == (check.NOT_APPLICABLE, "our own attribute")


@pytest.mark.parametrize(("versions", "version", "status", "reason"), [
    ("0.24–0.30", "0.30.0", check.OK, ""),
    ("0.24–0.30", "0.31.0", check.BROKEN, "leave out"),
    ("0.31–0.33", "0.31.0", check.OK, ""),
    ("0.31–0.33", "0.30.0", check.BROKEN, "leave out"),
])
def test_a_rows_versions_must_agree_with_its_run_time_condition(tree, versions, version, status, reason):
    """The CPU kernel rows: the plugin picks one by a condition on vLLM (``applies_if``), which must
    hold in exactly the releases the row's ``versions`` claim. Here the condition holds in every
    release, so a row claiming fewer is broken outside its claim."""
    patch = Patch("vllm.worker.runner:Runner", "load", "test", lambda original: original, versions=versions)
    entry = VllmName(patch.owner, patch.attribute, "test", "self, model", applies_if="vllm.worker.runner:Runner.load")
    cell = check.cell_of(check.Row(entry.label, "PATCHES", entry, patch=patch), version, tree)
    assert cell.status == status and reason in cell.reason
    negated = check.Row(entry.label, "PATCHES", replace(entry, applies_if="!" + entry.applies_if), patch=patch)
    expected_there = check.NOT_APPLICABLE if status == check.BROKEN else check.BROKEN
    assert check.cell_of(negated, version, tree).status == expected_there


VLLM_METHODS = ("eagle", "eagle3", "dflash", "dspark", "mtp", "ngram", "ngram_gpu", "draft_model", "suffix",
                "custom_class", "extract_hidden_states", "EDSD", None)


def test_the_edsd_alias_leaves_every_other_method_to_vllm():
    pytest.importorskip("vllm")
    from vllm_edsd.serving.request import checked_speculative_init

    seen = []
    wrapped = checked_speculative_init(lambda _self, **kwargs: seen.append(kwargs))
    for method in VLLM_METHODS:
        wrapped(None, method=method, model="some/drafter", num_speculative_tokens=3)
    assert [kwargs["method"] for kwargs in seen] == list(VLLM_METHODS)


def test_the_drafter_sets_what_vllms_eagle3_init_would():
    """EDSDLlamaForCausalLM skips Eagle3LlamaForCausalLM.__init__ and sets its attributes itself:
    the script checks each release's __init__ against the recorded list, this checks ours."""
    tree = ast.parse((ROOT / "vllm_edsd" / "methods" / "edsd" / "vllm_model.py").read_text())
    drafter = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EDSDLlamaForCausalLM")
    init = next(n for n in drafter.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert set(EAGLE3_ATTRIBUTES) <= check.attributes_set(init)
