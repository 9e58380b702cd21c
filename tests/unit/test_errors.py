"""Bad speculative configs and bad drafters get one clear error naming the problem,
before any engine starts (vLLM's own config path, no mocks), and a process that
asked for them exits instead of hanging."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import edsd_spec as spec
from conftest import engine_config

from vllm_edsd.errors import EDSDError
from vllm_edsd.serving.adaptive import AdaptiveDraftLength, check_runner
from vllm_edsd.serving.plugin import version_supported


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("three_ids", "exactly two"),
        ("out_of_range", "do not exist in a target with 4 layers"),
        ("missing_tensor", "missing tensor(s): lm_head.weight"),
        ("wrong_shape", "tensor 'fc.weight' has shape [256, 100], expected [256, 512]"),
        ("other_target", "does not fit the target model"),
        ("no_weights", "no weights found"),
        ("no_config", "no config.json"),
        ("broken_json", "invalid JSON"),
        ("training_layout", "edsd convert"),
        ("missing_dir", "no such local directory"),
    ],
)
def test_bad_drafter_is_refused_with_a_clear_error(models, drafters, case, expected):
    with pytest.raises(EDSDError) as err:
        engine_config(models["llama"], spec(drafters[case]))
    assert expected in str(err.value)


@pytest.mark.vllm_range
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"bogus_field": 1}, "unknown field(s) 'bogus_field'"),
        ({"num_speculative_tokens": "four"}, "'num_speculative_tokens' must be a positive integer"),
        ({"num_speculative_tokens": 0}, "'num_speculative_tokens' must be a positive integer"),
        ({"draft_sample_method": "beam"}, "'draft_sample_method' must be one of"),
        ({"model": None}, "needs 'model'"),
        ({"adaptive_draft_length": "yes"}, "'adaptive_draft_length' must be true or false"),
        ({"adaptive_draft_threshold": 0.3}, "'adaptive_draft_threshold' needs \"adaptive_draft_length\": true"),
        *[({"adaptive_draft_length": True, "adaptive_draft_threshold": bad}, "a number between 0 and 1 (exclusive)")
          for bad in (0, 1, -0.5, 1.5, "0.3", True, float("nan"))],
    ],
)
def test_malformed_speculative_config(models, extra, expected):
    with pytest.raises(EDSDError) as err:
        engine_config(models["llama"], spec(models["llama-edsd"], **extra))
    assert expected in str(err.value)


def test_adaptive_fields_belong_to_edsd(models):
    with pytest.raises(
        EDSDError, match="'adaptive_draft_length' is an option of \"method\": \"edsd\", not of 'eagle3'"
    ):
        engine_config(
            models["llama"], {**spec(models["llama-edsd"]), "method": "eagle3", "adaptive_draft_length": True}
        )


@pytest.mark.vllm_range
def test_adaptive_draft_length_is_accepted_on_the_v1_runner(models):
    """On this CPU build (V1 runner, synchronous scheduling) the config is accepted, vLLM sees
    none of the plugin's fields, and the settings ride on the drafter's config to the workers."""
    config = engine_config(models["llama"], spec(models["llama-edsd"], adaptive_draft_length=True,
                                                 adaptive_draft_threshold=0.25))
    assert not config.use_v2_model_runner and not config.scheduler_config.async_scheduling
    assert AdaptiveDraftLength.of(config.speculative_config.draft_model_config.hf_config) == AdaptiveDraftLength(0.25)


@pytest.mark.parametrize(("v2", "async_scheduling", "expected"), [
    (True, False, "runs on vLLM's V1 model runner.*VLLM_USE_V2_MODEL_RUNNER=0"),
    (False, True, "needs synchronous scheduling.*--no-async-scheduling"),
])
def test_adaptive_draft_length_is_refused_where_drafts_have_one_width(v2, async_scheduling, expected):
    """Model Runner V2 and asynchronous scheduling hand drafts on as one fixed-width tensor.
    Neither can run on this CPU build (V2 needs Triton, and the CPU platform turns asynchronous
    scheduling off), so the check that the engine-config hook applies is called directly."""
    check_runner(use_v2_model_runner=False, async_scheduling=False)
    with pytest.raises(EDSDError, match=expected):
        check_runner(use_v2_model_runner=v2, async_scheduling=async_scheduling)


@pytest.mark.parametrize("case", ["mistyped relative path", "hub id with the hub switched off"])
def test_missing_drafter_path_is_no_such_directory_not_a_download(models, tmp_path, monkeypatch, case):
    """``runs/edsd`` looks like a hub id (org/name); when ``runs/`` exists here, or when
    HF_HUB_OFFLINE is set, it is a path that does not exist, and the error says so."""
    monkeypatch.chdir(tmp_path)
    if case == "mistyped relative path":
        (tmp_path / "runs").mkdir()
        model = "runs/edsd"
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        model = "someone/edsd-drafter"
    with pytest.raises(EDSDError, match=f"no such local directory: {tmp_path}/{model}$"):
        engine_config(models["llama"], spec(model))


@pytest.mark.vllm_range
@pytest.mark.parametrize(("version", "supported"), [
    ("0.23.1", False), ("0.24.0", True), ("0.27.0+cpu", True), ("0.33.2", True), ("0.34.0", False),
    ("1.0.0", False), ("unknown", False),
])
def test_supported_vllm_range_is_0_24_to_0_33(version, supported):
    assert version_supported(version) is supported


def test_vllm_outside_the_range_is_refused_by_name(models, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.23.0")
    with pytest.raises(
        EDSDError, match=r"supports vLLM 0\.24 up to \(not including\) 0\.34; the installed vLLM is 0\.23\.0"
    ):
        engine_config(models["llama"], spec(models["llama-edsd"]))


@pytest.mark.vllm_range
def test_eagle3_drafter_under_edsd_method_is_refused(models, tmp_path):
    eagle_like = tmp_path / "eagle3"
    shutil.copytree(models["llama-edsd"], eagle_like)
    cfg = json.loads((eagle_like / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (eagle_like / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EDSDError, match='use "method": "eagle3"'):
        engine_config(models["llama"], spec(eagle_like))


@pytest.mark.vllm_range
def test_good_config_resolves_to_vllms_eagle3_path(models):
    config = engine_config(models["llama"], spec(models["llama-edsd"]))
    assert config.speculative_config.method == "eagle3"
    assert config.speculative_config.draft_model_config.architectures == ["Eagle3EDSDLlamaForCausalLM"]




