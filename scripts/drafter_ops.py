"""Where one drafter forward goes, op by op, in a real vLLM engine on a CPU.

``python scripts/drafter_ops.py [--methods edsd,eagle3] [--prompt TEXT] [--max-tokens 64]``

One ``vllm.LLM`` per method (float32, K=4, batch 1, greedy, the demo pair unless
``--edsd``/``--eagle3`` name other drafters), each in a fresh process with the engine core and
worker in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). After one untimed generation, torch's
profiler records a second; every call of the drafter model's ``forward`` is marked, and the
ops that ran inside the marks are summed. Prints the drafter forward's mean wall time and, per
op, its own CPU time per forward and calls per forward: the matrix products (``_C::onednn_mm``,
vLLM's oneDNN kernel), the compiled graph's fused kernels (``Call CompiledFxGraph``), attention
and the rest. The profiler's own cost is in every figure, so compare methods, not absolutes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "DRAFTER_FORWARD"


def _mark_forwards(worker) -> str:
    """Wrap the drafter model's ``forward`` in a profiler mark; its class name."""
    import torch

    model = worker.model_runner.drafter.model
    forward = model.forward

    def marked(*args, **kwargs):
        with torch.profiler.record_function(MARK):
            return forward(*args, **kwargs)

    model.forward = marked
    return type(model).__name__


def ops_inside(events) -> tuple[int, float, collections.Counter, collections.Counter]:
    """(forwards, wall ms per forward, self CPU µs per op name, calls per op name) of the ops
    that ran inside the marked forwards, on the marked forward's thread."""
    marks = [e for e in events if e.name == MARK]
    spans = [(e.time_range.start, e.time_range.end, e.thread) for e in marks]
    self_us, calls = collections.Counter(), collections.Counter()
    for event in events:
        if event.name == MARK:
            continue
        for start, end, thread in spans:
            if event.thread == thread and start <= event.time_range.start and event.time_range.end <= end:
                self_us[event.name] += event.self_cpu_time_total
                calls[event.name] += 1
                break
    wall_ms = sum(e.cpu_time_total for e in marks) / 1000 / max(len(marks), 1)
    return len(marks), wall_ms, self_us, calls


def profile(method: str, drafter: str, prompt: str, max_tokens: int) -> dict:
    """One engine's profile of ``method``'s drafter forwards (runs in the child process)."""
    import torch
    from vllm import SamplingParams

    from vllm_edsd.demo.target import demo_target
    from vllm_edsd.launch.engine import make_llm

    spec = {"method": method, "model": drafter, "num_speculative_tokens": 4}
    llm = make_llm(str(demo_target()), spec, dtype="float32")
    model_class = llm.collective_rpc(_mark_forwards)[0]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    forwards, wall_ms, self_us, calls = ops_inside(prof.events())
    ops = [{"op": name, "ms_per_forward": us / 1000 / forwards, "calls_per_forward": calls[name] / forwards}
           for name, us in self_us.most_common()]
    return {"method": method, "class": model_class, "forwards": forwards, "wall_ms": wall_ms, "ops": ops}


def print_profile(result: dict, top: int = 8) -> None:
    print(f"{result['method']} ({result['class']}): {result['forwards']} forwards, "
          f"{result['wall_ms']:.3f} ms each")
    for op in result["ops"][:top]:
        print(f"  {op['op'][:58]:58s} {op['ms_per_forward']:6.3f} ms  x{op['calls_per_forward']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="edsd,eagle3")
    parser.add_argument("--edsd", default=str(ROOT / "vllm_edsd/assets/demo/edsd"))
    parser.add_argument("--eagle3", default=str(ROOT / "vllm_edsd/assets/demo/eagle3"))
    parser.add_argument("--prompt", default="Explain how a hash map works, with an example in Python.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one method, in this process
        print(json.dumps(profile(args.child, getattr(args, args.child), args.prompt, args.max_tokens)))
        return
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for method in args.methods.split(","):
        command = [sys.executable, __file__, "--child", method, "--edsd", args.edsd, "--eagle3", args.eagle3,
                   "--prompt", args.prompt, "--max-tokens", str(args.max_tokens)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"{method}: the engine failed:\n{done.stderr[-2000:]}")
        print_profile(json.loads(done.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
