"""``report.md`` and the plots, rendered from ``results.json`` alone."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _dtype(row: dict) -> str:
    """A row's dtype; rows from before it was recorded say so."""
    return row.get("dtype", "not recorded")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _load(machine: dict) -> str:
    """The load average when the results were written (absent from older results)."""
    load = machine.get("load_average")
    return "" if load is None else f"; load average (1/5/15 min) when written: {' / '.join(map(str, load))}"


def _draft_cost(rows: list[dict]) -> list[str]:
    """The draft-cost tables: timings, then each draft's parts (bench/draft_cost.py)."""
    out = ["\n## Draft-step cost (batch 1, greedy; vLLM's profiler)\n\n"
           "t_target: the target's forward in a decode step (K+1 tokens with a drafter, 1 without); t_draft: "
           "vLLM's draft scope (K drafter forwards and their bookkeeping); medians over the decode steps of one "
           "profiled generation, both from the same engine.\n"]
    out.append(_table(
        ["method", "K", "mode", "dtype", "steps", "t_target ms", "t_draft ms", "t_draft / t_target",
         "per draft forward / t_target"],
        [[r["method"], str(r["k"]), r["mode"], r["dtype"], str(r["steps"]), _fmt(r["t_target_ms"]),
          _fmt(r.get("t_draft_ms")), _fmt(r.get("draft_over_target"), ".3f"),
          _fmt(r.get("per_draft_forward_over_target"), ".3f")] for r in rows]))
    split = [r for r in rows if "draft_parts_ms" in r]
    if split:
        names = list(split[0]["draft_parts_ms"])
        out.append("\n### Where a draft step goes (ms per step)\n\nFrom a second engine whose profiler also "
                   "records Python calls; that slows Python more than kernels, so its t_draft is above the one "
                   "above. Plugin hooks: time in vllm-edsd's own frames outside the drafter's forward.\n")
        out.append(_table(
            ["method", "K", "mode", "dtype", "traced t_draft", "forwards", *names],
            [[r["method"], str(r["k"]), r["mode"], r["dtype"], _fmt(r["traced_t_draft_ms"]),
              _fmt(r["drafter_forwards"], "g"), *(_fmt(r["draft_parts_ms"][n]) for n in names)] for r in split]))
    return out


def _step_cost(rows: list[dict]) -> list[str]:
    """The step-cost tables: one per batch size, a column per method, a row per part of the
    decode step, then their sum against the measured step (bench/step_cost.py)."""
    out = ["\n## The whole decode step by part (ms per step; engine core in the bench's process)\n\n"
           "Means over the decode steps of three generations whose scopes read the clock; the draft's parts and "
           "the plugin hooks' share from one more under vLLM's profiler recording Python calls. step: the steps' "
           "start-to-start wall time; overhead: the timed generations' median wall time over the unprofiled "
           "ones'; timing cost: the scopes' own cost per step, measured apart, over the step (`python -m bench "
           "step-cost --help` defines every part).\n"]
    temperatures = sorted({r.get("temperature", 0.0) for r in rows})
    for batch, temperature in itertools.product(sorted({r["batch_size"] for r in rows}), temperatures):
        at = [r for r in rows if r["batch_size"] == batch and r.get("temperature", 0.0) == temperature]
        names = list(at[0]["parts_ms"])
        figures = [(name, lambda r, name=name: _fmt(r["parts_ms"][name], ".3f")) for name in names] + [
            ("**sum**", lambda r: _fmt(r["sum_ms"], ".3f")), ("**step**", lambda r: _fmt(r["step_ms"], ".3f")),
            ("sum / step", lambda r: _fmt(r["sum_over_step"], ".1%")), ("steps", lambda r: str(r["steps"])),
            ("overhead", lambda r: _fmt(r["overhead"], "+.1%")),
            ("timing cost", lambda r: _fmt(r.get("timing_cost_share"), ".2%"))]
        out.append(f"\n### Batch {batch}" + (f", T={temperature:g}" if temperatures != [0.0] else "") + "\n")
        out.append(_table(["part", *(f"{r['method']} K={r['k']}" if r["method"] != "none" else "none" for r in at)],
                          [[name, *(cell(r) for r in at)] for name, cell in figures]))
    return out


def _reply_length(config: dict) -> str:
    """How long each reply was: results written before --stop-at-eos always ignored EOS."""
    if config.get("ignore_eos", True):
        return "replies: every one generated to max_tokens (ignore_eos), past the model's end of answer"
    return "replies: each ended at the model's end of sequence (--stop-at-eos), or at max_tokens"


