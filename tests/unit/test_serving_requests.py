"""Bad speculative configs and bad drafters get one clear error naming the problem,
before any engine starts (vLLM's own config path, no mocks), and a process that
asked for them exits instead of hanging."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from support.drafters import edsd_spec as spec
from support.drafters import engine_config

from vllm_edsd.errors import EDSDError, positive_int
from vllm_edsd.methods.edsd.config import Speculators
from vllm_edsd.serving.features.draft_length import AdaptiveDraftLength, check_request_cap, check_runner
from vllm_edsd.serving.versions import version_supported


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


@pytest.mark.parametrize("value", [0, -3, True, False, 2.0, "4", None])
def test_a_positive_int_is_an_integer_of_one_or_more_and_no_bool(value):
    """The one check of counts in config files and speculative configs (JSON's true is Python's 1)."""
    with pytest.raises(EDSDError, match=r"^train\.epochs must be a positive integer, got "):
        positive_int(value, "train.epochs")
    assert positive_int(1, "train.epochs") == 1


@pytest.mark.parametrize(("block", "clue"), [
    ({"proposal_methods": [{"speculative_tokens": 3}]}, "KeyError: 'verifier'"),
    ({"proposal_methods": [], "verifier": {"name_or_path": "t"}}, "IndexError: list index out of range"),
    ("not a block", "TypeError: string indices must be integers"),
])
def test_a_malformed_speculators_block_names_what_is_wrong_and_keeps_the_cause(block, clue):
    """The field's shape is the error; which part of it is missing is the clue, kept in the
    line and as the cause."""
    raw = {"speculators_model_type": "edsd", "speculators_config": block}
    with pytest.raises(EDSDError, match=r"must hold proposal_methods\[0\]\.speculative_tokens") as err:
        Speculators.from_config(raw, "drafter/config.json")
    assert f"(docs/formats.md) ({clue}" in str(err.value)
    assert type(err.value.__cause__).__name__ == clue.split(":")[0]


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


def test_the_drafters_length_beside_the_lookup_belongs_to_model_drafters(models):
    with pytest.raises(EDSDError, match="^speculative config: 'num_drafter_tokens' is an option of \"method\": "
                                        "\"edsd\" and \"eagle3\", not of 'ngram'$"):
        engine_config(models["llama"], {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                        "num_drafter_tokens": 1})


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
def test_adaptive_draft_length_is_refused_where_drafts_have_one_width(models, monkeypatch, v2, async_scheduling,
                                                                     expected):
    """Model Runner V2 and asynchronous scheduling hand drafts on as one fixed-width tensor.
    Neither can run on this CPU build (V2 needs Triton, and the CPU platform turns asynchronous
    scheduling off), so vLLM's own engine config is switched to them after it is built and the
    check that the engine-config hook applies is called on it."""
    config = engine_config(models["llama"], spec(models["llama-edsd"]))
    check_runner("'adaptive_draft_length'", config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2 else "0")
    config.scheduler_config.async_scheduling = async_scheduling
    with pytest.raises(EDSDError, match="'adaptive_draft_length' " + expected):
        check_runner("'adaptive_draft_length'", config)


@pytest.mark.vllm_range
@pytest.mark.parametrize("n", [-1, 5, 2.0, "2", True, None, [1]])
def test_bad_per_request_draft_length_is_refused(models, n):
    """The front end's check on ``extra_args["num_speculative_tokens"]`` (K=4 here), on vLLM's
    own engine config."""
    config = engine_config(models["llama"], spec(models["llama-edsd"]))
    for good in (0, 1, 4):
        check_request_cap({"num_speculative_tokens": good}, config)
    check_request_cap({"other_plugin_key": 1}, config)
    with pytest.raises(EDSDError, match=r"an integer from 0 \(no drafts\) to 4 .*got " + re.escape(repr(n))):
        check_request_cap({"num_speculative_tokens": n}, config)


@pytest.mark.vllm_range
def test_per_request_draft_length_needs_a_speculating_engine(models):
    config = engine_config(models["llama"], None)
    check_request_cap(None, config)
    with pytest.raises(EDSDError, match="this engine does not speculate"):
        check_request_cap({"num_speculative_tokens": 0}, config)


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






def test_request_caps_are_read_per_row_and_cut_the_drafts():
    """The runner's view: each row's cap from its request's extra_args (K without one), none at
    all while no request asks for fewer than K; drafts (a tensor or lists) cut row by row."""
    import torch
    from vllm import SamplingParams

    from vllm_edsd.serving.features.draft_length import cut, request_caps

    def state(**extra):
        return SimpleNamespace(sampling_params=SamplingParams(extra_args=extra or None))

    requests = {"a": state(num_speculative_tokens=0), "b": state(), "c": state(num_speculative_tokens=2),
                "d": state(num_speculative_tokens=4), "pooling": SimpleNamespace(sampling_params=None)}
    assert request_caps(["a", "b", "c", "d", "pooling"], requests, 4) == [0, 4, 2, 4, 4]
    assert request_caps(["b", "d", "pooling"], requests, 4) is None
    drafts = torch.arange(12).view(3, 4)
    assert cut(drafts, [0, 4, 2]) == [[], [4, 5, 6, 7], [8, 9]]
    assert cut([[1, 2], [3], []], [1, 0, 2]) == [[1], [], []]


def test_cpu_servers_hold_the_context_their_kv_cache_fits():
    """On a CPU the launcher caps the context as the offline engines do, unless told otherwise:
    vLLM sizes a CPU KV cache from the NUMA node's memory, which left one machine too little
    for the demo target's 8,192 tokens."""
    from vllm_edsd.launch.engine import CPU_MAX_MODEL_LEN, on_cpu
    from vllm_edsd.launch.server import server_command

    if not on_cpu():
        pytest.skip("the cap is for vLLM's CPU build")
    default = server_command("TARGET", None, 8000)
    assert default[default.index("--max-model-len") + 1] == str(CPU_MAX_MODEL_LEN)
    chosen = server_command("TARGET", None, 8000, ["--max-model-len", "512"])
    assert chosen.count("--max-model-len") == 1 and chosen[chosen.index("--max-model-len") + 1] == "512"


