"""A converted drafter directory in the speculators format (docs/formats.md): vLLM's own readers
take target, ``"method": "edsd"`` and K from its config.json, so ``vllm serve DRAFTER_DIR`` and
``LLM(model=DRAFTER_DIR)`` need no speculative config. No engine starts here."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
from support.drafters import edited_copy, engine_config

from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM
from vllm_edsd.serving.plugin import speculators_pre_trained_config

SPECULATORS_KEYS = {"speculators_model_type", "speculators_config", "transformer_layer_config"}
HUB_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


def convert(capsys, src, dst, *extra) -> tuple[int, str, str]:
    code = main(["convert", str(src), str(dst), *map(str, extra)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read(drafter) -> dict:
    return json.loads((drafter / "config.json").read_text())


@pytest.fixture(scope="module")
def served_alone(models, tmp_path_factory):
    """The toy drafter converted with ``--target`` (the default verifier) and K = 3."""
    drafter = tmp_path_factory.mktemp("speculators") / "edsd"
    assert main(["convert", models["llama-edsd-training"], str(drafter), "--target", models["llama"],
                 "--num-speculative-tokens", "3"]) == 0
    return drafter


def test_convert_writes_the_block_beside_the_vllm_fields(models, served_alone, tmp_path, capsys):
    cfg = read(served_alone)
    assert cfg["speculators_model_type"] == "edsd"
    assert cfg["speculators_config"] == {
        "algorithm": "edsd",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": models["llama"], "architectures": ["LlamaForCausalLM"]},
    }
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer == {k: cfg[k] for k in layer}
    # The vLLM layout's own fields are what a conversion without the block writes.
    code, out, _ = convert(capsys, models["llama-edsd-training"], tmp_path / "plain")
    assert code == 0 and "or alone    not set up: the verifier" in out and "--verifier NAME_OR_PATH" in out
    plain = read(tmp_path / "plain")
    assert not SPECULATORS_KEYS & set(plain)
    assert {k: v for k, v in cfg.items() if k not in SPECULATORS_KEYS and k != "edsd_config"} == \
           {k: v for k, v in plain.items() if k != "edsd_config"}


def test_verifier_is_recorded_as_named(models, tmp_path, monkeypatch, capsys):
    """A hub id as given (what the demo ships: no machine path); a local directory absolute,
    since vLLM resolves it from the server's working directory."""
    code, out, _ = convert(capsys, models["llama-edsd-training"], tmp_path / "hub", "--target", models["llama"],
                           "--verifier", HUB_VERIFIER)
    assert code == 0 and f"(loads the verifier {HUB_VERIFIER}; speculators format)" in out
    assert read(tmp_path / "hub")["speculators_config"]["verifier"]["name_or_path"] == HUB_VERIFIER
    assert read(tmp_path / "hub")["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    monkeypatch.chdir(os.path.dirname(models["llama"]))
    code, _, _ = convert(capsys, models["llama-edsd-training"], tmp_path / "local", "--verifier", "llama")
    verifier = read(tmp_path / "local")["speculators_config"]["verifier"]
    assert code == 0 and verifier == {"name_or_path": models["llama"], "architectures": []}


@pytest.mark.parametrize("k", ["0", "17", "-2"])
def test_bad_draft_length_is_one_line(models, tmp_path, capsys, k):
    code, out, err = convert(capsys, models["llama-edsd-training"], tmp_path / "out", "--num-speculative-tokens", k)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert f"--num-speculative-tokens must be an integer in 1..16, got {k}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm_range
def test_vllm_reads_method_length_and_verifier(models, served_alone, monkeypatch):
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert SpeculatorsConfig.extract_vllm_speculative_config(read(served_alone)) == {
        "method": "edsd", "num_speculative_tokens": 3}
    model, tokenizer, spec = maybe_override_with_speculators(str(served_alone), None, False)
    assert model == tokenizer == models["llama"]
    assert spec == {"method": "edsd", "num_speculative_tokens": 3, "model": str(served_alone)}


@pytest.mark.vllm_range
def test_registered_updater_gives_the_draft_config(served_alone, tmp_path):
    """Readers that build the draft config from the speculators fields (a config.json without
    ``model_type``) get the one the vLLM layout describes."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    import vllm_edsd

    vllm_edsd.register()
    assert SUPPORTED_SPECULATORS_TYPES["edsd"] is speculators_pre_trained_config
    raw = read(served_alone)
    pre_trained = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(raw))
    assert pre_trained["architectures"] == ["EDSDLlamaForCausalLM"]
    assert pre_trained["draft_vocab_size"] == 256 and pre_trained["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert pre_trained["edsd_config"] == raw["edsd_config"] and not SPECULATORS_KEYS & set(pre_trained)
    untyped = edited_copy(served_alone, tmp_path / "untyped", edit_config=lambda c: c.pop("model_type"))
    hf_config = get_config(str(untyped), trust_remote_code=False)
    assert isinstance(hf_config, SpeculatorsConfig)
    expected = EDSD_VLLM.read_config(raw, source="served").with_updates(speculators=None)
    assert EDSD_VLLM.read_config(hf_config.to_dict(), source="untyped") == expected


@pytest.mark.vllm_range
def test_server_arguments_name_only_the_drafter_directory(models, served_alone):
    """The server's arguments ``--model DRAFTER_DIR``, parsed by the parser of ``vllm serve``, give
    the engine config of the explicit EDSD request: no server needs to start to show it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = serve.make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", str(served_alone), "--gpu-memory-utilization", "0.25"])
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    explicit = engine_config(models["llama"], {"method": "edsd", "model": str(served_alone),
                                               "num_speculative_tokens": 3})
    assert config.model_config.model == models["llama"]
    for spec in (config.speculative_config, explicit.speculative_config):
        assert (spec.method, spec.num_speculative_tokens, spec.draft_model_config.model) == \
               ("eagle3", 3, str(served_alone))
        assert spec.draft_model_config.architectures == ["Eagle3EDSDLlamaForCausalLM"]


def _verifier(name):
    return lambda cfg: cfg["speculators_config"]["verifier"].update(name_or_path=name)


NOT_FOUND = "verifier (speculators_config.verifier.name_or_path): no such local directory: TMP/"


@pytest.mark.vllm_range
@pytest.mark.parametrize(("case", "expected"), [
    ("missing directory", NOT_FOUND + "no-such-target"),
    ("hub id, hub off", NOT_FOUND + "nobody/no-such-model"),
    ("no verifier", "field 'speculators_config.verifier.name_or_path' must name the target model (a directory "
                    "or a hub id), got ''"),
    ("bad K", "field 'speculators_config.proposal_methods[0].speculative_tokens' must be an integer in 1..16, "
              "got 0"),
])
def test_verifier_not_found_is_one_line_before_vllm_looks(served_alone, tmp_path, monkeypatch, case, expected):
    edits = {
        "missing directory": _verifier(str(tmp_path / "no-such-target")),
        "hub id, hub off": _verifier("nobody/no-such-model"),
        "no verifier": _verifier(""),
        "bad K": lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0),
    }
    drafter = edited_copy(served_alone, tmp_path / "drafter", edit_config=edits[case])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EDSDError) as err:
        engine_config(str(drafter), None)
    assert str(err.value) == f"{drafter}/config.json: " + expected.replace("TMP", str(tmp_path))


