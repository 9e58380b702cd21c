"""``python -m bench vocab-coverage``: how much of the target's answers to held-out prompts a
draft vocabulary of each size holds, when it is built as ``edsd train`` builds it (the most
frequent answer tokens of the training conversations). A token outside it can never be
drafted, so coverage bounds acceptance at every position; the draft vocabulary's size is
chosen from this, not guessed. Tokenizer only: seconds, no model.

The conversations are split in order: the first ``--train`` build the vocabulary, the last
``--held-out`` are measured. Both are rendered with the chat template and cut at
``--max-length`` as training renders them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_edsd.errors import EDSDError

from .arguments import numbers


def coverage_table(target: str, conversations: list, train_counts: list[int], held_out: int, sizes: list[int],
                   max_length: int) -> list[dict]:
    """One row per (training conversations, vocabulary size): the held-out coverage."""
    from transformers import AutoTokenizer

    from vllm_edsd.checkpoint.target import read_config_json
    from vllm_edsd.features.shards import tokenize_conversations
    from vllm_edsd.training.draft_vocab import answer_token_counts, build_vocab_mapping, coverage

    if held_out < 1 or held_out >= len(conversations):
        raise EDSDError(f"--held-out must leave conversations to train on: {held_out} of {len(conversations)}")
    if max(train_counts) > len(conversations) - held_out or min(train_counts) < 1:
        raise EDSDError(f"--train counts must be 1..{len(conversations) - held_out} (the rest is held out)")
    tokenizer = AutoTokenizer.from_pretrained(target)
    cfg = read_config_json(target)
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    held = answer_token_counts(tokenize_conversations(tokenizer, conversations[-held_out:], max_length)[0])
    samples = tokenize_conversations(tokenizer, conversations[: max(train_counts)], max_length)[0]
    rows = []
    for count in sorted(train_counts):
        counts = answer_token_counts(samples[:count])
        for size in sizes:
            _, t2d = build_vocab_mapping(counts, vocab, min(size, vocab))
            rows.append({"train_conversations": count, "distinct_seen": len(counts), "draft_vocab": size,
                         "held_out_coverage": round(coverage(t2d, held), 4), "held_out_tokens": sum(held.values())})
    return rows


def render(rows: list[dict], held_out: int) -> str:
    sizes = sorted({r["draft_vocab"] for r in rows})
    lines = [f"held-out answer tokens covered ({held_out} conversations, {rows[0]['held_out_tokens']:,} tokens)", "",
             "| vocabulary built from | distinct tokens seen | " + " | ".join(f"{s:,}" for s in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for count in sorted({r["train_conversations"] for r in rows}):
        mine = {r["draft_vocab"]: r for r in rows if r["train_conversations"] == count}
        lines.append(f"| {count:,} conversations | {mine[sizes[0]]['distinct_seen']:,} | "
                     + " | ".join(f"{mine[s]['held_out_coverage']:.3f}" for s in sizes) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Print the coverage table, and write it into --out when given."""
    from vllm_edsd.data import load_conversations

    sizes = numbers("--sizes", args.sizes, int, 1)
    train = numbers("--train", args.train, int, 1) if args.train else None
    conversations = load_conversations(args.data)
    train = train or [len(conversations) - args.held_out]
    rows = coverage_table(args.target, conversations, train, args.held_out, sizes, args.max_length)
    print(render(rows, args.held_out))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"command": args.command, "rows": rows}, indent=1) + "\n")
        (out / "report.md").write_text(f"# Draft vocabulary coverage\n\nCommand: `{args.command}`\n\n"
                                       + render(rows, args.held_out))
    return 0
