"""Bad input is one clear line before any engine starts, nothing
is deleted that the user did not name, no output or interruption leaves debris behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.drafters import edited_copy, engine_config
from support.drafters import edsd_spec as spec
from support.toy import make_drafter

from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING
from vllm_edsd.serving.features.draft_length import CONFIG_ATTRIBUTE, AdaptiveDraftLength
from weights_convert import convert

BIG = 10**9


@pytest.fixture(scope="module")
def training_ckpt(models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hardening")
    make_drafter(models["llama"], root / "edsd", draft_vocab_size=256, layout=EDSD_TRAINING, seed=7)
    return root / "edsd"


def run_convert(capsys, *args) -> tuple[int, str]:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err


def one_line_refusal(capsys, src, dst, expected: str, *extra) -> None:
    code, err = run_convert(capsys, src, dst, *extra)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not Path(dst).exists()


# ---------------------------------------------------------------- 1. d2t range


def test_convert_range_checks_d2t_without_t2d(models, tmp_path, capsys):
    """A full-vocabulary drafter may carry d2t alone; an entry past the vocabulary is named."""
    make_drafter(models["llama"], tmp_path / "full", layout=EDSD_TRAINING)
    bad = torch.zeros(512, dtype=torch.long)
    bad[3] = BIG
    src = edited_copy(tmp_path / "full", tmp_path / "src", edit_tensors=lambda t: t.update(d2t=bad))
    one_line_refusal(capsys, src, tmp_path / "out", f"maps draft id 3 to target id 3 + d2t[3] = 3 + {BIG}")


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


# ---------------------------------------------------------------- 2. no serving option from config.json


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


# ---------------------------------------------------------------- 3. convert's destination


def _during_conversion(action):
    """A ``progress`` callback of ``convert`` that runs ``action`` while tensors are read."""
    def progress(items, total):
        action()
        return items
    return progress


def test_a_directory_appearing_at_dst_is_never_deleted(training_ckpt, tmp_path, monkeypatch):
    """Someone creates DST while the output is being written (after every early check)."""
    import safetensors.torch

    dst, save_file_ = tmp_path / "out", safetensors.torch.save_file

    def someone_else_writes_first(*args, **kwargs):
        if not dst.exists():
            dst.mkdir()
            (dst / "theirs.txt").write_text("keep me")
        return save_file_(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", someone_else_writes_first)
    with pytest.raises(EDSDError, match="out: already exists|appeared while the output was being written"):
        convert(training_ckpt, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "scratch left behind"


def test_force_checks_what_it_replaces_at_the_rename(training_ckpt, tmp_path):
    """--force accepted DST when it started; by the rename a user's directory is there instead."""
    dst = tmp_path / "out"
    convert(training_ckpt, dst)

    def swapped():
        dst.rename(tmp_path / "moved")
        dst.mkdir()
        (dst / "notes.txt").write_text("keep me")

    with pytest.raises(EDSDError, match="refusing to replace it with --force"):
        convert(training_ckpt, dst, force=True, progress=_during_conversion(swapped))
    assert (dst / "notes.txt").read_text() == "keep me" and sorted(p.name for p in dst.iterdir()) == ["notes.txt"]


def test_leftovers_of_a_killed_run_are_removed_and_never_taken_for_a_drafter(training_ckpt, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / f".out.partial-{int(dead.stdout)}-0123456789ab"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    dst = tmp_path / "out"
    dst.mkdir()  # a config.json written before its weights (an interrupted writer)
    (dst / "config.json").write_text(json.dumps({"edsd_config": {"converter": {"name": "vllm-edsd"}}}))
    code, err = run_convert(capsys, training_ckpt, dst)
    assert code == 2 and "unfinished output" in err
    assert run_convert(capsys, training_ckpt, dst, "--force")[0] == 0
    assert not partial.exists()
    assert {p.name for p in dst.iterdir()} == {"config.json", "model.safetensors"}


def test_a_save_cut_off_leaves_no_config_json(models, tmp_path, monkeypatch):
    """``edsd build-demo`` resumes by looking for finished checkpoints: the weights are written
    first, so an interrupted save never leaves a config.json that looks finished."""
    import vllm_edsd.checkpoint.files as files
    from vllm_edsd.checkpoint.files import finished_checkpoint

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "save_safetensors", killed)
    with pytest.raises(KeyboardInterrupt):
        make_drafter(models["llama"], tmp_path / "final", layout=EDSD_TRAINING)
    assert not (tmp_path / "final" / "config.json").exists() and not finished_checkpoint(tmp_path / "final")
    assert [p.name for p in (tmp_path / "final").iterdir()] == []