def _engines_dtype(runs: list[dict], machine: dict) -> str:
    """The one dtype every row ran in, or this machine's default where rows differ (draft-cost)."""
    dtypes = {r["dtype"] for r in runs if r.get("dtype")}
    if len(dtypes) == 1:
        return f"engines' dtype: {dtypes.pop()}"
    return f"engines' dtype: {machine.get('default_dtype', '?')} by default (each row names its own)"


def _same_replies(row: dict) -> str:
    """How many replies equal no speculation's at T=0, as "6/8" ("–" where not compared)."""
    same = row.get("same_replies")
    return "–" if same is None else f"{same}/{len(row['reply_digests'])}"


# A table column: its header, and how a row's cell reads.
Column = tuple[str, Callable[[dict], str]]

METHOD: Column = ("method", lambda r: r["method"])
K: Column = ("K", lambda r: str(r["k"]))
T: Column = ("T", lambda r: _fmt(r["temperature"], ".0f"))
DTYPE: Column = ("dtype", _dtype)
TAU: Column = ("τ", lambda r: _fmt(r["tau"]))
TAU_SEQUENCE: Column = ("τ (sequence)", lambda r: _fmt(r.get("tau_sequence")))
DRAFT_LENGTH: Column = ("draft len", lambda r: _fmt(r.get("mean_draft_length")))
TOKENS_PER_S: Column = ("tok/s", lambda r: _fmt(r["output_tokens_per_s"], ".1f"))
SPEEDUP: Column = ("speed-up", lambda r: _fmt(r["speedup"]))
SAME_REPLIES: Column = ("same replies", _same_replies)


def _lookup_share(row: dict) -> str:
    """Where a prompt lookup drafts beside the drafter: its draft tokens accepted of drafted,
    and its share of all draft tokens."""
    sources = row.get("draft_sources")
    if not sources:
        return "–"
    lookup, total = sources["lookup"], sum(s["draft_tokens"] for s in sources.values())
    rate = f" ({lookup['accepted'] / lookup['draft_tokens']:.0%})" if lookup["draft_tokens"] else ""
    share = f", {lookup['draft_tokens'] / total:.0%} of drafts" if total else ""
    return f"{lookup['accepted']}/{lookup['draft_tokens']}{rate}{share}"


LOOKUP: Column = ("lookup accepted/drafted", _lookup_share)


def _round(row: dict) -> str:
    """`` · round N`` for a row of a run's second or later round (``--rounds``), else nothing."""
    return f" · round {row['round'] + 1}" if row.get("round") else ""


