"""``edsd pipeline``: one TOML description runs the stages not yet done; an interrupted run,
rerun, ends where an uninterrupted one does; a bad config is one line; ``edsd build-demo`` is
the pipeline on the demo's description, with the demo recipe's training arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.pipeline_configs import assert_same, run_results, write_config
from support.toy import make_target, one_torch_thread, toy_corpus

from vllm_edsd.checkpoint.files import finished_checkpoint
from vllm_edsd.cli import main
from vllm_edsd.training.options import TrainOptions

TRAINING = {"methods": ["edsd", "eagle3"], "epochs": 5, "ttt_steps": 3, "lr": 3e-3, "batch_size": 4, "max_samples": 16,
            "draft_vocab_size": 256, "max_length": 64, "seed": 0, "device": "cpu"}


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    """A toy target and conversations as JSON lines (what ``edsd train --data`` reads)."""
    root = tmp_path_factory.mktemp("pipeline")
    lines = [line for line in toy_corpus().splitlines() if line.strip()]
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a},
                                                     {"role": "assistant", "content": b}]}) + "\n"
                            for a, b in zip(lines, lines[1:])))
    return {"target": make_target(root / "target"), "data": data}


@pytest.fixture
def one_thread():
    """Every run of the comparison on one CPU thread (in this process and the child): the same
    arithmetic in each, and no torch threads spinning against other work on a small machine
    (4-10x slower there)."""
    with one_torch_thread():
        yield {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def finished(toy, tmp_path_factory) -> Path:
    """The toy config's work directory, its pipeline run uninterrupted on one thread."""
    work = tmp_path_factory.mktemp("finished") / "full"
    with one_torch_thread():
        assert main(["pipeline", str(toy_config(toy, work))]) == 0
    return work


def toy_config(toy, work: Path, **changes) -> Path:
    # the unit tier starts no vLLM engine: features through transformers (test_features_extraction.py checks vLLM's)
    sections = {"target": {"path": str(toy["target"]), "features_backend": "transformers"},
                "data": {"file": str(toy["data"])},
                "layers": {"edsd": [1, 3], "eagle3": [1, 2, 3]}, "train": TRAINING, "output": {"work": str(work)}}
    for section, values in changes.items():
        sections[section] = {**sections.get(section, {}), **values}
    return write_config(work.parent / f"{work.name}.toml", sections)