def test_outputs_follow_the_umask(training_ckpt, tmp_path):
    old = os.umask(0o022)
    try:
        convert(training_ckpt, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "out").iterdir())


# ---------------------------------------------------------------- 5. an interrupted demo leaves no server




# ---------------------------------------------------------------- 6. the demo's lossless check


def test_demo_names_its_dtype_and_where_a_reply_differs():
    from vllm_edsd.demo import DEMO_DTYPE, summary
    from vllm_edsd.launch.engine import SpecCounters

    counters = SpecCounters(drafts=4, draft_tokens=16, accepted=8, accepted_per_pos=[4, 2, 1, 1])
    plain = {"texts": ["a"] * 4, "token_ids": [[1, 2, 3, 4]] * 4, "tokens_per_s": 10.0, "counters": None,
             "margins": [[5.0, 4.0, 0.0123, 2.0]] * 4}
    drafted = {**plain, "token_ids": [[1, 2, 9, 4]] + [[1, 2, 3, 4]] * 3, "tokens_per_s": 20.0, "counters": counters,
               "margins": None}
    text = summary({"none": plain, "edsd": drafted}, 4)
    assert DEMO_DTYPE == "float32" and "float32, K=4" in text
    assert "3/4" in text
    assert (
        "edsd: prompt 1 differs from the target alone first at token 2; the target's top-2 logit margin there is 0.0123"
        in text
    )


def test_every_bench_figure_names_its_dtype():
    from bench.report import render

    machine = {"processor": "cpu", "cores": 2, "accelerator": "none", "vllm": "0", "torch": "0", "vllm_edsd": "0",
               "cpu_instruction_set": "avx512_bf16 avx2", "default_dtype": "bfloat16"}
    row = {"suite": "throughput", "method": "edsd", "k": 4, "temperature": 0.0, "batch_size": 1, "dtype": "bfloat16",
           "output_tokens_per_s": 1.0, "speedup": 1.0, "tau": 2.0, "mean_draft_length": 4.0}
    report = render({"machine": machine, "config": {"target": "t", "drafters": {}, "command": "c"}, "runs": [row]})
    assert "avx512_bf16" in report and "| dtype |" in report and "| bfloat16 |" in report


# ---------------------------------------------------------------- low


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda c: c.update(rope_parameters=[1, 2]), "field 'rope_parameters' must be an object"),
    (lambda c: c.update(rope_scaling="yes", rope_parameters=None), "field 'rope_scaling' must be an object"),
    (lambda c: c["edsd_config"].update(target={"vocab_size": "x", "hidden_size": 256}),
     "field 'vocab_size' must be a positive integer, got 'x'"),
    (lambda c: c["edsd_config"].update(target=[512, 256]), "field 'edsd_config.target': must be an object"),
    (lambda c: c.update(rms_norm_eps=float("inf")), "field 'rms_norm_eps' must be below 2**31"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "field 'rms_norm_eps' must be a positive number, got nan"),
    (lambda c: c.update(intermediate_size=2**40), "field 'intermediate_size' must be below 2**31"),
])
def test_malformed_config_fields_are_one_line(training_ckpt, tmp_path, capsys, edit, expected):
    src = edited_copy(training_ckpt, tmp_path / "src", edit_config=edit)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


@pytest.mark.parametrize(("text", "expected"), [
    (_deep(100_000), "nested too deeply"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "invalid JSON"),
])
def test_unreadable_json_is_one_line(training_ckpt, tmp_path, capsys, text, expected):
    src = edited_copy(training_ckpt, tmp_path / "src")
    (src / "config.json").write_text(text)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


