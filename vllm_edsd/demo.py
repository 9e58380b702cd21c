"""``edsd demo``: serve the embedded demo target with its EDSD drafter on localhost, print
what it generates, and measure mean acceptance length and tokens/s with and without
speculation (batch size 1, greedy).

The demo pair (a small Llama target and drafters trained for it by this project's own
scripts) ships in ``vllm_edsd/assets/demo``. If it is missing (a checkout without the
assets), the demo says so and falls back to tiny random-weight models made on the spot,
which exercise the serving path but cannot show a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .config import EDSDError

ASSETS = Path(__file__).parent / "assets" / "demo"
CACHE = Path(os.environ.get("EDSD_CACHE", Path.home() / ".cache" / "vllm-edsd"))

DEMO_PROMPTS = [
    ("chat", "What are three tips for staying focused while studying?"),
    ("chat", "Explain what a hash table is to a beginner."),
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
]


def shipped_paths() -> dict[str, str] | None:
    """Paths of the shipped demo pair (``target``, ``edsd``, optional ``eagle3``); None if absent."""
    paths = {name: ASSETS / name for name in ("target", "edsd", "eagle3") if (ASSETS / name / "config.json").is_file()}
    if not {"target", "edsd"} <= set(paths):
        return None
    return {k: str(v.resolve()) for k, v in paths.items()}


def toy_paths() -> dict[str, str]:
    """Stand-ins made on the spot and cached: a 4-layer toy target fitted to a tiny corpus and
    an EDSD drafter trained for it by this package's own `select`/`train`/`convert`."""
    from .cli import main
    from .toy import make_target, toy_corpus

    root = CACHE / "toy-demo"
    if not (root / "edsd" / "config.json").is_file():
        target = make_target(root / "target", seed=3, train_steps=300)
        lines = [l for l in toy_corpus().splitlines() if l.strip()]
        data = root / "corpus.jsonl"
        data.write_text("".join(json.dumps({"text": "\n".join(lines[i : i + 4])}) + "\n" for i in range(len(lines))))
        steps = [
            ["select", str(target), "--data", str(data), "--samples", "16", "--out", str(root / "layers.json")],
            ["train", str(target), "--out", str(root / "run"), "--data", str(data), "--layers-from",
             str(root / "layers.json"), "--draft-vocab-size", "256", "--epochs", "8", "--ttt-steps", "4",
             "--lr", "1e-2", "--max-length", "128"],
            ["convert", str(root / "run" / "final"), str(root / "edsd"), "--target", str(target), "--force"],
        ]
        for argv in steps:
            if main(argv) != 0:
                raise EDSDError(f"building the toy demo failed at `edsd {argv[0]}`")
    return {"target": str(root / "target"), "edsd": str(root / "edsd")}


def demo_paths() -> dict[str, str]:
    """``{"target", "edsd", "eagle3"}`` directories of the demo pair, ready for vLLM."""
    paths = shipped_paths()
    if paths is None:
        raise EDSDError(f"the demo models are not in this installation ({ASSETS} is missing)")
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "examples:\n  edsd demo\n  edsd demo --offline --k 3\n  edsd demo --paths"
    parser.add_argument("--paths", action="store_true", help="print the demo model directories as JSON and exit")
    parser.add_argument("--offline", action="store_true", help="use LLM.generate instead of the OpenAI server")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")


def _chat_server(base: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    import requests

    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    reply = requests.post(f"{base}/v1/chat/completions", json=body, timeout=600).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def _measure_server(target: str, spec: dict | None, max_tokens: int) -> dict:
    import requests

    from .engine import parse_prometheus_counters
    from .server import running_server

    with running_server(target, spec, extra_args=["--served-model-name", "demo"]) as base:
        _chat_server(base, "Hello!", 8)  # warm-up
        before = parse_prometheus_counters(requests.get(f"{base}/metrics", timeout=10).text)
        texts, tokens, start = [], 0, time.time()
        for _, prompt in DEMO_PROMPTS:
            text, n = _chat_server(base, prompt, max_tokens)
            texts.append(text)
            tokens += n
        elapsed = time.time() - start
        counters = parse_prometheus_counters(requests.get(f"{base}/metrics", timeout=10).text) - before
    return {"texts": texts, "tokens_per_s": tokens / elapsed, "counters": counters}


def _measure_offline(target: str, spec: dict | None, max_tokens: int) -> dict:
    from vllm import SamplingParams

    from .engine import llm_session, spec_counters

    with llm_session(target, spec) as llm:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=8), use_tqdm=False)
        before, texts, tokens, start = spec_counters(llm), [], 0, time.time()
        for _, prompt in DEMO_PROMPTS:  # one at a time: batch size 1
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]
            texts.append(out.text)
            tokens += len(out.token_ids)
        return {"texts": texts, "tokens_per_s": tokens / (time.time() - start), "counters": spec_counters(llm) - before}


def run(args: argparse.Namespace) -> int:
    from .engine import speculative_config

    paths = shipped_paths()
    if args.paths:
        if paths is None:
            raise EDSDError(f"the demo models are not in this installation ({ASSETS} is missing)")
        print(json.dumps(paths))
        return 0
    if paths is None:
        print("NOTE: the trained demo pair is not installed. Using a TOY stand-in made on the spot (once, ~2 min):\n"
              "      a 4-layer target fitted to a 40-line corpus and an EDSD drafter trained for it by `edsd select`,\n"
              "      `edsd train` and `edsd convert`. It shows the whole path working, not EDSD's speed: the toy\n"
              "      target is far too small for speculation to pay off on a CPU.\n")
        paths = toy_paths()
    measure = _measure_offline if args.offline else _measure_server
    how = "offline LLM.generate" if args.offline else "OpenAI-compatible server on 127.0.0.1"
    print(f"target: {paths['target']}\nEDSD drafter: {paths['edsd']}\nserving through {how}, K={args.k}, "
          f"greedy, batch size 1 (each engine takes ~40 s to start on CPU)\n")
    edsd = measure(paths["target"], speculative_config("edsd", paths["edsd"], args.k), args.max_tokens)
    for (kind, prompt), text in zip(DEMO_PROMPTS, edsd["texts"]):
        print(f"--- [{kind}] {prompt}\n{text.strip()}\n")
    plain = measure(paths["target"], None, args.max_tokens)
    c = edsd["counters"]
    per_pos = ", ".join(f"{r:.2f}" for r in c.acceptance_per_position)
    print("=" * 60)
    print(f"mean acceptance length (tau): {c.mean_acceptance_length:.2f}  (per position: {per_pos})")
    print(f"tokens/s with EDSD:           {edsd['tokens_per_s']:.1f}")
    print(f"tokens/s without speculation: {plain['tokens_per_s']:.1f}")
    print(f"speed-up:                     {edsd['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    same = sum(a == b for a, b in zip(edsd["texts"], plain["texts"]))
    print(f"outputs identical to the target alone: {same}/{len(DEMO_PROMPTS)} prompts"
          + ("" if same == len(DEMO_PROMPTS) else " (reduced-precision arithmetic can break exact ties)"))
    return 0
