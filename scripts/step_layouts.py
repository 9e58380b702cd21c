"""A batch-1 decode step per method, as vLLM's process layouts run it on a CPU.

``python scripts/step_layouts.py [--methods none,eagle3,edsd] [--layouts serving,all-cores,in-process]``

The same greedy float32 generations (the bench's first 2 chat and 2 math prompts, 128 tokens
ignoring EOS, 3 rounds, one prompt at a time, after one untimed warm-up) by one ``vllm.LLM``
per (method, layout), each in a fresh process:

* ``serving``: vLLM's default, three processes (front end, engine core, worker) handing each
  step over through shared memory, the worker computing on the cores vLLM leaves it after
  reserving one for serving (``VLLM_CPU_NUM_OF_RESERVED_CPU``);
* ``all-cores``: the same three processes, nothing reserved (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``);
* ``in-process``: engine core and worker in the caller's process and thread
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as ``python -m bench step-cost`` runs them.

Prints tok/s, ms per decode step (wall time over drafts, or over tokens without a drafter) and
τ for each. The demo pair (K=4) by default; ``--target`` and ``--eagle3``/``--edsd`` for others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package, from a checkout

LAYOUTS = {"serving": {}, "all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
           "in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def drafts(llm) -> float:
    """vLLM's count of drafts so far (one per decode step that drafted)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")


def measure(job: dict) -> dict:
    """One (method, layout): the timed rounds' tokens, drafts and wall time."""
    from vllm import LLM, SamplingParams

    from bench.offline import load_prompts

    spec = job["drafter"] and {"method": job["method"], "model": job["drafter"], "num_speculative_tokens": job["k"]}
    llm = LLM(job["target"], dtype="float32", gpu_memory_utilization=0.25, max_model_len=2048, seed=0,
              speculative_config=spec or None, disable_log_stats=False)
    conversations = load_prompts("chat", 2) + load_prompts("math", 2)
    llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    sampling = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    tokens, wall, before = 0, 0.0, drafts(llm)
    for _ in range(job["rounds"]):
        for conversation in conversations:
            began = time.perf_counter()
            tokens += len(llm.chat(conversation, sampling, use_tqdm=False)[0].outputs[0].token_ids)
            wall += time.perf_counter() - began
    steps = (drafts(llm) - before) or tokens
    return {"tok_s": tokens / wall, "ms_per_step": 1000 * wall / steps, "tau": tokens / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="none,eagle3,edsd")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--target", help="the target's directory (default: the embedded demo target)")
    parser.add_argument("--eagle3", help="EAGLE-3 drafter (default: the demo's)")
    parser.add_argument("--edsd", help="EDSD drafter (default: the demo's)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one measurement, in the child process
    args = parser.parse_args()
    if args.job:
        print("RESULT " + json.dumps(measure(json.loads(args.job))), flush=True)
        return
    from bench.arguments import models_or_demo

    given = {m: d for m, d in (("eagle3", args.eagle3), ("edsd", args.edsd)) if d}
    target, drafters = models_or_demo(args.target, given)
    print(f"float32, T=0, batch 1, K={args.k}, {args.max_tokens} tokens, {args.rounds} rounds of 4 prompts")
    print(f"{'method':8s} {'layout':11s} {'tok/s':>7s} {'ms/step':>8s} {'tau':>6s}")
    for method in args.methods.split(","):
        for layout in args.layouts.split(","):
            job = {"method": method, "drafter": drafters.get(method), "target": target, "k": args.k,
                   "max_tokens": args.max_tokens, "rounds": args.rounds}
            out = subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], capture_output=True,
                                 text=True, env={**os.environ, **LAYOUTS[layout]})
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{method} {layout} failed:\n{out.stderr[-2000:]}")
            r = json.loads(line[7:])
            print(f"{method:8s} {layout:11s} {r['tok_s']:7.1f} {r['ms_per_step']:8.1f} {r['tau']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
