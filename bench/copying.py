"""``python -m bench copying``: how much of each drafter's accuracy is copying from the context,
which is what EDSD's gap to EAGLE-3 is made of. No vLLM, no training.

The target answers the bench's held-out prompts greedily (transformers, float32, its chat
template); each drafter then drafts over those sequences from the target's real features, every
context at once, as an engine serves it (``DraftHead.propose``): row p's context is
x_0..x_{p+1}, and its draft k (TTT step k) predicts x_{p+2+k}, step k fed the drafter's own
earlier drafts and its own fed-back state. A position is scored where that token is an answer
token after the first (the first is the target's own, sampled at prefill); it is *copyable*
where its bigram (x_{j-1}, x_j) already occurred within x_0..x_{j-1}. Per drafter and step:

- accuracy on the copyable positions, on the others and on all; and among the rows whose
  earlier drafts were all right (the drafts acceptance reaches);
- beside it, the rule "copy what followed the last occurrence of x_{j-1}" on the copyable positions;
- the attention output alone (the draft layer's ``self_attn``, before the residual add) read
  through the final norm and the LM head;
- the fed-back state (the draft layer's output, which the next step reads): the median over
  positions of its RMS, and its largest |value|.

Writes ``results.json`` and ``report.md`` into ``--out`` and prints the report.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import METHODS
from vllm_edsd.methods.registry import EAGLE3, EDSD

from .machine import describe, machine
from .offline import CATEGORIES

DRAFTERS = (EDSD, EAGLE3)  # the methods measured, in the report's order
SPLITS = ("copyable", "other", "all")


# ---------------------------------------------------------------- the bigram split


def copyable_positions(tokens: Sequence[int]) -> list[bool]:
    """For each index j, whether the bigram (x_{j-1}, x_j) already occurred within x_0..x_{j-1}
    (False at j = 0)."""
    seen: set[tuple[int, int]] = set()
    copyable = [False]
    for bigram in zip(tokens, tokens[1:]):
        copyable.append(bigram in seen)
        seen.add(bigram)
    return copyable


def last_occurrence_guesses(tokens: Sequence[int]) -> list[int]:
    """For each index j, the rule's guess of x_j from x_0..x_{j-1}: the token that followed the
    last earlier occurrence of x_{j-1}; -1 where x_{j-1} did not occur before (and at j = 0)."""
    follower: dict[int, int] = {}
    guesses = [-1]
    for previous, token in zip(tokens, tokens[1:]):
        guesses.append(follower.get(previous, -1))
        follower[previous] = token
    return guesses


@dataclass
class Answer:
    """A prompt in the chat template followed by the target's greedy answer, as token ids."""

    prompt_length: int
    tokens: list[int]


@dataclass
class Positions:
    """Where one answer's drafts are scored: a row per context whose next token is an answer
    token after the first (row r is row ``first_row + r`` of a ``ChainTrace``), a column per
    draft step. Every tensor is [rows, steps]."""

    first_row: int
    truth: torch.Tensor  # the token each draft should be; -1 past the sequence's end
    scored: torch.Tensor  # that token exists
    copyable: torch.Tensor
    rule_right: torch.Tensor  # the last-occurrence rule guesses it


def answer_positions(answer: Answer, steps: int) -> Positions:
    """The scored positions of ``answer`` for chains of ``steps`` drafts, labelled."""
    n = len(answer.tokens)
    index = torch.arange(answer.prompt_length + 1, n)[:, None] + torch.arange(steps)  # the token each draft predicts
    scored = index < n
    index = index.clamp(max=n - 1)
    truth = torch.tensor(answer.tokens)[index].masked_fill(~scored, -1)
    copyable = torch.tensor(copyable_positions(answer.tokens))[index] & scored
    rule_right = (torch.tensor(last_occurrence_guesses(answer.tokens))[index] == truth) & scored
    return Positions(answer.prompt_length - 1, truth, scored, copyable, rule_right)


# ---------------------------------------------------------------- the drafter's chains


