"""``python -m bench SUITE [options]``: every suite of the bench, and every suite's options, in
one parser. ``python -m bench SUITE --help`` says what a suite measures and writes.

Each suite is a row of ``SUITES``: its one-line help, the module whose ``run(args)`` runs it,
and the function here that adds its options. Of the modules that run suites, only the chosen
one is imported (and the light ones whose choices the options name).
A suite refuses bad input with one line (``bench SUITE: error: ...``) and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from vllm_edsd.command import reported
from vllm_edsd.methods.registry import EAGLE3, EDSD
from vllm_edsd.serving.features.draft_length import DEFAULT_THRESHOLD

from .draft_cost import DTYPES
from .draft_cost import METHODS as DRAFT_COST_METHODS
from .draft_cost import SUITE as DRAFT_COST
from .offline import CATEGORIES, DEFAULT_METHODS
from .step_cost import BATCH_SIZES as STEP_COST_BATCH_SIZES
from .step_cost import METHODS as STEP_COST_METHODS
from .vllm_serve import DTYPES as SERVER_DTYPES

COMPUTED_DTYPE = "default: bfloat16 where the CPU computes it natively, else float32"
EAGER_HELP = ("engines and servers without torch.compile (vLLM's enforce_eager): on a 2-core AMD EPYC with "
              "AVX2 only, the demo pair's engine in float32 started in 76 s against 167 s compiled and decoded "
              "a little slower; speeds measured eager are not compiled ones")


@dataclass(frozen=True)
class Suite:
    """One suite: its line in ``python -m bench --help``, the module that runs it, its options,
    and the module whose docstring is its ``--help`` where that is not the one that runs it."""

    help: str
    module: str
    options: Callable[[argparse.ArgumentParser], None]
    described_by: str | None = None


def models(add, out_help: str, edsd_layouts: str) -> None:
    """``--out``, the target and one drafter per method, each defaulting to the demo's."""
    add("--out", required=True, help=out_help)
    add("--target", help="the target's directory (default: the embedded demo target)")
    add(f"--{EDSD}", help=f"EDSD drafter directory, {edsd_layouts} (default: the demo's)")
    add(f"--{EAGLE3}", help="EAGLE-3 drafter directory, vLLM's layout (default: the demo's)")


def engine_models(parser: argparse.ArgumentParser) -> None:
    """The engine suites' models and methods."""
    add = parser.add_argument
    models(add, "output directory", "vLLM layout")
    add("--methods", default=None,
        help=f"comma-separated: none, ngram (vLLM's prompt lookup, no drafter), suffix (vLLM's suffix decoding, "
             f"needs arctic-inference), {EAGLE3}, {EDSD}, and EDSD served as {EDSD}-adaptive (entropy-adaptive "
             f"draft length), {EDSD}-batch-table (vLLM's K-by-batch-size table), {EDSD}+lookup and {EAGLE3}+lookup "
             f"(prompt lookup beside the drafter), {EDSD}-k1+lookup and {EAGLE3}-k1+lookup (the same, the drafter "
             f"drafting one token where the lookup drafts up to K) or {EDSD}-adaptive+lookup (both) "
             f"(default {DEFAULT_METHODS}; draft-cost: {','.join(DRAFT_COST_METHODS)}, all it takes; step-cost: "
             f"{','.join(STEP_COST_METHODS)})")
    add("--adaptive-threshold", type=float, default=DEFAULT_THRESHOLD,
        help=f"{EDSD}-adaptive's adaptive_draft_threshold (default {DEFAULT_THRESHOLD})")
    add("--k", default="4", help="num_speculative_tokens, comma-separated (default 4)")
    add("--quick", action="store_true", help="tiny sizes and --eager: proves the suites run (used by CI)")
    add("--eager", action="store_true", help=EAGER_HELP + " (draft-cost: --modes)")
    add("--dtype", choices=DTYPES, default=None,
        help=f"the engines' dtype in every suite but draft-cost ({COMPUTED_DTYPE}; step-cost: float32); float32 "
             "keeps every speculative reply the target's own, so all methods time the same texts")
    add("--seed", type=int, default=0,
        help="the offline engines' sampling seed (default 0): a sampled (T>0) row is one draw of its texts; "
             "rerun with other seeds to see how far its figures move")
    add("--modes", default=None,
        help="draft-cost: compiled (vLLM's default) and/or eager (enforce_eager), comma-separated (default both; "
             "quick: eager)")
    add("--dtypes", default=None,
        help="draft-cost: engine dtypes, comma-separated (default float32,bfloat16; quick: the CPU's default)")


