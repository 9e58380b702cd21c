"""``edsd demo``: serve the embedded demo target with its EDSD and EAGLE-3 drafters on
localhost, print what it generates, and measure mean acceptance length and tokens/s with and
without speculation (batch size 1, greedy)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.replies import first_difference
from vllm_edsd.methods.registry import EDSD

from . import DEMO_PROMPTS, DRAFTERS, demo_paths

# The `edsd demo` subcommand (vllm_edsd.command).
name = "demo"
help = "serve the embedded demo target with its EDSD and EAGLE-3 drafters; show tau and speed-up"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"examples:\n  edsd demo\n  edsd demo --offline --k 3 --eager\n  edsd demo --methods {EDSD}\n"
        "  edsd demo --paths"
    )
    parser.add_argument("--paths", action="store_true", help="print the demo model directories as JSON and exit")
    parser.add_argument("--offline", action="store_true", help="use LLM.generate instead of the OpenAI server")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--eager", action="store_true",
                        help="start each engine without torch.compile (vLLM's enforce_eager): a faster start, "
                             "slower steps; the default compiles, as vLLM serves")
    parser.add_argument("--methods", default=",".join(DRAFTERS),
                        help=f"drafters to compare with no speculation (default {','.join(DRAFTERS)})")


# The demo serves float32 on every CPU: its lossless check compares the drafted run with the
# target alone, and bf16 kernels (chosen on CPUs with AVX512-BF16 or AMX) round differently
# for the different batch shapes of verification, which flips near-ties.
DEMO_DTYPE = "float32"
# The KV cache of each demo engine: one reply at a time needs at most the context (2,048 tokens on
# a CPU), and 1 GiB holds about 23,000 tokens of the demo target in float32. vLLM's CPU default, a
# quarter of the machine's memory less the weights (4.1 GiB on a 24-GiB machine), made each EDSD
# engine start 13.6 s longer (58.7 s against 45.1 s, float32, compile cache warm, 2-core AMD EPYC with
# AVX512-BF16). A user's VLLM_CPU_KVCACHE_SPACE still overrides it on a CPU.
DEMO_KV_CACHE_BYTES = 1 << 30


# The prompts are sent this many times after a warm-up; a method's tokens/s is its median round's:
# one round of four replies on a 2-core CPU moves by more than the drafters differ (EDSD against
# EAGLE-3 0.90x to 1.11x in single rounds of fresh clones, docs/results.md "The demo").
ROUNDS = 3
HEARTBEAT_S = 25.0  # the longest the demo stays silent while it works
ENGINE_START = {False: "~1 min on a CPU, more the first time", True: "~30 s on a CPU"}  # keyed by --eager


@contextlib.contextmanager
def heartbeat(what: str, every: float = HEARTBEAT_S, expect: str = "") -> Iterator[None]:
    """Say that ``what`` starts (with how long to ``expect``, once), that it is still going every
    ``every`` seconds, and how long it took: an engine start on a CPU is minutes of vLLM's silence."""
    print(f"edsd demo: {what}{f' ({expect})' if expect else ''}...", flush=True)
    done, start = threading.Event(), time.time()

    def tick() -> None:
        while not done.wait(every):
            print(f"  ... {what}: {time.time() - start:.0f} s", flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    print(f"  {what}: done in {time.time() - start:.0f} s", flush=True)


def _chat_server(base: str, prompt: str, max_tokens: int, top2: bool = False) -> dict:
    """One greedy reply: its text and token ids, and with ``top2`` the target's top-2 logit
    margin at each position (a difference of log-probabilities is one of logits)."""
    from vllm_edsd.launch.server import post_json

    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **({"logprobs": True, "top_logprobs": 2} if top2 else {})}
    choice = post_json(f"{base}/v1/chat/completions", body)["choices"][0]
    reply = {"text": choice["message"]["content"], "token_ids": choice["token_ids"]}
    if top2:
        reply["margins"] = [top[0]["logprob"] - top[1]["logprob"]
                            for top in (entry["top_logprobs"] for entry in choice["logprobs"]["content"])]
    return reply


