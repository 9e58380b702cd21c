"""``python -m bench serve``: vLLM's own client, ``vllm bench serve``, against servers started
as a user starts them: the server's default sampling (no temperature sent: the target's
generation config, else T=1), one request at a time, ShareGPT prompts the shipped drafters
never saw.

For every ``--dtypes`` entry it starts the server without speculation, then once per
``--speculative-config``, runs ``vllm bench serve`` (openai-chat) against each, and reads the
spec-decode counters from ``/metrics``. ``auto`` is the server's default dtype (vLLM resolves it
from the target's config). DIR/results.json, DIR/report.md, and each server's log and
``vllm bench serve`` result file.

``--rounds N`` starts every server N times, every other round in reverse order, and reports each
server's tok/s over its rounds and per round.

The prompts: the shipped drafters trained on the first user turn of every usable ShareGPT
conversation of the PyPI wheel, so the held-out prompts are later user turns (each with the
assistant turn after it, which ``vllm bench serve`` reads as the reference answer).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.registry import EDSD

from .arguments import models_or_demo
from .machine import describe, machine

SUITE = "serve"
NONE = "none"
DTYPES = ("auto", "float32", "bfloat16")
MIN_TURN_CHARS = 64  # shorter later turns are mostly "continue" or "thanks"


def held_out_sharegpt(count: int, seed: int = 0) -> list[dict]:
    """``count`` ShareGPT records in the format ``vllm bench serve`` reads (a human turn, then the
    assistant's), each a user turn after a conversation's first, unlike every first user turn."""
    from vllm_edsd.data import load_sharegpt

    conversations = load_sharegpt(None, seed)
    first_turns = {next((m["content"].strip() for m in c if m["role"] == "user"), "") for c in conversations}
    records: list[dict] = []
    for conversation in conversations:
        later = [(a, b) for a, b in zip(conversation[1:], conversation[2:])
                 if a["role"] == "user" and b["role"] == "assistant" and b["content"].strip()]
        for user, assistant in later:
            text = user["content"].strip()
            if len(text) >= MIN_TURN_CHARS and text not in first_turns:
                records.append({"id": f"held-out-{len(records)}", "conversations": [
                    {"from": "human", "value": text}, {"from": "gpt", "value": assistant["content"]}]})
                break  # one turn per conversation
        if len(records) == count:
            return records
    raise EDSDError(f"ShareGPT holds {len(records)} later user turns of at least {MIN_TURN_CHARS} characters; "
                    f"{count} requested")


def client_command(base: str, target: str, dataset: Path, args: argparse.Namespace, result: Path) -> list[str]:
    """``vllm bench serve`` as a user runs it: openai-chat, the server's sampling, one request at a time."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai-chat", "--base-url", base, "--endpoint", "/v1/chat/completions",
            "--model", target, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--num-prompts", str(args.num_prompts), "--sharegpt-output-len", str(args.output_len),
            "--max-concurrency", "1", "--seed", str(args.seed), "--disable-tqdm",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def measure(args: argparse.Namespace, dataset: Path, label: str, spec: dict | None, dtype: str,
            turn: int = 1) -> dict:
    """One server: start it, run the client, read its counters, stop it (``turn``: its round)."""
    from vllm_edsd.launch.server import running_server, served_spec_counters

    out = Path(args.out)
    suffix = f"-round{turn}" if args.rounds > 1 else ""
    name = re.sub(r"[^\w.=-]+", "_", f"{label}-{dtype}{suffix}")  # a file name without spaces
    with running_server(args.target, spec, extra_args=["--dtype", dtype], log_path=out / f"server-{name}.log",
                        eager=args.eager) as base:
        before = served_spec_counters(base)
        result = out / f"client-{name}.json"
        client = subprocess.run(client_command(base, args.target, dataset, args, result),
                                capture_output=True, text=True)
        if client.returncode != 0:
            raise EDSDError(f"vllm bench serve failed against {name}: {client.stderr.strip()[-500:]}")
        counters = served_spec_counters(base) - before
    served_dtype = _served_dtype(out / f"server-{name}.log")
    measured = json.loads(result.read_text())
    return {"label": label, "speculative_config": spec, "dtype": dtype, "served_dtype": served_dtype,
            **{key: measured.get(key) for key in ("completed", "total_output_tokens", "duration",
                                                   "output_throughput", "mean_tpot_ms", "mean_ttft_ms")},
            "counters": counters.as_dict()}


def _served_dtype(log: Path) -> str | None:
    """The dtype vLLM's start-up line says the model was served in."""
    for line in log.read_text(errors="replace").splitlines():
        if "dtype=torch." in line:
            return line.split("dtype=torch.", 1)[1].split(",", 1)[0]
    return None


def render(results: dict) -> str:
    """Output tok/s per server, against none at the same dtype and against none at the first;
    over several rounds, each server's rounds together and one by one."""
    machine, servers = results["machine"], over_rounds(results["runs"])
    rounds = max(len(s["rounds"]) for s in servers)
    default_none = next((s["output_throughput"] for s in servers if s["label"] == NONE), None)
    per_round = " | tok/s per round" if rounds > 1 else ""
    lines = ["# `vllm bench serve` at the server's defaults", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {describe(machine)}{'; servers eager (--enforce-eager)' if results.get('eager') else ''}.  ",
             f"Client: `vllm bench serve`, openai-chat, {results['num_prompts']} held-out ShareGPT prompts, "
             f"{results['output_len']} tokens each at most, one request at a time, the server's sampling"
             + (f"; every server {rounds} times, in alternating order, its tok/s over the rounds its tokens over "
                "its time." if rounds > 1 else "."), "",
             f"| server | dtype asked (served) | output tok/s{per_round} | against none, same dtype "
             "| against none, first dtype | τ per draft | mean TPOT |",
             "|---|---|---|---|---|---|---|" + ("---|" if rounds > 1 else "")]
    for s in servers:
        same = next((o["output_throughput"] for o in servers if o["label"] == NONE and o["dtype"] == s["dtype"]), None)
        tau = s["tau"]
        each = f" | {' / '.join(f'{v:.1f}' for v in s['rounds'])}" if rounds > 1 else ""
        lines.append(f"| {s['label']} | {s['dtype']} ({s['served_dtype'] or '?'}) | "
                     f"{s['output_throughput']:.1f}{each} | {_ratio(s, same)} | {_ratio(s, default_none)} | "
                     f"{f'{tau:.2f}' if tau else '-'} | "
                     f"{s['mean_tpot_ms']:.1f} ms |")
    lines += ["", "Servers: " + "; ".join(f"{label} = `{json.dumps(spec)}`"
                                         for label, spec in results["speculative_configs"].items())]
    return "\n".join(lines) + "\n"


def over_rounds(runs: list[dict]) -> list[dict]:
    """Each server (label and dtype) once, in the order first run: its tok/s over its rounds (their
    output tokens over their time, as ``vllm bench serve`` computes one round's), each round's, τ
    from the rounds' counters together and the rounds' mean TPOT."""
    servers: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        servers.setdefault((run["label"], run["dtype"]), []).append(run)
    merged = []
    for (label, dtype), rows in servers.items():
        throughput = sum(r["total_output_tokens"] for r in rows) / sum(r["duration"] for r in rows)
        drafts = sum(r["counters"]["drafts"] for r in rows)
        tau = 1 + sum(r["counters"]["accepted"] for r in rows) / drafts if drafts else None
        merged.append({"label": label, "dtype": dtype, "served_dtype": rows[0]["served_dtype"],
                       "output_throughput": throughput, "rounds": [r["output_throughput"] for r in rows], "tau": tau,
                       "mean_tpot_ms": sum(r["mean_tpot_ms"] for r in rows) / len(rows)})
    return merged


def _ratio(row: dict, base: float | None) -> str:
    return "-" if row["label"] == NONE or not base else f"{row['output_throughput'] / base:.2f}x"


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments with --dtypes read; a count below 1 or an unknown dtype is refused in one line."""
    for flag in ("num_prompts", "output_len", "rounds"):
        if getattr(args, flag) < 1:
            raise EDSDError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    args.dtypes = args.dtypes.split(",")
    if bad := sorted(set(args.dtypes) - set(DTYPES)):
        raise EDSDError(f"--dtypes: unknown {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    return args


def speculative_configs(args: argparse.Namespace, drafters: dict[str, str]) -> dict[str, dict]:
    """Each server's speculative config by label: the demo's EDSD (``drafters``) at K=4 unless given."""
    from vllm_edsd.launch.engine import speculative_config

    if not args.speculative_config:
        if EDSD not in drafters:
            raise EDSDError("no EDSD drafter to serve: pass --speculative-config")
        return {f"{EDSD} K=4": speculative_config(EDSD, drafters[EDSD], 4)}
    configs = {}
    for text in args.speculative_config:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EDSDError(f"--speculative-config: not JSON ({exc.msg}): {text[:80]}") from None
        if not isinstance(spec, dict) or "method" not in spec:
            raise EDSDError(f"--speculative-config: a JSON object with a method, as vllm serve takes it: {text[:80]}")
        extra = {k: v for k, v in spec.items() if k not in ("method", "model", "num_speculative_tokens")}
        configs[" ".join([spec["method"], f"K={spec.get('num_speculative_tokens', '?')}",
                          *(f"{k}={v}" for k, v in extra.items())])] = spec
    return configs


def run(args: argparse.Namespace) -> int:
    """Every server in turn: none, then each speculative config, at every dtype."""
    args = checked(args)
    args.target, drafters = models_or_demo(args.target, {})
    configs = speculative_configs(args, drafters)
    records = held_out_sharegpt(args.num_prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset = out / "sharegpt-held-out.json"
    dataset.write_text(json.dumps(records, indent=1) + "\n")
    results = {"machine": machine(), "target": args.target, "num_prompts": args.num_prompts,
               "output_len": args.output_len, "command": args.command, "eager": args.eager,
               "speculative_configs": configs, "runs": []}
    servers = [(label, spec, dtype) for dtype in args.dtypes for label, spec in ((NONE, None), *configs.items())]
    # Every other round in reverse, so that a drift of the machine's speed touches every server alike.
    order = [(turn, *server) for turn in range(1, args.rounds + 1)
             for server in (servers if turn % 2 else servers[::-1])]
    # A server that cannot start raises EDSDError: what was measured stays in results.json.
    for turn, label, spec, dtype in tqdm(order, desc="bench serve", unit="server"):
        results["runs"].append({**measure(args, dataset, label, spec, dtype, turn), "round": turn})
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "report.md").write_text(render(results))
    print(render(results))
    print(f"wrote {out / 'results.json'} and {out / 'report.md'}")
    return 0