def engine_sizes(parser: argparse.ArgumentParser) -> None:
    """The engine suites' prompts, lengths, batches and request rates."""
    add = parser.add_argument
    add("--temperatures", default=None,
        help="sampling temperatures, comma-separated, for acceptance, throughput and step-cost (default: acceptance "
             "0,1; throughput and step-cost 0)")
    add("--prompts-per-category", type=int, default=None)
    add("--categories", default=",".join(CATEGORIES),
        help="prompt categories, comma-separated, for every suite but robustness (which always uses chat); for "
             f"example chat alone (default {','.join(CATEGORIES)})")
    add("--max-tokens", type=int, default=None)
    add("--stop-at-eos", action="store_true",
        help="end each reply at the model's end of sequence, as users see it (default: every reply is "
             "--max-tokens long, ignore_eos, so every method does the same work; prompt lookup then also copies "
             "the repetition a small model writes past its answer)")
    add("--batch-sizes", default=None, help=f"default 1,2,4,...,256 (quick: 1,4; step-cost: {STEP_COST_BATCH_SIZES})")
    add("--mixed-batch", type=int, default=None,
        help="the mixed suite's batch; half of it opts out of drafting (default 16; quick 4)")
    add("--rounds", type=int, default=1,
        help="offline suites: every method's engine this many times, in alternating order, so that a drift of "
             "the machine's speed touches every method alike; the report adds each method's tok/s per round "
             "(default 1)")
    add("--qps", default=None, help="request rates for latency (default 0.5,1,2,4; quick: 1)")
    add("--num-requests", type=int, default=None, help="Poisson arrivals per request rate (default 200; quick 16)")
    add("--max-users", type=int, default=64, help="locust users, the most requests in flight at once (default 64)")


def engine_options(parser: argparse.ArgumentParser) -> None:
    engine_models(parser)
    engine_sizes(parser)


def schedule_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", required=True, help="output directory")
    add("--target", help="target model (default: the embedded demo target)")
    add("--drafter", help="drafter directory, vLLM layout (default: the demo's for --method)")
    add("--method", choices=(EDSD, EAGLE3), default=EDSD)
    add("--batch-sizes", default="1,4,16,64", help="default 1,4,16,64")
    add("--max-k", type=int, default=4, help="static K measured: 1 to this (default 4)")
    add("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    add("--max-batch", type=int, default=256,
        help="the schedule's last range ends here (default 256, vLLM's max_num_seqs on a GPU)")
    add("--dtype", choices=DTYPES, default=None, help=f"the engines' dtype ({COMPUTED_DTYPE})")
    add("--quick", action="store_true", help="batch sizes 1,4, K up to 2, 16 tokens, --eager (CI)")
    add("--eager", action="store_true", help=EAGER_HELP)


def serve_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", required=True, help="output directory")
    add("--target", help="target model (default: the embedded demo target)")
    add("--speculative-config", action="append", default=None, metavar="JSON",
        help="a server to measure besides none, as vllm serve takes it; repeat for several (default: the demo's "
             "EDSD drafter at K=4, the README's GPU command; docs/serving.md's CPU command is K=1)")
    add("--dtypes", default="auto",
        help=f"server dtypes, comma-separated, from {', '.join(SERVER_DTYPES)} (default auto)")
    add("--num-prompts", type=int, default=24, help="held-out ShareGPT prompts (default 24)")
    add("--output-len", type=int, default=128, help="tokens per reply at most (default 128)")
    add("--seed", type=int, default=0, help="vllm bench serve's sampling seed (default 0)")
    add("--rounds", type=int, default=1,
        help="every server this many times, every other round in reverse order, so that a drift of the "
             "machine's speed touches every server alike; the report gives each server's tok/s over its rounds "
             "(their tokens over their time) and per round (default 1)")
    add("--eager", action="store_true", help=EAGER_HELP)