def _measure_server(name: str, target: str, spec: dict | None, max_tokens: int, eager: bool) -> dict:
    from vllm_edsd.launch.server import running_server, served_spec_counters

    with contextlib.ExitStack() as stack:
        with heartbeat(f"{name}: starting vLLM's server", expect=ENGINE_START[eager]):
            base = stack.enter_context(
                running_server(target, spec, extra_args=["--served-model-name", "demo", "--dtype", DEMO_DTYPE,
                                                         "--kv-cache-memory-bytes", str(DEMO_KV_CACHE_BYTES)],
                               eager=eager))
            _chat_server(base, "Hello!", 8)  # warm-up
        with heartbeat(f"{name}: {len(DEMO_PROMPTS)} prompts, one at a time, {ROUNDS} rounds"):
            before = served_spec_counters(base)
            rounds, speeds = _timed_rounds(lambda: [_chat_server(base, p, max_tokens) for _, p in DEMO_PROMPTS])
            counters = served_spec_counters(base) - before
            margins = ([_chat_server(base, p, max_tokens, top2=True)["margins"] for _, p in DEMO_PROMPTS]
                       if spec is None else None)
    return _result(rounds, speeds, counters, margins)


def _timed_rounds(generate: Callable[[], list[dict]]) -> tuple[list[list[dict]], list[float]]:
    """``generate`` (every demo prompt, one at a time) ``ROUNDS`` times: each round's replies
    and its tokens/s."""
    rounds, speeds = [], []
    for _ in range(ROUNDS):
        start = time.time()
        rounds.append(generate())
        speeds.append(sum(len(r["token_ids"]) for r in rounds[-1]) / (time.time() - start))
    return rounds, speeds


def _result(rounds: list[list[dict]], speeds: list[float], counters, margins: list[list[float]] | None) -> dict:
    """A method's result: the first round's replies, the prompts whose later rounds replied
    otherwise (greedy replies repeat), and the median round's tokens/s."""
    first = [list(r["token_ids"]) for r in rounds[0]]
    unstable = sorted({i for later in rounds[1:] for i, r in enumerate(later) if list(r["token_ids"]) != first[i]})
    return {"texts": [r["text"] for r in rounds[0]], "token_ids": first, "unstable": unstable,
            "tokens_per_s": statistics.median(speeds), "rounds_tokens_per_s": speeds, "counters": counters,
            "margins": margins}


def _measure_offline(name: str, target: str, spec: dict | None, max_tokens: int, eager: bool) -> dict:
    from vllm import SamplingParams

    from vllm_edsd.launch.engine import llm_session, spec_counters

    def chat(prompt: str, params: SamplingParams):
        return llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]

    with contextlib.ExitStack() as stack:
        with heartbeat(f"{name}: starting vLLM's engine", expect=ENGINE_START[eager]):
            llm = stack.enter_context(llm_session(target, spec, dtype=DEMO_DTYPE,
                                                  kv_cache_memory_bytes=DEMO_KV_CACHE_BYTES, enforce_eager=eager))
            chat("Hello!", SamplingParams(max_tokens=8))
        stack.enter_context(heartbeat(f"{name}: {len(DEMO_PROMPTS)} prompts, one at a time, {ROUNDS} rounds"))
        before, greedy = spec_counters(llm), SamplingParams(temperature=0, max_tokens=max_tokens)
        rounds, speeds = _timed_rounds(lambda: [_offline_reply(chat(p, greedy)) for _, p in DEMO_PROMPTS])
        counters = spec_counters(llm) - before
        margins = None
        if spec is None:
            scored = [
                chat(p, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)) for _, p in DEMO_PROMPTS
            ]
            margins = [[_top2_margin([lp.logprob for lp in step.values()]) for step in out.logprobs] for out in scored]
    return _result(rounds, speeds, counters, margins)


def _offline_reply(output) -> dict:
    return {"text": output.text, "token_ids": output.token_ids}


def _top2_margin(logprobs: list[float]) -> float:
    """Best minus second-best (vLLM may list the sampled token beside the top 2)."""
    best, second = sorted(logprobs, reverse=True)[:2]
    return best - second


def _check_replies_fit(target: str, max_tokens: int) -> None:
    """Refuse a ``--max-tokens`` that the demo's engines cannot hold beside its longest prompt,
    before any engine starts: vLLM would refuse every request, but only after its start-up."""
    from vllm_edsd.checkpoint.target import context_length
    from vllm_edsd.launch.engine import cpu_max_model_len, on_cpu

    from . import check_prompt_ids

    context = cpu_max_model_len(target) if on_cpu() else context_length(target)
    longest = max(len(ids) for ids in check_prompt_ids(target))
    if context is not None and longest + max_tokens > context:
        raise EDSDError(f"--max-tokens {max_tokens} does not fit: the demo's engines hold {context} tokens and its "
                        f"longest prompt takes {longest}, which leaves at most {context - longest}")


