"""The drafters' config schemas are declarative: every field of ``DraftConfig``, ``EDSDConfig``
and ``Speculators`` says in its metadata how config.json writes it and what it is, and the one
walker (``checkpoint/schema.py``) reads a file's fields in their declared order."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_edsd.checkpoint.schema import ENTRY, read_fields
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.draft_config import DraftConfig
from vllm_edsd.methods.edsd.config import EDSDConfig, Speculators


@pytest.mark.parametrize("schema", [DraftConfig, EDSDConfig, Speculators], ids=lambda s: s.__name__)
def test_every_field_has_an_entry_with_a_one_line_doc(schema):
    for spec in dataclasses.fields(schema):
        entry = spec.metadata.get(ENTRY)
        assert entry is not None, f"{schema.__name__}.{spec.name} has no entry"
        assert entry.doc and "\n" not in entry.doc, f"{schema.__name__}.{spec.name}: a one-line doc"


def test_the_edsd_fields_follow_the_draft_layer_fields():
    names = [spec.name for spec in dataclasses.fields(EDSDConfig)]
    base = [spec.name for spec in dataclasses.fields(DraftConfig)]
    assert names[: len(base)] == base


def test_a_file_s_first_problem_in_field_order_is_the_one_reported():
    raw = {"hidden_size": 0, "num_attention_heads": "x"}
    with pytest.raises(EDSDError, match=r"^f: field 'hidden_size' must be a positive integer, got 0$"):
        read_fields(DraftConfig, raw, "f")
    with pytest.raises(EDSDError, match=r"^f: missing field 'vocab_size'$"):
        read_fields(DraftConfig, {"hidden_size": 8, "num_attention_heads": 2}, "f")