def held_out_prompt_options(add) -> None:
    """The bench's held-out prompts, as the instruments without a server read them."""
    add("--prompts-per-category", type=int, default=4, help="held-out prompts per bench category (default 4)")
    add("--max-tokens", type=int, default=128, help="tokens of each greedy answer at most (default 128)")


def learning_curve_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", required=True, help="where results.json, report.md and the plot go")
    add("--work", default="~/.cache/vllm-edsd/learning-curve",
        help="data, caches and checkpoints (default ~/.cache/vllm-edsd/learning-curve)")
    add("--sizes", default="64,180,360,720", help="training conversations per point, comma-separated")
    add("--methods", default=f"{EDSD},{EAGLE3}", help=f"{EDSD}, {EAGLE3} or both (default both)")
    add("--chat-prompts", type=int, default=None, help="ShareGPT chat prompts answered (default: in proportion)")
    add("--code-prompts", type=int, default=None, help="ShareGPT code prompts answered (default: a third)")
    add("--k", type=int, default=4, help="num_speculative_tokens when τ is measured (default 4)")
    held_out_prompt_options(add)
    add("--device", default="cpu", help="where the drafters train (default cpu)")
    add("--feature-layers", default=None,
        help="more target layers whose features are extracted and cached for every point, besides EDSelect's "
             "and EAGLE-3's: every ablation's --layers among them lets all rows share one extraction")
    add("--train-extra", default="", help="more `edsd train` arguments for every point, an ablation "
                                         "(e.g. --train-extra='--feature-noise 0.2'); its runs are kept apart")
    add("--drafters-from", default=None, metavar="WORK",
        help=f"measure the drafters an `edsd build-demo --work WORK` run trained (WORK/{EDSD}, WORK/{EAGLE3}) "
             "instead of training, on that run's data (--work is WORK); --sizes is then the run's one size, "
             "and --chat-prompts/--code-prompts its prompts")
    add("--remeasure", action="store_true",
        help="measure again the points that --out's results.json already holds (default: keep them)")
    add("--train-only", action="store_true",
        help="train every point and measure none: for a machine without vLLM (a GPU box with torch alone); "
             "the same command without it measures them where vLLM is, on the same --work")


def vocab_coverage_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("target", help="the target's directory (its tokenizer and chat template)")
    add("--data", required=True, help="JSON lines of answered conversations ({'messages': [...]})")
    add("--train", default=None, help="conversations the vocabulary is built from, comma-separated counts "
                                      "(default: all but the held-out ones)")
    add("--held-out", type=int, default=1000, help="last conversations measured (default 1000)")
    add("--sizes", default="1024,2048,4096,8192,16384,32000", help="draft vocabulary sizes (default "
                                                                   "1024,2048,4096,8192,16384,32000)")
    add("--max-length", type=int, default=448, help="tokens per rendered conversation (default 448)")
    add("--out", help="also write results.json and report.md into this directory")


def copying_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    models(add, "where results.json and report.md go", "any EDSD layout")
    add("--steps", type=int, default=4, help="draft steps per chain, K (default 4)")
    held_out_prompt_options(add)


def cold_starts_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", required=True, help="where results.json and report.md go")
    add("--rounds", type=int, default=10, help="rounds of (cold, reload) starts (default 10: 20 starts)")
    add("--target", help="the target model (default: the embedded demo target)")
    add("--drafter", help="the drafter (default: the demo's, with the demo target)")
    add("--method", default=EDSD, help=f"speculative method, or none (default {EDSD})")
    add("--timeout", type=float, default=900, help="seconds one start may take (default 900)")