@dataclass
class ChainTrace:
    """A drafter's chains over one sequence: a row per context (row p ends with x_{p+1}), a
    column per draft step. Every tensor is [rows, steps]."""

    drafts: torch.Tensor  # target ids
    attention_drafts: torch.Tensor  # the target ids the attention output alone reads as
    state_rms: torch.Tensor  # RMS of the fed-back state
    state_max: torch.Tensor  # its largest |value|


@torch.no_grad()
def chain_trace(drafter, features: torch.Tensor, tokens: Sequence[int], steps: int) -> ChainTrace:
    """``drafter.propose`` over one sequence (``features`` [1, n, ·] of its n ``tokens``), with
    the draft layer's attention output and its output (the fed-back state) of every step
    captured by forward hooks: the drafter's own code, unchanged, is what is measured."""
    attention: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    hooks = [drafter.midlayer.self_attn.register_forward_hook(lambda _m, _i, out: attention.append(out[0])),
             drafter.midlayer.register_forward_hook(lambda _m, _i, out: states.append(out[0]))]
    try:
        ids = torch.tensor([list(tokens)])
        drafts = drafter.propose(features[:, :-1], ids[:, 1:], steps)[0]
    finally:
        for hook in hooks:
            hook.remove()
    attention_logits = drafter.lm_head(drafter.norm(torch.stack(attention, 1)))
    state = torch.stack(states, 1).float()
    return ChainTrace(drafts, drafter.draft_to_target(attention_logits.argmax(-1)),
                      state.pow(2).mean(-1).sqrt(), state.abs().amax(-1))


def scored_records(positions: Positions, trace: ChainTrace) -> dict[str, torch.Tensor]:
    """One answer's outcomes per scored position [rows, steps]: its labels beside the drafter's."""
    rows = slice(positions.first_row, positions.first_row + len(positions.truth))
    right = (trace.drafts[rows] == positions.truth) & positions.scored
    right_so_far = right.long().cumprod(-1).bool()
    earlier_right = torch.cat([torch.ones_like(right[:, :1]), right_so_far[:, :-1]], -1)
    return {"scored": positions.scored, "copyable": positions.copyable, "rule_right": positions.rule_right,
            "right": right, "earlier_right": earlier_right & positions.scored,
            "attention_right": (trace.attention_drafts[rows] == positions.truth) & positions.scored,
            "state_rms": trace.state_rms[rows], "state_max": trace.state_max[rows]}


# ---------------------------------------------------------------- summaries


def share(hits: torch.Tensor, mask: torch.Tensor) -> float | None:
    """The share of ``hits`` among the positions of ``mask``; None where there are none."""
    return round(hits[mask].float().mean().item(), 4) if mask.any() else None


def significant(value: torch.Tensor) -> float:
    """A magnitude to 4 significant digits."""
    return float(f"{value.item():.4g}")


def step_summary(records: dict[str, torch.Tensor], step: int) -> dict:
    """Draft step ``step`` over every answer's records (``scored_records``, concatenated)."""
    column = {key: value[:, step] for key, value in records.items()}
    scored = column["scored"]
    masks = {"copyable": column["copyable"], "other": scored & ~column["copyable"], "all": scored}
    summary = {split: {"positions": int(mask.sum()), "accuracy": share(column["right"], mask),
                       "accuracy_after_right_drafts": share(column["right"], mask & column["earlier_right"]),
                       "attention_accuracy": share(column["attention_right"], mask)}
               for split, mask in masks.items()}
    summary["copyable"]["rule_accuracy"] = share(column["rule_right"], masks["copyable"])
    summary["state"] = {"rms_median": None, "max_abs": None}
    if scored.any():
        summary["state"] = {"rms_median": significant(column["state_rms"][scored].median()),
                            "max_abs": significant(column["state_max"][scored].max())}
    return summary


