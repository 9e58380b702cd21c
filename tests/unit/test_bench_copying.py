"""The copying instrument (``python -m bench copying``): the bigram split on hand-made
token lists, drafters whose answers are known (one that copies perfectly, one that cannot)
measured through the instrument's own path, and the real EDSD and EAGLE-3 drafters run end to
end on a toy target."""

from __future__ import annotations

import json

import pytest
import torch
from support.toy import make_drafter, make_target, target_config
from torch import nn

from bench import copying
from bench.cli import main
from vllm_edsd.methods.blocks import DraftHead
from vllm_edsd.methods.eagle3.model import Eagle3DraftModel
from vllm_edsd.methods.edsd.config import EDSDConfig

# prompt 5 6 7, answer 5 6 8 5 6 7 9: the bigrams ending at 4, 7 and 8 occurred before
TOKENS = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9]
PROMPT_LENGTH = 3
VOCAB = 16


def test_the_bigram_split_on_hand_made_tokens():
    assert copying.copyable_positions(TOKENS) == [False] * 4 + [True, False, False, True, True, False]
    # what followed the last earlier occurrence of the previous token
    assert copying.last_occurrence_guesses(TOKENS) == [-1, -1, -1, -1, 6, 7, -1, 6, 8, 5]
    # an occurrence may overlap the bigram it predicts, as long as it lies within the context
    assert copying.copyable_positions([4, 4, 4]) == [False, False, True]
    assert copying.last_occurrence_guesses([4, 4, 4]) == [-1, -1, 4]
    assert copying.copyable_positions([]) == [False] and copying.copyable_positions([3, 3]) == [False, False]


def test_positions_are_the_answer_tokens_after_the_first():
    positions = copying.answer_positions(copying.Answer(PROMPT_LENGTH, TOKENS), steps=2)
    assert positions.first_row == PROMPT_LENGTH - 1  # row p predicts x_{p+2} first
    assert positions.truth[:, 0].tolist() == TOKENS[PROMPT_LENGTH + 1:]
    assert positions.truth[:, 1].tolist() == [*TOKENS[PROMPT_LENGTH + 2:], -1]  # the last row's second draft has none
    assert positions.copyable[:, 0].tolist() == [True, False, False, True, True, False]
    assert positions.rule_right[:, 0].tolist() == [True, False, False, True, False, False]


class Oracle(nn.Module):
    """A draft layer that knows the sequence: at each position it outputs the one-hot of the
    token ``chosen[j]`` for the index j it predicts. Its attention is that output (no residual)."""

    def __init__(self, chosen: list[int]) -> None:
        super().__init__()
        self.self_attn = OneHot(chosen)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions)


class OneHot(nn.Module):
    def __init__(self, chosen: list[int]) -> None:
        super().__init__()
        self.chosen = torch.tensor(chosen)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # step k at row p runs at position p + k and predicts x_{p+2+k}
        predicted = (positions + 2).clamp(max=len(self.chosen) - 1)
        return nn.functional.one_hot(self.chosen[predicted], VOCAB).float()


class OracleDrafter(DraftHead):
    """A stand-in drafter on ``DraftHead`` (its ``propose``, norm, head and vocabulary map): the
    LM head is the identity, so it drafts whatever its ``Oracle`` layer chose."""

    def __init__(self, chosen: list[int]) -> None:
        cfg = EDSDConfig(hidden_size=VOCAB, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=VOCAB, vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=4,
                         fuse_intermediate_size=8, aux_layer_ids=(0, 1))
        super().__init__(cfg, cfg.aux_layer_ids)
        self.midlayer = Oracle(chosen)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(VOCAB))

    def step(self, g, input_ids, positions, kv):
        a = self.midlayer(positions)
        return self.lm_head(self.norm(a)), a


def oracle(copies: bool) -> OracleDrafter:
    """Right exactly where the bigram can be copied (``copies``) or exactly where it cannot."""
    copyable = copying.copyable_positions(TOKENS)
    return OracleDrafter([token if can == copies else (token + 1) % VOCAB for token, can in zip(TOKENS, copyable)])


def measured(drafter: DraftHead, steps: int = 2) -> list[dict]:
    no_features = lambda answer, layers: torch.zeros(1, len(answer.tokens), 4 * len(layers))  # noqa: E731
    return copying.measure(drafter, [copying.Answer(PROMPT_LENGTH, TOKENS)], no_features, steps)