def soak_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", required=True, help="where results.json, report.md and memory.png go")
    add("--target", help="the target's directory (default: the embedded demo target)")
    add(f"--{EDSD}", help=f"{EDSD} drafter directory, vLLM's layout (default: the demo's)")
    add("--url", help="soak your own running server instead (served as 'bench': --served-model-name bench)")
    add("--pid", type=int, help="with --url: its API server's pid, to watch its processes' memory")
    add("--duration", type=float, default=180, help="seconds of load, shared by the levels (default 180)")
    add("--concurrency", default="1,8,32", help="locust users per level, 1 to 32, comma-separated (default 1,8,32)")
    add("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    add("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    add("--prompts", type=int, default=8, help="the bench's chat prompts in a round (default 8)")
    add("--shutdown-timeout", type=int, default=0,
        help="vllm serve's --shutdown-timeout for the server started here: seconds in-flight requests may "
             "drain after SIGTERM (default 0, vLLM's: abort them)")
    add("--dtype", choices=DTYPES, default=None, help=f"the server's dtype ({COMPUTED_DTYPE}); greedy replies "
        "compare exactly in float32 (in 16 bits vLLM rounds a one-token step alone otherwise than in a batch)")
    add("--tensor-parallel-size", type=int, default=1, help="the started server's tensor parallelism (default 1)")
    add("--data-parallel-size", type=int, default=1, help="the started server's engine replicas (default 1); "
        "with more than one rank, each gets an equal share of this process's cores unless "
        "VLLM_CPU_OMP_THREADS_BIND says otherwise")
    add("--eager", action="store_true", help=EAGER_HELP)
    add("--offline", action="store_true",
        help="also abort requests in the middle of vllm.LLM's step() loop (bench/soak_offline.py)")


def index_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default="bench/results",
                        help="the results folder to index; its README.md is written (default bench/results)")


ENGINE_HELP = {"acceptance": "τ and tokens/s per category, batch 1",
               "throughput": "output tokens/s per batch size",
               "latency": "end-to-end latency under Poisson arrivals",
               "robustness": "τ under ten system prompts",
               "mixed": "a batch where half the requests opt out",
               "all": "the five suites above, one engine per method"}
SUITES: dict[str, Suite] = {
    **{name: Suite(text, "suites", engine_options) for name, text in ENGINE_HELP.items()},
    DRAFT_COST: Suite("a draft step against a target step (profiler)", "suites", engine_options),
    "step-cost": Suite("the whole decode step by part, scheduler to detokeniser", "suites", engine_options,
                       described_by="step_cost"),
    "schedule": Suite("the K-by-batch-size table, measured and served", "schedule", schedule_options),
    "serve": Suite("vllm bench serve against servers at defaults", "vllm_serve", serve_options),
    "learning-curve": Suite("τ against training positions, both methods", "learning_curve",
                            learning_curve_options),
    "vocab-coverage": Suite("held-out tokens each draft vocabulary holds", "vocab_coverage",
                            vocab_coverage_options),
    "copying": Suite("drafter accuracy where the text repeats", "copying", copying_options),
    "cold-starts": Suite("engine starts from a cold compile cache", "cold_starts", cold_starts_options),
    "soak": Suite("a server under mixed load and faults, then SIGTERM", "soak", soak_options),
    "index": Suite("write bench/results/README.md, the results index", "index", index_options),
}


DESCRIPTION = ("Measure speculative decoding through vLLM, or build the drafters' instruments. Results go to "
               "--out (results.json with a machine block, report.md); `python -m bench SUITE --help` says what "
               "a suite measures.")


class Wide(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every suite's help on its name's line (argparse reckons the
    suites one indent shallower than it prints them, and would wrap the longest names)."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.nargs == argparse.PARSER:
            longest = max(map(len, action.choices)) + self._current_indent + 2 * self._indent_increment
            self._action_max_length = max(self._action_max_length, longest)


def parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The bench's parser; the chosen suite's ``--help`` is its module's docstring."""
    top = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION, formatter_class=Wide,
                                  epilog="example (GPU):\n  python -m bench all --target "
                                         f"meta-llama/Llama-3.1-8B-Instruct --{EAGLE3} DRAFT_E3 --{EDSD} DRAFT_EDSD "
                                         "--out results/")
    suites = top.add_subparsers(dest="suite", required=True, metavar="SUITE", title="suites")
    for name, suite in SUITES.items():
        described_by = suite.described_by or suite.module
        description = importlib.import_module(f"bench.{described_by}").__doc__ if name == chosen else suite.help
        suite.options(suites.add_parser(name, help=suite.help, description=description, formatter_class=Wide))
    return top


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments of one suite, with ``command``: how the run was asked for, for its results."""
    args = parser(argv[0] if argv and argv[0] in SUITES else None).parse_args(argv)
    args.command = "python -m bench " + shlex.join(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    suite = importlib.import_module(f"bench.{SUITES[args.suite].module}")
    return reported(f"bench {args.suite}", lambda: suite.run(args))
