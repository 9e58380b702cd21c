"""What the demo reports: its dtype, where a reply differs, and shipped assets without machine paths."""

from __future__ import annotations

import json


def test_demo_names_its_dtype_and_where_a_reply_differs():
    from vllm_edsd.demo.cli import DEMO_DTYPE, summary
    from vllm_edsd.launch.engine import SpecCounters

    counters = SpecCounters(drafts=4, draft_tokens=16, accepted=8, accepted_per_pos=[4, 2, 1, 1])
    plain = {"texts": ["a"] * 4, "token_ids": [[1, 2, 3, 4]] * 4, "tokens_per_s": 10.0, "counters": None,
             "margins": [[5.0, 4.0, 0.0123, 2.0]] * 4}
    drafted = {**plain, "token_ids": [[1, 2, 9, 4]] + [[1, 2, 3, 4]] * 3, "tokens_per_s": 20.0, "counters": counters,
               "margins": None}
    text = summary({"none": plain, "edsd": drafted}, 4)
    assert DEMO_DTYPE == "float32" and "float32, K=4" in text
    assert "float32, eager (no torch.compile), K=4" in summary({"none": plain, "edsd": drafted}, 4, eager=True)
    assert "3/4" in text
    assert (
        "edsd: prompt 1 differs from the target alone first at token 2; the target's top-2 logit margin there is 0.0123"
        in text
    )


def test_demo_takes_the_median_round_and_counts_a_reply_that_changed_between_rounds():
    """Each method sends the prompts ROUNDS times; its tokens/s is the median round's, and a
    greedy reply that a later round changed is not 'same text', with a line saying so."""
    from vllm_edsd.demo.cli import ROUNDS, _result, summary
    from vllm_edsd.launch.engine import SpecCounters

    assert ROUNDS == 3
    counters = SpecCounters(drafts=4, draft_tokens=16, accepted=8, accepted_per_pos=[4, 2, 1, 1])
    replies = [{"text": "a", "token_ids": [1, 2, 3, 4]} for _ in range(4)]
    changed = [*replies[:2], {"text": "b", "token_ids": [1, 2, 3, 5]}, replies[3]]
    plain = _result([replies] * 3, [10.0, 30.0, 11.0], None, [[5.0] * 4] * 4)
    drafted = _result([replies, changed, replies], [20.0, 25.0, 40.0], counters, None)
    assert (plain["tokens_per_s"], drafted["tokens_per_s"]) == (11.0, 25.0)
    assert plain["unstable"] == [] and drafted["unstable"] == [2]
    text = summary({"none": plain, "edsd": drafted}, 4)
    assert "3/4" in text and "edsd: prompt 3's greedy reply changed between rounds" in text
    assert "sent 3 times; tokens/s: the median round's" in text
    assert "tokens/s per round: none 10.0 30.0 11.0; edsd 20.0 25.0 40.0" in text


def test_shipped_assets_record_no_machine_paths():
    from vllm_edsd.demo import ASSETS

    def strings(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)
        elif isinstance(value, str):
            yield value

    for file in (ASSETS / "edsd" / "config.json", ASSETS / "eagle3" / "config.json", ASSETS / "layers.json"):
        absolute = [s for s in strings(json.loads(file.read_text())) if s.startswith(("/", "~")) or ":\\" in s]
        assert not absolute, (file, absolute)