def _sharded(src: Path, dst: Path, weight_map) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(load_file(src / "model.safetensors"), dst / "model-1.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize(("shard", "expected"), [
    ("../x.safetensors", "shard '../x.safetensors' is outside the checkpoint's directory"),
    ("ABSOLUTE", "is outside the checkpoint's directory"),
    (["model-1.safetensors"], "not a valid safetensors index ('weight_map' must map"),
    (7, "not a valid safetensors index ('weight_map' must map"),
])
def test_sharded_index_stays_in_its_directory(training_ckpt, tmp_path, capsys, shard, expected):
    save_file(load_file(training_ckpt / "model.safetensors"), tmp_path / "x.safetensors")
    shard = str(tmp_path / "x.safetensors") if shard == "ABSOLUTE" else shard
    names = list(load_file(training_ckpt / "model.safetensors"))
    weight_map = shard if isinstance(shard, list) else {name: shard for name in names}
    src = _sharded(training_ckpt, tmp_path / "src", weight_map)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


def test_mistyped_drafter_path_is_one_line_with_the_absolute_path(models, tmp_path, monkeypatch):
    """``runs/edsd-typo`` without a ``runs/`` here looks like a hub id; with no hub reachable
    (or no such repository) the error still names the local directory tried."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(EDSDError, match=f"no such local directory: {tmp_path}/runs/edsd-typo, and the model hub"):
        engine_config(models["llama"], spec("runs/edsd-typo"))


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


def test_convert_records_relative_provenance(training_ckpt, tmp_path):
    convert(training_ckpt, tmp_path / "out")
    source = json.loads((tmp_path / "out" / "config.json").read_text())["edsd_config"]["source"]
    assert source["path"] == f"{training_ckpt.parent.name}/{training_ckpt.name}"


def test_a_fixed_temporary_name_held_by_another_run_does_not_collide(models, tmp_path):
    """Feature shards were written to ``shard_NNNNN.tmp``: a concurrent run holding that name
    broke (or was broken by) this one."""
    from vllm_edsd.features.hidden_states import TransformersFeatures
    from vllm_edsd.features.shards import FeatureSpec, extract_features, shard_path
    from vllm_edsd.launch.transformers_target import load_target

    samples, spec = [([1, 5, 6, 7], [0, 1, 1, 1])], FeatureSpec.of(models["llama"], (1, 3), "float32", "transformers")
    shard = shard_path(tmp_path, spec, samples)
    shard.with_suffix(".tmp").mkdir()
    source = TransformersFeatures(load_target(models["llama"]), (1, 3))
    assert extract_features(source, samples, tmp_path, spec) == [shard]
    assert shard.is_file()


def test_target_embedding_is_the_only_tensor_read(models, training_ckpt, tmp_path, capsys):
    """A sharded target whose other shard is unreadable: folding needs the embedding only."""
    target = tmp_path / "target"
    target.mkdir()
    for f in Path(models["llama"]).iterdir():
        if f.name != "model.safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    tensors = load_file(Path(models["llama"]) / "model.safetensors")
    embedding = "model.embed_tokens.weight"
    save_file({embedding: tensors[embedding]}, target / "model-embed.safetensors")
    (target / "a-other.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {name: "model-embed.safetensors" if name == embedding else "a-other.safetensors" for name in tensors}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, err = run_convert(capsys, training_ckpt, tmp_path / "out", "--target", target, "--fold-token-norm")
    assert code == 0, err


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


def _zombie_group_leader() -> subprocess.Popen:
    """A process in its own group that has exited and that nobody has reaped yet: what a killed
    server's engine processes stay as where PID 1 does not reap orphans."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    return proc


def test_a_server_group_left_with_only_zombies_counts_as_stopped():
    from vllm_edsd.launch.server import _group_alive, stop_process_group

    zombie = _zombie_group_leader()
    os.killpg(zombie.pid, 0)  # the group still exists for signals
    assert not _group_alive(zombie.pid)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert _group_alive(running.pid)
    started = time.time()
    stop_process_group(running, grace_s=60)
    assert running.returncode is not None and time.time() - started < 30  # stopped by SIGTERM, not the grace
    zombie.wait()