@pytest.mark.parametrize(("copies", "copyable", "other"), [(True, 1.0, 0.0), (False, 0.0, 1.0)])
def test_a_drafter_that_copies_perfectly_and_one_that_cannot(copies, copyable, other):
    steps = measured(oracle(copies))
    first = steps[0]
    assert first["copyable"]["positions"] == 3 and first["other"]["positions"] == 3 and first["all"]["positions"] == 6
    assert first["copyable"]["accuracy"] == copyable and first["other"]["accuracy"] == other
    assert first["all"]["accuracy"] == 0.5
    # the attention output is all the layer outputs, so read alone it drafts the same
    assert first["copyable"]["attention_accuracy"] == copyable and first["other"]["attention_accuracy"] == other
    assert first["copyable"]["rule_accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    assert first["state"] == {"rms_median": pytest.approx(VOCAB ** -0.5, rel=1e-3), "max_abs": 1.0}
    second = steps[1]  # five positions: the last row has no second token
    assert second["all"]["positions"] == 5
    assert second["copyable"]["accuracy"] == copyable and second["other"]["accuracy"] == other


def test_after_right_drafts_counts_only_the_chains_right_so_far():
    # The copier's first drafts are right at rows 2, 5 and 6 (answer indices 4, 7, 8); their
    # second drafts predict 5 (not copyable), 8 (copyable) and 9 (not): one in three is right.
    second = measured(oracle(True))[1]
    assert second["copyable"]["positions"] == 2 and second["other"]["positions"] == 3
    assert second["all"]["accuracy_after_right_drafts"] == pytest.approx(1 / 3, abs=1e-4)
    assert second["copyable"]["accuracy_after_right_drafts"] == 1.0
    assert second["other"]["accuracy_after_right_drafts"] == 0.0


@pytest.fixture(scope="module")
def toy_pair(tmp_path_factory):
    """A toy target, an EDSD drafter in vLLM's layout and an EAGLE-3 drafter in vLLM's, random."""
    root = tmp_path_factory.mktemp("copying")
    target = make_target(root / "target", num_layers=4)
    make_drafter(target, root / "edsd", aux_layer_ids=(1, 3), draft_vocab_size=256)
    cfg = EDSDConfig.for_target(target_config(target), (1, 2))
    torch.manual_seed(0)
    eagle3 = Eagle3DraftModel(cfg, (1, 2, 3))
    eagle3.save_pretrained(root / "eagle3")
    return {"target": str(target), "edsd": str(root / "edsd"), "eagle3": str(root / "eagle3"), "model": eagle3}


def test_an_eagle3_drafter_loads_as_it_was_saved(toy_pair):
    saved = toy_pair["model"]
    loaded = Eagle3DraftModel.from_pretrained(toy_pair["eagle3"], embed_tokens=saved.embed_tokens.weight)
    assert loaded.aux_layer_ids == (1, 2, 3)
    assert all(torch.equal(saved.state_dict()[name], tensor) for name, tensor in loaded.state_dict().items())


def test_the_instrument_end_to_end_on_a_toy_pair(toy_pair, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--target", toy_pair["target"], "--edsd", toy_pair["edsd"], "--eagle3", toy_pair["eagle3"],
            "--out", str(out), "--prompts-per-category", "1", "--max-tokens", "6", "--steps", "2"]
    assert main(["copying", *argv]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("python -m bench copying --target")
    assert results["answers"] == 5 and list(results["drafters"]) == ["edsd", "eagle3"]
    assert results["drafters"]["eagle3"]["aux_layer_ids"] == [1, 2, 3]
    for drafter in results["drafters"].values():
        first = drafter["steps"][0]
        assert first["copyable"]["positions"] + first["other"]["positions"] == first["all"]["positions"] > 0
        assert 0 <= first["all"]["accuracy"] <= 1 and first["state"]["rms_median"] > 0
    report = (out / "report.md").read_text()
    assert "| the next bigram already occurred earlier in the context |" in report and "| EAGLE-3 | 1 |" in report
    assert report in capsys.readouterr().out


def test_bad_input_is_one_clear_line(toy_pair, tmp_path, capsys):
    cases = {("--edsd", str(tmp_path / "missing")): "--edsd: ",
             ("--eagle3", toy_pair["edsd"]): "not an EAGLE-3 drafter",
             ("--steps", "0"): "--steps must be at least 1, got 0"}
    for (flag, value), message in cases.items():
        assert main(["copying", "--target", toy_pair["target"], flag, value, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and message in err
        assert err.strip().splitlines()[-1].startswith("bench copying: error: ")
    assert not (tmp_path / "out").exists()