def measure(drafter, answers: list[Answer], features_of: Callable, steps: int) -> list[dict]:
    """One summary per draft step of ``drafter`` over ``answers``; ``features_of(answer,
    layer_ids)`` is the target's features of the answer at those layers [1, n, ·]."""
    records = [scored_records(answer_positions(answer, steps),
                              chain_trace(drafter, features_of(answer, drafter.aux_layer_ids), answer.tokens, steps))
               for answer in answers]
    joined = {key: torch.cat([r[key] for r in records]) for key in records[0]}
    return [step_summary(joined, step) for step in range(steps)]


# ---------------------------------------------------------------- the models and the answers


def check_counts(args: argparse.Namespace) -> None:
    """Refuse a count below 1 in one line naming its flag, before anything loads."""
    for flag in ("--steps", "--prompts-per-category", "--max-tokens"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise EDSDError(f"{flag} must be at least 1, got {value}")


def drafter_paths(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The target and the drafters to measure (the demo's where no target is given), each
    drafter directory checked before anything loads."""
    from vllm_edsd.checkpoint.target import read_config_json

    from .arguments import models_or_demo

    target, paths = models_or_demo(args.target, {m: getattr(args, m) for m in DRAFTERS if getattr(args, m)})
    if not paths:
        raise EDSDError(f"no drafter to measure: pass --{EDSD} and/or --{EAGLE3}")
    for method, path in paths.items():
        try:
            read_config_json(path)
        except EDSDError as exc:
            raise EDSDError(f"--{method}: {exc}") from None
    return target, {method: paths[method] for method in DRAFTERS if method in paths}


def load_drafters(paths: dict[str, str], target_model) -> dict:
    """Each drafter in float32, sharing the target's embedding, checked against the target."""
    from vllm_edsd.features.hidden_states import decoder_of, fingerprint

    embed = decoder_of(target_model).embed_tokens.weight
    drafters = {}
    for method, path in paths.items():
        drafters[method] = METHODS[method].model.from_pretrained(path, embed_tokens=embed)
        drafters[method].config.check_target(fingerprint(target_model), drafter=f"--{method} {path}",
                                             aux_layer_ids=drafters[method].aux_layer_ids)
    return drafters


def held_out_answers(target_model, tokenizer, per_category: int, max_tokens: int) -> list[Answer]:
    """The target's greedy answers to the bench's held-out prompts, ``per_category`` of each
    category, in its chat template."""
    from vllm_edsd.data import template_ids
    from vllm_edsd.regeneration.greedy import greedy_answer_ids

    from .offline import load_prompts

    prompts = [template_ids(tokenizer, chat, generation_prompt=True)
               for category in CATEGORIES for chat in load_prompts(category, per_category)]
    answers = greedy_answer_ids(target_model, tokenizer, prompts, max_tokens)
    return [Answer(len(prompt), prompt + answer) for prompt, answer in zip(prompts, answers)]


def target_features(target_model, answer: Answer, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target's features of one answer at ``layer_ids`` (its forward stopped at the last)."""
    from vllm_edsd.features.hidden_states import run_target

    return run_target(target_model, torch.tensor([answer.tokens]), layer_ids, outputs=False).features(layer_ids)


def measured(args: argparse.Namespace) -> dict:
    """Answer the prompts, measure every drafter, and return the results file's content."""
    from transformers import AutoTokenizer

    from vllm_edsd.launch.transformers_target import load_target

    check_counts(args)
    target, paths = drafter_paths(args)
    target_model = load_target(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    drafters = load_drafters(paths, target_model)
    answers = held_out_answers(target_model, tokenizer, args.prompts_per_category, args.max_tokens)
    return {
        "command": args.command, "machine": machine(), "dtype": "float32", "target": target,
        "prompts": f"the bench's held-out prompts, {args.prompts_per_category} per category ({', '.join(CATEGORIES)}), "
                   f"answered greedily by the target (transformers, batched, chat template), at most "
                   f"{args.max_tokens} tokens, ending at its end of sequence",
        "answers": len(answers), "answer_tokens": sum(len(a.tokens) - a.prompt_length for a in answers),
        "drafters": {method: {"path": paths[method], "aux_layer_ids": list(drafter.aux_layer_ids),
                              "steps": measure(drafter, answers, partial(target_features, target_model), args.steps)}
                     for method, drafter in drafters.items()},
    }


# ---------------------------------------------------------------- the report


def accuracy(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def magnitude(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def first_draft_table(results: dict) -> list[str]:
    """Step-0 accuracy per split, each drafter beside the copy rule."""
    methods = list(results["drafters"])
    first = {method: results["drafters"][method]["steps"][0] for method in methods}
    counts = first[methods[0]]
    labels = {"copyable": "the next bigram already occurred earlier in the context", "other": "it did not",
              "all": "all"}
    lines = ["| answer positions | positions | share | " + " | ".join(METHODS[m].label for m in methods)
             + ' | the rule "copy what followed the last occurrence" |',
             "|---|---|---|" + "---|" * len(methods) + "---|"]
    for split in SPLITS:
        positions = counts[split]["positions"]
        portion = f"{100 * positions / max(counts['all']['positions'], 1):.0f} %"
        lines.append(f"| {labels[split]} | {positions:,} | {portion} | "
                     + " | ".join(accuracy(first[m][split]["accuracy"]) for m in methods)
                     + f" | {accuracy(counts[split].get('rule_accuracy'))} |")
    return lines


def step_table(results: dict) -> list[str]:
    """Every draft step of every drafter: accuracy per split, after right drafts, the attention
    output alone, the fed-back state."""
    lines = ["| drafter | step | accuracy: copyable / other / all | all, where the earlier drafts were right "
             "| attention output alone: copyable / other / all | fed-back state: median RMS | max abs value |",
             "|---|---|---|---|---|---|---|"]
    for method, measured in results["drafters"].items():
        for step, summary in enumerate(measured["steps"]):
            state = summary["state"]
            lines.append(f"| {METHODS[method].label} | {step} | "
                         + " / ".join(accuracy(summary[s]["accuracy"]) for s in SPLITS)
                         + f" | {accuracy(summary['all']['accuracy_after_right_drafts'])} | "
                         + " / ".join(accuracy(summary[s]["attention_accuracy"]) for s in SPLITS)
                         + f" | {magnitude(state['rms_median'])} | {magnitude(state['max_abs'])} |")
    return lines


def render(results: dict) -> str:
    machine = results["machine"]
    layers = "; ".join(f"{METHODS[m].label} {tuple(d['aux_layer_ids'])} ({d['path']})"
                       for m, d in results["drafters"].items())
    return "\n".join([
        "# Copying from the context: first drafts where the text repeats and elsewhere", "",
        f"Command: `{results['command']}`  ",
        f"Machine: {describe(machine)}; target and "
        f"drafters in {results['dtype']}, transformers (no vLLM).  ",
        f"Answers: {results['prompts']}: {results['answers']} answers, {results['answer_tokens']:,} answer tokens.  ",
        f"Drafters and their target layers (vLLM's convention): {layers}.", "",
        "A position is a context whose next token is an answer token after the first; it is copyable where that "
        "token's bigram already occurred earlier in the context.", "",
        "## First draft (TTT step 0), from the target's real features", "",
        *first_draft_table(results), "",
        "## Per draft step, the chain as served", "",
        "Step k is fed the drafter's own earlier drafts and fed-back state (`propose`) and scored against the "
        "token k + 1 ahead. The attention output alone is the draft layer's `self_attn` output (before the "
        "residual add) read through the final norm and the LM head. The fed-back state is the draft layer's "
        "output, which step k + 1 reads: the median of its per-position RMS, and its largest absolute value.", "",
        *step_table(results), ""])


def run(args: argparse.Namespace) -> int:
    """Measure, write results.json and report.md into --out, print the report."""
    results = measured(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = render(results)
    (out / "report.md").write_text(report)
    print(report)
    print(f"written to {out}")
    return 0
