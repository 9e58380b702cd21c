"""The plugin given a bad drafter or bad serving settings: one clear line before any engine starts;
the adaptive draft length's settings come from the speculative config alone and reach the workers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from support.drafters import edited_copy, engine_config
from support.drafters import edsd_spec as spec

from vllm_edsd.errors import EDSDError
from vllm_edsd.serving.features.draft_length import CONFIG_ATTRIBUTE, AdaptiveDraftLength

BIG = 10**9


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t["d2t"].__setitem__(5, BIG),
            f"maps draft id 5 to target id 5 + d2t[5] = 5 + {BIG}, outside the target vocabulary 0..511",
        ),
        (lambda t: t["d2t"].__setitem__(0, -1), "maps draft id 0 to target id 0 + d2t[0] = 0 + -1"),
        (lambda t: t["t2d"].__setitem__(slice(None), t["t2d"].roll(1)), "'d2t' and 't2d' disagree"),
    ],
)
def test_plugin_preflight_range_checks_d2t_and_t2d(models, tmp_path, edit, expected):
    drafter = edited_copy(models["llama-edsd"], tmp_path / "drafter", edit_tensors=edit)
    with pytest.raises(EDSDError, match="d2t") as err:
        engine_config(models["llama"], spec(drafter))
    assert expected in str(err.value)


def test_checkpoint_cannot_switch_adaptive_drafting_on(models, tmp_path):
    drafter = edited_copy(models["llama-edsd"], tmp_path / "drafter",
                          edit_config=lambda c: c.update(edsd_adaptive_draft={"threshold": 0}))
    with pytest.raises(EDSDError, match="key 'edsd_adaptive_draft' is a serving option"):
        engine_config(models["llama"], spec(drafter))


def test_a_config_json_value_never_reaches_the_worker(models, tmp_path):
    """Under "method": "eagle3" the plugin does not check the drafter, and vLLM puts every
    config.json key on the hf_config: the worker must still see no adaptive settings."""
    drafter = edited_copy(models["llama-edsd"], tmp_path / "drafter",
                          edit_config=lambda c: c.update(edsd_adaptive_draft={"threshold": 0.5}))
    config = engine_config(models["llama"], {**spec(drafter), "method": "eagle3"})
    hf_config = config.speculative_config.draft_model_config.hf_config
    assert getattr(hf_config, CONFIG_ATTRIBUTE) == {"threshold": 0.5}
    assert AdaptiveDraftLength.of(hf_config) is None


def test_the_plugins_settings_survive_the_trip_to_the_workers(models):
    """What the plugin sets does reach the workers (pickled), and the config still hashes (JSON)."""
    import copy
    import pickle

    config = engine_config(models["llama"], spec(models["llama-edsd"], adaptive_draft_length=True,
                                                 adaptive_draft_threshold=0.25))
    hf_config = config.speculative_config.draft_model_config.hf_config
    for carried in (pickle.loads(pickle.dumps(hf_config)), copy.deepcopy(hf_config)):
        assert AdaptiveDraftLength.of(carried) == AdaptiveDraftLength(0.25)
    assert json.loads(hf_config.to_json_string())[CONFIG_ATTRIBUTE] == {"threshold": 0.25}


@pytest.mark.parametrize("threshold", [0, 7, -1, float("nan"), "0.5", True])
def test_threshold_is_validated_wherever_settings_are_made(threshold):
    with pytest.raises(EDSDError, match="a number between 0 and 1"):
        AdaptiveDraftLength(threshold)


def test_mistyped_drafter_path_is_one_line_with_the_absolute_path(models, tmp_path, monkeypatch):
    """``runs/edsd-typo`` without a ``runs/`` here looks like a hub id; with no hub reachable
    (or no such repository) the error still names the local directory tried."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(EDSDError, match=f"no such local directory: {tmp_path}/runs/edsd-typo, and the model hub"):
        engine_config(models["llama"], spec("runs/edsd-typo"))


def test_adaptive_attach_is_idempotent(models):
    from torch import nn

    from vllm_edsd.methods.edsd.vllm_model import EDSDLlamaForCausalLM
    from vllm_edsd.serving.features.draft_length import CONFIG_ATTRIBUTE, DraftLengthLimiter, limiter_of
    from vllm_edsd.serving.hooks import attach

    model = EDSDLlamaForCausalLM.__new__(EDSDLlamaForCausalLM)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(**{CONFIG_ATTRIBUTE: AdaptiveDraftLength(0.2).as_dict()})
    model.last_draft_entropy = None

    def propose(*args, **kwargs):
        return "drafts"

    proposer = SimpleNamespace(model=model, propose=propose, _sample_draft_tokens=lambda h, m: (h, None),
                               vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                                                           speculative_config=SimpleNamespace(prompt_lookup_min=0,
                                                                                              prompt_lookup_max=0)))
    attach(proposer)
    hook = proposer.propose
    attach(proposer)
    assert proposer.propose == hook and isinstance(hook.__self__, DraftLengthLimiter)
    assert limiter_of(proposer) is hook.__self__
    assert hook.__self__._propose is propose
    assert model.record_draft_entropy  # the adaptive rule switched the drafter's entropy record on


def test_adaptive_length_without_the_drafters_entropy_is_a_clear_error():
    """The adaptive rule reads the entropy the drafter recorded for the step's rows; a missing or
    stale record is refused by an explicit check that ``python -O`` keeps."""
    from torch import nn

    from vllm_edsd.methods.edsd.vllm_model import EDSDLlamaForCausalLM
    from vllm_edsd.serving.features.draft_length import DraftLengthLimiter

    model = EDSDLlamaForCausalLM.__new__(EDSDLlamaForCausalLM)
    nn.Module.__init__(model)
    model.last_draft_entropy = None
    tokens = torch.tensor([5, 6, 7])
    proposer = SimpleNamespace(model=model, propose=lambda: None, _sample_draft_tokens=lambda h, m: (tokens, None))
    limiter = DraftLengthLimiter(proposer, model, AdaptiveDraftLength(0.2), data_parallel=False)
    with pytest.raises(RuntimeError, match="entropy for the 3 rows of this draft step, but the drafter recorded none"):
        limiter.sample_draft_tokens(torch.zeros(3, 8), None)
    model.last_draft_entropy = torch.zeros(2)  # a stale record of another batch
    with pytest.raises(RuntimeError, match="recorded 2 rows"):
        limiter.sample_draft_tokens(torch.zeros(3, 8), None)
    model.last_draft_entropy = torch.tensor([0.1, 2.0, 0.1])  # the middle row above -ln(0.2)
    assert limiter.sample_draft_tokens(torch.zeros(3, 8), None)[0] is tokens
    assert limiter.lengths.tolist() == [1, 0, 1]