def test_eager_servers_skip_torch_compile_once():
    """``eager`` adds ``--enforce-eager`` (vLLM's switch off torch.compile) once, given or not in
    the extra arguments; without it the flag is left to the caller."""
    from vllm_edsd.launch.server import server_command

    assert "--enforce-eager" not in server_command("TARGET", None, 8000)
    assert server_command("TARGET", None, 8000, eager=True).count("--enforce-eager") == 1
    assert server_command("TARGET", None, 8000, ["--enforce-eager"], eager=True).count("--enforce-eager") == 1


@pytest.mark.vllm_range
def test_edsd_drafts_by_sampling_unless_the_user_says_otherwise(models):
    """An ``"edsd"`` config without ``draft_sample_method`` gets "probabilistic"; a value given
    is kept."""
    def method(**extra):
        config = engine_config(models["llama"], spec(models["llama-edsd"], **extra))
        return config.speculative_config.draft_sample_method

    assert method() == "probabilistic"
    assert method(draft_sample_method="greedy") == "greedy"


DTYPES = ("bfloat16", "float16", "float32")
# Each dtype's engine config in one process (one vLLM import for the three), its log after a marker.
ENGINE_CONFIGS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
target, spec = sys.argv[1], json.loads(sys.argv[2])
for dtype in sys.argv[3:]:
    print("=== dtype", dtype, flush=True)
    config = EngineArgs(model=target, speculative_config=spec, dtype=dtype, gpu_memory_utilization=0.25)
    print("served in", config.create_engine_config().model_config.dtype, flush=True)
"""


@pytest.fixture(scope="module")
def dtype_logs(models) -> dict[str, str]:
    """vLLM's log (a process of its own: vLLM sets up its logging there) of an EDSD engine config
    in each of DTYPES, by dtype."""
    out = subprocess.run([sys.executable, "-c", ENGINE_CONFIGS, str(models["llama"]),
                          json.dumps(spec(models["llama-edsd"])), *DTYPES],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
    parts = out.split("=== dtype ")[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_16_bit_edsd_server_on_a_cpu_that_emulates_it_is_told_its_native_dtype(dtype_logs, dtype):
    """One warning in vLLM's log, where this CPU has no native instructions for the dtype the
    engine computes in, naming the dtype it computes natively (bfloat16 where it can, else
    float32); the dtype stays what was asked."""
    from vllm_edsd.launch.engine import cpu_computes_natively, cpu_dtype

    log = dtype_logs[dtype]
    assert f"served in torch.{dtype}" in log
    assert log.count("by emulation") == (not cpu_computes_natively(dtype))
    assert "by emulation" not in log or f"computes {dtype} by emulation" in log
    assert "by emulation" not in log or f"serve with --dtype {cpu_dtype()} here" in log