def test_cached_hub_verifier_is_left_to_vllm_offline(models, served_alone, tmp_path, monkeypatch):
    """Offline, a verifier in the model hub's cache is what vLLM loads: no refusal."""
    from vllm_edsd.serving.preflight import check_verifier

    revision = "0" * 40
    cache = tmp_path / "hub" / "models--someone--target"
    shutil.copytree(models["llama"], cache / "snapshots" / revision)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(revision)
    drafter = edited_copy(served_alone, tmp_path / "drafter", edit_config=_verifier("someone/target"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    check_verifier(str(drafter))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(EDSDError, match="no such local directory"):
        check_verifier(str(drafter))


def test_the_draft_layer_switches_survive_the_speculators_format(models, tmp_path):
    """A drafter whose attention also reads the token, whose gate reads the normed feature and
    whose fc reads its input normed per layer, converted into the speculators format: vLLM's
    reader of the speculators fields gives the plugin a draft config with the three switches on."""
    from support.toy import make_drafter
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    import vllm_edsd
    from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING

    vllm_edsd.register()
    make_drafter(models["llama"], tmp_path / "training", draft_vocab_size=256, layout=EDSD_TRAINING,
                 attention_reads_token=True, feature_norm=True, fc_norm=True)
    assert main(["convert", str(tmp_path / "training"), str(tmp_path / "served"), "--target", models["llama"]]) == 0
    pre_trained = SpeculatorsConfig.extract_transformers_pre_trained_config(read(tmp_path / "served"))
    drafter = EDSD_VLLM.read_config(pre_trained, source="speculators")
    assert drafter.attention_reads_token and drafter.feature_norm and drafter.fc_norm