def test_an_interrupted_pipeline_ends_where_an_uninterrupted_one_does(toy, finished, tmp_path, capsys, one_thread):
    full = run_results(finished)
    assert len(full["edsd losses"]) == TRAINING["epochs"]

    cut = tmp_path / "cut"
    config = toy_config(toy, cut)
    proc = subprocess.Popen([sys.executable, "-m", "vllm_edsd.cli", "pipeline", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=one_thread)
    state = cut / "edsd" / "training_state.pt"  # written after the first training's first epoch
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert state.exists() and not finished_checkpoint(cut / "edsd" / "final"), "not killed mid-training"
    assert not (cut / "eagle3").exists()

    capsys.readouterr()
    assert main(["pipeline", str(config)]) == 0
    summary = capsys.readouterr().out
    assert f"resuming {cut / 'edsd'} after epoch" in summary  # not started over
    assert_same(run_results(cut), full)
    rows = {line.split("  ")[0]: line for line in summary.splitlines()[-9:]}
    assert "already done" in rows["data"] and "skipped" in rows["select"] and "skipped" in rows["regenerate"]
    assert all("done now" in rows[stage] for stage in ("train-edsd", "train-eagle3", "convert"))

    assert main(["pipeline", str(config)]) == 0  # nothing left to do
    assert "done now" not in capsys.readouterr().out


def test_edsdelect_chooses_again_when_its_calibration_changed(toy, tmp_path, capsys):
    """EDSelect's choice is done once per calibration: rerun on the same data it is kept; a
    ``layers.json`` made on other data (or one that does not record its data) is chosen again,
    and the log says why."""
    work = tmp_path / "work"
    config = toy_config(toy, work, layers={"edsd": None, "select_samples": 4, "select_max_length": 32})
    select = ["pipeline", str(config), "--stop-after", "select"]
    assert main(select) == 0
    layers = work / "layers.json"
    chosen = json.loads(layers.read_text())
    assert chosen["calibration"]["data"] == toy["data"].name and chosen["calibration"]["samples"] == 4
    capsys.readouterr()
    assert main(select) == 0
    assert "choosing again" not in capsys.readouterr().out
    for stale in ({**chosen, "calibration": {**chosen["calibration"], "sha256": "0" * 64}},
                  {key: value for key, value in chosen.items() if key != "calibration"}):
        layers.write_text(json.dumps(stale))
        assert main(select) == 0
        assert f"{layers}: chosen on other calibration data" in capsys.readouterr().out
        assert json.loads(layers.read_text())["calibration"] == chosen["calibration"]


def test_dry_run_shows_each_command_and_runs_nothing(toy, tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["pipeline", str(toy_config(toy, work)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "train-edsd: to do" in out and "edsd train " in out and "--layers 1,3" in out
    assert "--feature-layers 1,2,3" in out and "select: skipped (layers.edsd given)" in out
    assert not work.exists()


def test_each_stage_shown_is_the_command_that_runs_it(toy, tmp_path):
    """The ``edsd`` command a stage shows (``--dry-run``, the log), parsed by that subcommand,
    gives the very options the pipeline calls the stage with."""
    import importlib

    from vllm_edsd.cli import COMMANDS, build_parser
    from vllm_edsd.command import command_line
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    plan = Plan(load_config(toy_config(toy, tmp_path / "work", data={"regenerate": True})))
    engine = {"tensor_parallel_size": 1, "enforce_eager": True}
    stages = {"select": plan.select_options(), "regenerate": plan.regenerate_options(),
              "features": dataclasses.replace(plan.features_options(), vllm_args=engine),
              "convert": plan.convert_options(),
              **{f"train-{m}": plan.train_options(m) for m in TRAINING["methods"]}}
    for stage, options in stages.items():
        name = stage.split("-")[0]
        argv = command_line(name, options)
        assert importlib.import_module(COMMANDS[name]).options(build_parser(name).parse_args(argv)) == options, argv


def test_each_stage_command_defaults_to_its_options_defaults():
    """A subcommand given only what it requires runs its stage with the options' own defaults:
    the dataclass is where they are written."""
    import importlib

    from vllm_edsd.cli import COMMANDS, build_parser
    from vllm_edsd.conversion.stage import ConvertOptions
    from vllm_edsd.features.stage import FeaturesOptions
    from vllm_edsd.regeneration.stage import RegenerateOptions
    from vllm_edsd.selection.stage import SelectOptions

    given = {"select": (["T", "--out", "o"], SelectOptions(target="T", out="o")),
             "regenerate": (["T", "--out", "o"], RegenerateOptions(target="T", out="o")),
             "features": (["T", "--cache", "c", "--feature-layers", "1,2"],
                          FeaturesOptions(target="T", cache="c", feature_layers=(1, 2))),
             "train": (["T", "--out", "o"], TrainOptions(target="T", out="o")),
             "convert": (["s", "d"], ConvertOptions(src="s", dst="d"))}
    for name, (argv, options) in given.items():
        assert importlib.import_module(COMMANDS[name]).options(build_parser(name).parse_args([name, *argv])) == options


def test_edsd_only_keys_reach_edsd_alone(toy, tmp_path):
    """``train.token_norm`` is a part of EDSD's architecture: EAGLE-3's run is given the rest of
    the budget without it (its ``edsd train`` would train the same model either way)."""
    from vllm_edsd.command import command_line
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    plan = Plan(load_config(toy_config(toy, tmp_path / "work", train={"token_norm": "layernorm"})))
    edsd, eagle3 = plan.train_options("edsd"), plan.train_options("eagle3")
    assert edsd.token_norm == "layernorm" and eagle3.token_norm == TrainOptions.token_norm
    assert dataclasses.replace(edsd, token_norm=eagle3.token_norm, layers=None, method="eagle3", out=eagle3.out) == \
        dataclasses.replace(eagle3, layers=None)
    argv = command_line("train", edsd)
    assert argv[argv.index("--token-norm") + 1] == "layernorm" and "--token-norm" not in command_line("train", eagle3)


def test_the_draft_layer_switches_reach_their_method_alone(toy, tmp_path):
    """``train.attention_reads_token``, ``train.feature_norm`` and ``train.fuse_residual`` switch
    EDSD's draft layer away from the paper's, EAGLE 3.1's normed output EAGLE-3's; each method's run is given its own
    alone. fc's input norm (``train.norm_before_fc``) and the normed residual
    (``train.norm_before_residual``) are both methods': both runs are given them. ``edsd train``
    shows them as flags. EDFuse's width (``train.fuse_intermediate_size``) is EDSD's alone too."""
    from vllm_edsd.command import command_line
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    own = {"edsd": ("attention_reads_token", "feature_norm", "fuse_residual"), "eagle3": ("norm_output",)}
    shared = ("norm_before_fc", "norm_before_residual")
    train = {name: True for names in (*own.values(), shared) for name in names}
    plan = Plan(load_config(toy_config(toy, tmp_path / "work", train={**train, "fuse_intermediate_size": 24})))
    assert plan.train_options("edsd").fuse_intermediate_size == 24  # EDFuse's width: EDSD's alone
    assert plan.train_options("eagle3").fuse_intermediate_size is None
    for method, names in own.items():
        options, other = plan.train_options(method), plan.train_options("eagle3" if method == "edsd" else "edsd")
        assert all(getattr(options, name) and not getattr(other, name) for name in names)
        assert all(getattr(options, name) for name in shared)
        assert {f"--{name.replace('_', '-')}" for name in (*names, *shared)} <= set(command_line("train", options))


def test_a_method_table_sets_that_method_alone(toy, tmp_path):
    """``[train.eagle3]`` gives EAGLE's run its own values of ``[train]``'s keys (a norm, the
    learning rate) over the shared ones; EDSD's run keeps ``[train]``'s."""
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    own = {"fc_norm": True, "norm_before_fc": False, "lr": 5e-4}
    plan = Plan(load_config(toy_config(toy, tmp_path / "work", train={"norm_before_fc": True, "eagle3": own})))
    edsd, eagle3 = plan.train_options("edsd"), plan.train_options("eagle3")
    assert (eagle3.fc_norm, eagle3.norm_before_fc, eagle3.lr) == (True, False, 5e-4)
    assert (edsd.fc_norm, edsd.norm_before_fc, edsd.lr) == (TrainOptions.fc_norm, True, TRAINING["lr"])


@pytest.mark.parametrize("change, message", [
    ({"train": {"epoch": 3}}, "unknown key train.epoch"),
    ({"train": {"epochs": "3"}}, "train.epochs must be an integer, got '3'"),
    ({"train": {"lr": True}}, "train.lr must be a number, got True"),
    ({"train": {"epochs": True}}, "train.epochs must be an integer, got True"),
    ({"train": {"epochs": 0}}, "train.epochs must be a positive integer, got 0"),
    ({"data": {"answer_tokens": -1}}, "data.answer_tokens must be a positive integer, got -1"),
    ({"layers": {"edsd": [1, "3"]}}, "layers.edsd must be a list of integers"),
    ({"layers": {"edsd": [1, 2, 3]}}, "layers.edsd must be 2 distinct layer ids"),
    ({"train": {"methods": ["medusa"]}}, "train.methods must name distinct methods"),
    ({"target": {"path": None}}, "missing target.path"),
    ({"extra": {"x": 1}}, "unknown section [extra]"),
    ({"data": {"sharegpt_chat": 8}}, "[data] needs either file or sharegpt_chat/sharegpt_code"),
    ({"target": {"path": "nowhere"}}, "target.path: "),
    ({"train": {"token_norm": "batchnorm"}}, "train.token_norm must be one of ['rmsnorm', 'layernorm']"),
    ({"train": {"norm_before_fc": True, "fc_norm": True}}, "train.norm_before_fc and train.fc_norm both norm fc's"),
    ({"train": {"norm_before_fc": True, "eagle3": {"fc_norm": True}}},
     "train.norm_before_fc and train.eagle3.fc_norm both norm fc's"),
    ({"train": {"edsd": {"epoch": 3}}}, "unknown key train.edsd.epoch"),
    ({"train": {"edsd": {"lr": "fast"}}}, "train.edsd.lr must be a number, got 'fast'"),
    ({"train": {"eagle3": {"max_length": 32}}}, "train.eagle3.max_length is every method's: set it in [train]"),
    ({"train": {"eagle3": 3}}, "train.eagle3 must be a table, got 3"),
    ({"train": {"eagle3": {"token_norm": "layernorm"}}}, "train.eagle3.token_norm is not a key of eagle3's drafter"),
])
def test_a_bad_config_is_one_line_naming_the_key(toy, tmp_path, capsys, change, message):
    config = toy_config(toy, tmp_path / "work", **change)
    assert main(["pipeline", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(("content", "message"), [
    (b"[train\nepochs = 3\n", "not valid TOML"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a text file, so not a TOML config"),
    (None, "cannot read the config (Is a directory)"),
])
def test_a_config_that_is_not_toml(tmp_path, capsys, content, message):
    config = tmp_path / "bad.toml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    assert main(["pipeline", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{config}: {message}" in err


def test_the_example_config_reads(tmp_path, capsys):
    from vllm_edsd.pipeline.config import load_config

    assert main(["pipeline", "--example"]) == 0
    cfg = load_config(write_example(tmp_path, capsys.readouterr().out))
    assert cfg.train.methods == ["edsd", "eagle3"] and cfg.output.work == str(tmp_path / "runs/smollm2")


def write_example(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "example.toml"
    path.write_text(text)
    return path


def test_build_demo_is_the_pipeline_with_the_demo_recipe(toy, tmp_path):
    """``pipeline.toml`` and build-demo's flags give the demo drafters' training arguments: the
    recipe of docs/paper.md's ablations with EDSD's draft layer as shipped (the token read, the
    normed fed-back state, EDFuse's residual at width 576, one norm over fc's input from its own
    table) and EAGLE 3.1's norms (EAGLE's fc_norm), all 10,043
    conversations in bfloat16 autocast, saved every 100 batches, the epochs from the flag; EAGLE
    gets the same optimizer, its own norms and none of EDSD's architecture."""
    from vllm_edsd.demo import DEMO_PROMPTS, build
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    parser = argparse.ArgumentParser()
    build.add_arguments(parser)
    flags = parser.parse_args(["--work", str(tmp_path), "--device", "cpu", "--draft-epochs", "2"])
    plan = Plan(load_config(build.PIPELINE, build.demo_overrides(flags, toy["target"])))
    (tmp_path / "layers.json").write_text(json.dumps({"aux_layer_ids": [1, 3]}))
    data = str(tmp_path / "regenerated-8070chat-1973code-192tokens-seed0.jsonl")
    assert plan.train_options("edsd") == TrainOptions(
        target=str(toy["target"]), out=str(tmp_path / "edsd"), method="edsd", layers_from=str(tmp_path / "layers.json"),
        data=data, epochs=2, ttt_steps=4, lr=0.001, lr_schedule="cosine", weight_decay=0, token_norm="layernorm",
        attention_reads_token=True, feature_norm=True, fuse_residual=True, fuse_intermediate_size=576,
        norm_before_fc=True, fc_norm=False, norm_before_residual=True, autocast="bfloat16", draft_vocab_size=4096,
        max_length=448, batch_size=8, seed=0, device="cpu", save_every=100, cache=str(tmp_path / "cache"),
        feature_layers=(1, 2, 3))
    eagle3 = plan.train_options("eagle3")
    assert eagle3.layers_from is None and eagle3.token_norm == TrainOptions.token_norm
    assert not eagle3.attention_reads_token and not eagle3.feature_norm and not eagle3.fuse_residual
    assert eagle3.fuse_intermediate_size is None
    assert eagle3.fc_norm and eagle3.norm_before_residual and eagle3.norm_output and not eagle3.norm_before_fc
    assert (eagle3.lr_schedule, eagle3.weight_decay, eagle3.autocast) == ("cosine", 0, "bfloat16")
    assert plan.cfg.data.exclude == [prompt for _, prompt in DEMO_PROMPTS]
    convert = plan.convert_options()
    assert (convert.verifier, convert.dtype, convert.force) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "float16", True)


def test_a_finished_run_is_what_its_recipe_trains_and_another_recipe_is_named(toy, finished):
    """What ``edsd build-demo --ship-from`` checks of a run trained elsewhere: the pipeline's own
    runs are what their options train; a changed optimizer, aux layers, draft layer or width is
    named (EDFuse's, unset, is the target's FFN)."""
    from vllm_edsd.methods.edsd.layouts import read_edsd_config
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan
    from vllm_edsd.training.provenance import differences

    plan = Plan(load_config(toy_config(toy, finished)))
    for method in ("edsd", "eagle3"):
        assert differences(finished / method, plan.train_options(method)) == []
    other = dataclasses.replace(plan.train_options("edsd"), lr=0.5, layers=(1, 2), feature_norm=True,
                                fuse_intermediate_size=24)
    width = read_edsd_config(finished / "edsd" / "final")[1]
    assert differences(finished / "edsd", other) == [
        f"lr {TRAINING['lr']!r} (the recipe's: 0.5)", "aux layers [1, 3] (the recipe's: [1, 2])",
        "feature_norm False (the recipe's: True)",
        f"fuse_intermediate_size {width.fuse_intermediate_size} (the recipe's: 24)"]
    longer = dataclasses.replace(plan.train_options("eagle3"), epochs=TRAINING["epochs"] + 1)
    assert differences(finished / "eagle3", longer) == [f"epochs {TRAINING['epochs']} (the recipe's: 6)"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--ship-from", "edsd=a", "--ship-from", "eagle3=b"], "--ship-from ships runs already trained: give it with "
                                                           "--ship, without --stop-after or --dry-run"),
    (["--ship", "--ship-from", "medusa=a"],
     "--ship-from medusa=a: expected METHOD=RUN with METHOD one of edsd, eagle3"),
    (["--ship", "--ship-from", "edsd=a", "--ship-from", "edsd=b"], "--ship-from names edsd twice"),
    (["--ship", "--ship-from", "edsd=a"], "--ship-from ships the pair: name a run for eagle3 too"),
])
def test_build_demo_ship_from_refuses_flags_it_cannot_honour(tmp_path, capsys, flags, message):
    assert main(["build-demo", "--work", str(tmp_path / "work"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "work").exists()


def test_build_demo_ships_no_run_the_demo_recipe_would_not_train(finished, tmp_path, capsys):
    """The toy pipeline's runs are not the demo recipe's: refused with what differs, before
    anything is written, the shipped pair untouched."""
    from vllm_edsd.demo import ASSETS

    shipped = {path: path.stat().st_mtime_ns for path in ASSETS.rglob("*")}
    ship = ["build-demo", "--work", str(tmp_path), "--ship", "--ship-from", f"edsd={finished / 'edsd'}",
            "--ship-from", f"eagle3={finished / 'eagle3'}"]
    assert main(ship) == 2
    assert f"no {tmp_path / 'layers.json'}: give as --work the runs' work directory" in capsys.readouterr().err
    (tmp_path / "layers.json").write_text(json.dumps({"aux_layer_ids": [1, 3]}))
    assert main([*ship[:-1], f"eagle3={tmp_path / 'nowhere'}"]) == 2
    assert f"eagle3={tmp_path / 'nowhere'}: not a finished training run" in capsys.readouterr().err
    assert main(ship) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained otherwise than pipeline.toml says: epochs 5 (the recipe's: 3)" in err, err
    assert {path: path.stat().st_mtime_ns for path in ASSETS.rglob("*")} == shipped