def run(args: argparse.Namespace) -> int:
    from vllm_edsd.launch.engine import speculative_config

    paths = demo_paths()
    if args.paths:
        print(json.dumps(paths))
        return 0
    if args.k < 1 or args.max_tokens < 1:
        raise EDSDError(f"--k and --max-tokens must be positive, got {args.k} and {args.max_tokens}")
    _check_replies_fit(paths["target"], args.max_tokens)
    measure = _measure_offline if args.offline else _measure_server
    how = "offline LLM.generate" if args.offline else "OpenAI-compatible server on 127.0.0.1"
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(DRAFTERS))
    if unknown or not methods:
        raise EDSDError(f"--methods: expected {' and/or '.join(DRAFTERS)}, got {args.methods!r}")
    print(f"target: {paths['target']}\n" + "".join(f"{m} drafter: {paths[m]}\n" for m in methods)
          + f"serving through {how}, {DEMO_DTYPE}, K={args.k}, greedy, batch size 1; one engine per method "
          f"(each starts in {ENGINE_START[args.eager]}{'' if args.eager else ': torch.compile'})\n")
    results = {"none": measure("none", paths["target"], None, args.max_tokens, args.eager)}
    for method in methods:
        results[method] = measure(
            method, paths["target"], speculative_config(method, paths[method], args.k), args.max_tokens, args.eager
        )
    shown = EDSD if EDSD in results else methods[0]
    for (kind, prompt), text in zip(DEMO_PROMPTS, results[shown]["texts"]):
        print(f"--- [{kind}] {prompt}\n{text.strip()}\n")
    print(summary(results, args.k, args.eager))
    return 0


def differences(results: dict[str, dict]) -> list[str]:
    """One line per reply that differs from the target's: where, and how close the target's
    own choice was there (a top-2 logit margin near 0 is a tie that rounding can break)."""
    plain, lines = results["none"], []
    margins = plain.get("margins") or [[] for _ in plain["token_ids"]]
    for method, r in results.items():
        lines += [f"{method}: prompt {i + 1}'s greedy reply changed between rounds" for i in r.get("unstable", ())]
        for i, (ids, reference) in enumerate(zip(r["token_ids"], plain["token_ids"])):
            position = None if method == "none" else first_difference(ids, reference)
            if position is None:
                continue
            margin = f"{margins[i][position]:.4f}" if position < len(margins[i]) else "-"
            lines.append(f"{method}: prompt {i + 1} differs from the target alone first at token {position}; "
                         f"the target's top-2 logit margin there is {margin}")
    return lines


def summary(results: dict[str, dict], k: int, eager: bool = False) -> str:
    """One table: tau, acceptance per position, tokens/s and speed-up against no speculation,
    and where a reply differs from the target's, why; ``eager``: the engines ran without
    torch.compile, which the note says."""
    plain = results["none"]
    rows = [f"{'method':<8}{'tau':>6}  {'acceptance per position':<26}{'tokens/s':>9}{'speed-up':>10}  same text"]
    for method, r in results.items():
        c = r.get("counters")
        tau = "-" if method == "none" else f"{c.mean_acceptance_length:.2f}"
        per_pos = "-" if method == "none" else " ".join(f"{a:.2f}" for a in c.acceptance_per_position)
        if method == "none":
            same = "-"
        else:
            unstable = set(r.get("unstable", ()))
            equal = sum(first_difference(a, b) is None and i not in unstable
                        for i, (a, b) in enumerate(zip(r["token_ids"], plain["token_ids"])))
            same = f"{equal}/{len(DEMO_PROMPTS)}"
        rows.append(f"{method:<8}{tau:>6}  {per_pos:<26}{r['tokens_per_s']:>9.1f}"
                    f"{r['tokens_per_s'] / plain['tokens_per_s']:>9.2f}x  {same}")
    rule = "=" * len(rows[0])
    engines = ", eager (no torch.compile)" if eager else ""
    note = (f"{DEMO_DTYPE}{engines}, K={k}, temperature 0, batch size 1, {len(DEMO_PROMPTS)} prompts (chat and code) "
            f"not seen in training, sent {ROUNDS} times; tokens/s: the median round's.\n'same text': token ids "
            "identical to the target alone's, in every round.")
    rounds = [f"{method} {' '.join(f'{v:.1f}' for v in r['rounds_tokens_per_s'])}"
              for method, r in results.items() if r.get("rounds_tokens_per_s")]
    spread = [f"tokens/s per round: {'; '.join(rounds)}"] if rounds else []
    return "\n".join([rule, *rows, rule, note, *spread, *differences(results)])