ACCEPTANCE = (METHOD, K, T, ("category", lambda r: r["category"] + _round(r)), DTYPE, TAU, TAU_SEQUENCE,
              ("acceptance per position", lambda r: " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])),
              DRAFT_LENGTH, TOKENS_PER_S, SPEEDUP, SAME_REPLIES, LOOKUP)
THROUGHPUT = (METHOD, K, T, ("batch", lambda r: str(r["batch_size"]) + _round(r)), DTYPE, TOKENS_PER_S, SPEEDUP, TAU,
              TAU_SEQUENCE, DRAFT_LENGTH, SAME_REPLIES, LOOKUP)


def _seconds(header: str, key: str, spec: str = ".2f") -> Column:
    """A latency statistic, recorded in seconds under ``key``."""
    return header, lambda r: _fmt(r[key], spec)


LATENCY = (METHOD, K, DTYPE, ("QPS", lambda r: _fmt(r["qps"], "g")),
           ("achieved QPS", lambda r: _fmt(r["achieved_qps"])), ("requests", lambda r: str(r["num_requests"])),
           ("failures", lambda r: str(r["failures"])), ("late", lambda r: str(r["late_starts"])),
           *(_seconds(f"e2e {stat}", f"e2e_{stat}_s") for stat in ("mean", "p50", "p99")),
           *(_seconds(f"{name} {stat}", f"{key}_{stat}_s", ".3f")
             for name, key in (("TTFT", "ttft"), ("ITL", "itl")) for stat in ("mean", "p50", "p99")),
           TOKENS_PER_S)
ROBUSTNESS = (METHOD, K, ("system prompt", lambda r: r["system_prompt"]), DTYPE, TAU,
              ("change", lambda r: "–" if r.get("tau_drop") is None else f"{r['tau_drop']:+.1%}"))
MIXED_RUNS = ("all-K", "all-off", "half-off")
MIXED = (METHOD, K, ("batch", lambda r: str(r["batch_size"])), ("half", lambda r: r["half"]), DTYPE,
         ("in half-off", lambda r: "drafts" if r["half"] == "even" else "opts out"),
         *((f"tok/s {run}", lambda r, run=run: _fmt(r[run], ".1f")) for run in MIXED_RUNS))


def _mixed_halves(rows: list[dict]) -> list[dict]:
    """One row per (method, K, half) of the mixed suite, with the half's tok/s in each of its runs."""
    tok_s = {(r["method"], r["k"], r["half"], r["run"]): r["output_tokens_per_s"] for r in rows}
    halves = sorted({(r["method"], r["k"], r["batch_size"], r["half"], _dtype(r)) for r in rows},
                    key=lambda h: (h[0], h[1], h[3]))
    return [{"method": m, "k": k, "batch_size": b, "half": half, "dtype": dtype,
             **{run: tok_s.get((m, k, half, run)) for run in MIXED_RUNS}} for m, k, b, half, dtype in halves]


def _rounds(rows: list[dict]) -> list[dict]:
    """One row per (method, K, T, dtype) of a run with several rounds: its tok/s in each round
    and over them all (output tokens over seconds, every category), and against no speculation
    in the same round; none where the run had one round."""
    if not any(r.get("round") for r in rows):
        return []
    groups: dict[tuple, dict[int, tuple[int, float]]] = {}
    for r in rows:
        totals = groups.setdefault((r["method"], r["k"], r["temperature"], _dtype(r)), {})
        tokens, seconds = totals.get(r["round"], (0, 0.0))
        totals[r["round"]] = (tokens + r["output_tokens"], seconds + r["elapsed_s"])
    rate = {key: {n: t / s for n, (t, s) in sorted(totals.items())} for key, totals in groups.items()}
    out = []
    for (method, k, temperature, dtype), totals in groups.items():
        own, none = rate[(method, k, temperature, dtype)], rate.get(("none", 0, temperature, dtype), {})
        overall = sum(t for t, _ in totals.values()) / sum(s for _, s in totals.values())
        out.append({"method": method, "k": k, "temperature": temperature, "dtype": dtype, "overall": overall,
                    "per_round": list(own.values()),
                    "against_none": [value / none[n] if n in none else None for n, value in own.items()]})
    return out


ROUNDS = (METHOD, K, T, DTYPE, ("tok/s per round", lambda r: " / ".join(f"{v:.1f}" for v in r["per_round"])),
          ("tok/s over the rounds", lambda r: f"{r['overall']:.1f}"),
          ("speed-up per round", lambda r: " / ".join(_fmt(v) for v in r["against_none"])))


@dataclass(frozen=True)
class Section:
    """A suite's part of the report: its heading and notes, then one table row per result
    (``regroup`` turns the suite's results into the table's rows where they differ)."""

    suite: str
    heading: str
    columns: tuple[Column, ...]
    regroup: Callable[[list[dict]], list[dict]] = list

    def render(self, runs: list[dict]) -> list[str]:
        """The heading and the table, or nothing where the suite has no results."""
        rows = self.regroup([r for r in runs if r["suite"] == self.suite])
        if not rows:
            return []
        return [self.heading, _table([header for header, _ in self.columns],
                                     [[cell(r) for _, cell in self.columns] for r in rows])]


SECTIONS = (
    Section("acceptance", "## Acceptance (batch size 1)\n\nτ = mean acceptance length; draft len = mean tokens per "
            "draft (K unless the length adapts); speed-up over no speculation in the same run; same replies: at "
            "T=0, the replies equal to no speculation's, token for token.\n", ACCEPTANCE),
    Section("acceptance", "\n## Acceptance over the rounds (`--rounds`)\n\nEach method's output tokens over its "
            "seconds, every category together, in each round and over all of them; speed-up: against no "
            "speculation in the same round.\n", ROUNDS, _rounds),
    Section("throughput", "\n## Throughput vs batch size (chain drafting)\n", THROUGHPUT),
    Section("latency", "\n## Latency vs request rate (open-loop Poisson arrivals, streaming, seconds)\n\n"
            "ITL = mean time per output token after the first chunk, per request; late = requests sent "
            "over 50 ms after their scheduled arrival.\n", LATENCY),
    Section("robustness", "\n## Robustness to system prompts (paper Table 14; τ change vs no system prompt)\n",
            ROBUSTNESS),
    Section("mixed", "\n## Mixed batch: half the requests opt out of drafting (T=0)\n\n"
            "Each half's output tok/s, from the batch's start to the half's last token, with the batch "
            "served all at K, all opted out (`extra_args={\"num_speculative_tokens\": 0}`), and half "
            "opted out (the odd-numbered requests), in one engine.\n", MIXED, _mixed_halves),
)


def _header(results: dict) -> str:
    """The machine, the software, the models and the command the results came from."""
    runs, m, config = results["runs"], results["machine"], results["config"]
    return (
        f"# Benchmark report\n\nmachine: {m['processor']} ({m['cores']} cores; {m.get('cpu_instruction_set', '?')}), "
        f"accelerator: {m['accelerator']}; {_engines_dtype(runs, m)}"
        f"{'; engines eager (no torch.compile)' if config.get('eager') else ''}; "
        f"vLLM {m['vllm']}, torch {m['torch']}, vllm-edsd {m['vllm_edsd']}{_load(m)}\n\n"
        f"target: `{config['target']}`; "
        f"drafters: "
        + ", ".join(f"{k} `{v}`" for k, v in config["drafters"].items())
        + f"\n\ncommand: `{config['command']}`\n\n{_reply_length(config)}\n"
    )


def render(results: dict) -> str:
    """The report: the header, the suites that failed, then each suite's tables."""
    runs = results["runs"]
    out = [_header(results)]
    for suite, reason in results.get("failed_suites", {}).items():
        out.append(f"\n**The {suite} suite failed** ({reason}); it has no rows below.\n")
    for section in SECTIONS:
        out += section.render(runs)
    cost = [r for r in runs if r["suite"] == "draft-cost"]
    if cost:
        out += _draft_cost(cost)
    steps = [r for r in runs if r["suite"] == "step-cost"]
    if steps:
        out += _step_cost(steps)
    return "\n".join(out) + "\n"


def plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, made = results["runs"], []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    acc = [r for r in runs if r["suite"] == "acceptance" and r["method"] != "none" and r["temperature"] == 0]
    if acc:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in sorted({(r["method"], r["k"]) for r in acc}):
            rows = [r for r in acc if (r["method"], r["k"]) == key and r["drafts"]]
            if rows:
                k = len(rows[0]["acceptance_per_pos"])
                mean = [sum(r["acceptance_per_pos"][i] for r in rows) / len(rows) for i in range(k)]
                ax.plot(range(1, k + 1), mean, marker="o", label=f"{key[0]} K={key[1]}")
        ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance per position (T=0)")
        ax.legend()
        save(fig, "acceptance_per_position.png")
    # Speed-ups exist where the run measured without speculation at the same batch size and T.
    thr = [r for r in runs if r["suite"] == "throughput" and r["method"] != "none" and r.get("speedup") is not None]
    temperatures = sorted({r["temperature"] for r in thr})
    if thr:
        fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 3.5), squeeze=False)
        for ax, temperature in zip(axes[0], temperatures):
            at = [r for r in thr if r["temperature"] == temperature]
            for key in sorted({(r["method"], r["k"]) for r in at}):
                rows = sorted((r for r in at if (r["method"], r["k"]) == key), key=lambda r: r["batch_size"])
                ax.plot([r["batch_size"] for r in rows], [r["speedup"] for r in rows], marker="o",
                        label=f"{key[0]} K={key[1]}")
            ax.axhline(1, color="grey", lw=0.8)
            ax.set(xscale="log", xlabel="batch size", ylabel="speed-up",
                   title=f"Throughput speed-up vs batch size (T={temperature:g})")
            ax.legend()
        save(fig, "speedup_vs_batch.png")
    lat = [r for r in runs if r["suite"] == "latency"]
    if lat:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in sorted({(r["method"], r["k"]) for r in lat}):
            rows = sorted((r for r in lat if (r["method"], r["k"]) == key), key=lambda r: r["qps"])
            ax.plot([r["qps"] for r in rows], [r["e2e_mean_s"] for r in rows], marker="o",
                    label=key[0] if key[0] == "none" else f"{key[0]} K={key[1]}")
        ax.set(xlabel="request rate (QPS)", ylabel="mean end-to-end latency (s)", title="Latency vs request rate")
        ax.legend()
        save(fig, "latency_vs_rate.png")
    return made
