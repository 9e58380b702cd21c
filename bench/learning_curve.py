"""``python -m bench learning-curve``: served τ against training positions, EDSD and EAGLE-3
trained the same way (the demo recipe of ``edsd build-demo``), so the training budget is chosen
from a measurement (docs/architecture.md "Data flow").

Stages, each skipped when its output exists (rerun the same command to resume); everything
but the results lives under ``--work`` (default ``~/.cache/vllm-edsd/learning-curve``):

1. data: ``edsd build-demo``'s prompts (ShareGPT chat and code, seeded, held-out prompts
   excluded) answered by the target through vLLM, in resumable chunks;
2. EDSelect's layers for EDSD (the pipeline's select stage, ``vllm_edsd.pipeline.stages``);
3. for every size N and method: ``edsd train`` on the first N conversations with the demo
   recipe's data, optimizer and budget, in float32, EDSD with the paper's draft layer and EAGLE-3
   without EAGLE 3.1's norms (the recipe's architecture switches off, so every point and
   ablation keeps its meaning: ``--train-extra`` turns them on); both methods and every size
   read one feature cache (shards named by content);
4. τ of each drafter served by vLLM (K, greedy, ignore EOS, float32) on the bench's held-out
   prompts (five categories), batched, and on as many prompts it trained on (the gap between
   the two is what the drafter memorised); EDSD converted to vLLM's layout first.

Writes ``results.json``, ``report.md`` and ``learning_curve.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from pathlib import Path

from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.registry import EAGLE3, EDSD

from .arguments import numbers
from .machine import describe, machine
from .offline import CATEGORIES, generate, load_prompts

METHODS = (EDSD, EAGLE3)
CARRIED = "carried.json"  # in a run unpacked by ``bench.gpu_runs``: its weights went through float16
SAVE_EVERY = 100  # batches: on a CPU an epoch of the largest point takes about an hour; resume loses less


def demo_plan(args: argparse.Namespace, largest: int):
    """``edsd build-demo``'s recipe (its pipeline config) with enough prompts for the largest
    size, without the recipe's architecture and precision: each method's switches off, EDFuse
    at the target's FFN width, float32, no method's own table. A run is named by its
    ``--train-extra`` alone, so the base it adds to must not move when the shipped recipe does."""
    from vllm_edsd.demo import build
    from vllm_edsd.demo.target import demo_target
    from vllm_edsd.methods import METHODS as REGISTERED
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    code = args.code_prompts if args.code_prompts is not None else largest // 3
    chat = args.chat_prompts if args.chat_prompts is not None else largest - code
    if chat + code < largest:
        raise EDSDError(f"--sizes asks for {largest} conversations but only {chat + code} prompts are answered")
    parser = argparse.ArgumentParser()
    build.add_arguments(parser)
    flags = parser.parse_args(["--work", args.work, "--device", args.device,
                               "--chat-prompts", str(chat), "--code-prompts", str(code)])
    overrides = build.demo_overrides(flags, demo_target())
    overrides["train"].update({name: False for m in REGISTERED.values() for name in m.switches})
    overrides["train"].update(fuse_intermediate_size=None, autocast=None, **dict.fromkeys(REGISTERED))
    return Plan(load_config(build.PIPELINE, overrides))


def train_point(plan, method: str, size: int, extra: list[str], feature_layers: tuple[int, ...] = ()) -> Path:
    """The drafter trained on the first ``size`` conversations, in a layout vLLM serves, from
    the features of the plan's layers and ``feature_layers``. ``extra`` are `edsd train` flags
    (an ablation), so the point runs as that command."""
    from vllm_edsd.checkpoint.files import finished_checkpoint
    from vllm_edsd.command import call, command_line
    from vllm_edsd.training import cli

    variant = "".join(extra).replace("-", "").replace("/", "_")
    # another data set or another ablation is another run
    run = plan.work / "curve" / plan.data().stem / (f"{method}-{size}" + (f"-{variant}" if variant else ""))
    if not finished_checkpoint(run / "final"):
        options = plan.train_options(method, run)
        layers = tuple(sorted({*feature_layers, *options.feature_layers}))
        options = dataclasses.replace(options, feature_layers=layers, max_samples=size, save_every=SAVE_EVERY)
        argv = own_layers(command_line("train", options), extra)
        if call(cli, [*argv[1:], *extra]) != 0:
            raise EDSDError(f"the training run stopped: {shlex.join([*argv, *extra])}")
    return served_drafter(plan, method, run)


def check_built(work: Path, methods: list[str]) -> None:
    """Refuse ``--drafters-from`` before anything runs unless ``edsd build-demo --work work``
    finished training every method asked for (work/METHOD/final)."""
    from vllm_edsd.checkpoint.files import finished_checkpoint

    for method in methods:
        if not finished_checkpoint(work / method / "final"):
            raise EDSDError(f"--drafters-from: {work / method / 'final'} is not a finished checkpoint "
                            f"(has `edsd build-demo --work {work}` finished training {method}?)")


def served_drafter(plan, method: str, run: Path) -> Path:
    """The drafter of the finished training run ``run`` as vLLM serves it: a checkpoint as
    trained where its method needs no conversion, else converted once into run/vllm."""
    from vllm_edsd.checkpoint.files import finished_checkpoint
    from vllm_edsd.conversion.stage import ConvertOptions
    from vllm_edsd.conversion.stage import run as convert
    from vllm_edsd.methods import method as registered

    if not registered(method).converts:
        return run / "final"
    served = run / "vllm"
    if not finished_checkpoint(served):
        convert(ConvertOptions(src=str(run / "final"), dst=str(served), target=plan.target, force=True))
    return served


def own_layers(argv: list[str], extra: list[str]) -> list[str]:
    """``argv`` without EDSelect's layers when the ablation ``extra`` names its own ``--layers``
    (``edsd train`` refuses both)."""
    if "--layers" not in extra or "--layers-from" not in argv:
        return argv
    at = argv.index("--layers-from")
    return argv[:at] + argv[at + 2:]


def seen_prompts(plan, count: int) -> list[list[dict]]:
    """The first ``count`` training prompts: every size of the curve trains on them (sizes are
    prefixes of one data set), so τ on them against τ on held-out prompts shows how much of
    what a drafter learned carries over to prompts it never saw."""
    from vllm_edsd.data import load_conversations

    conversations = load_conversations(plan.data(), count)
    return [conv[: next(i for i, turn in enumerate(conv) if turn["role"] == "user") + 1] for conv in conversations]


def measure(drafter: Path, method: str, plan, args: argparse.Namespace) -> dict:
    """τ of one drafter served by vLLM on the held-out prompts and on as many of its training
    prompts (greedy, batched), in float32 and eager like the shipped drafters' acceptance check:
    the same figure on every CPU."""
    from vllm_edsd.demo import ACCEPTANCE_CHECK
    from vllm_edsd.launch.engine import llm_session, speculative_config

    held_out = [c for category in CATEGORIES for c in load_prompts(category, args.prompts_per_category)]
    spec = speculative_config(method, str(drafter), args.k)
    with llm_session(plan.target, spec, **ACCEPTANCE_CHECK["llm_kwargs"]) as llm:
        result = generate(llm, held_out, 0.0, args.max_tokens, one_at_a_time=False)
        seen = generate(llm, seen_prompts(plan, len(held_out)), 0.0, args.max_tokens, one_at_a_time=False)
    kept = ("tau", "tau_sequence", "acceptance_per_pos", "drafts", "dtype")
    return {**{key: result[key] for key in kept}, "tau_seen": seen["tau"]}


def point(plan, method: str, size: int, args: argparse.Namespace, feature_layers: tuple[int, ...] = ()) -> dict:
    """One point of the curve: train (or reuse) the drafter, or take a build-demo run's, then
    measure it."""
    drafter = (served_drafter(plan, method, Path(args.drafters_from) / method) if args.drafters_from else
               train_point(plan, method, size, args.train_extra.split(), feature_layers))
    log = [json.loads(line) for line in (drafter.parent / "train_log.jsonl").read_text().splitlines()]
    return {"method": method, "variant": args.train_extra, "conversations": size,
            "positions": log[-1]["positions_trained"],
            "train_wall_s": round(sum(e["wall_s"] for e in log), 1),
            "train_acc_per_step": [round(a, 4) for a in log[-1]["acc_per_step"]],
            **carried_marks(drafter.parent),
            **measure(drafter, method, plan, args)}


def carried_marks(run: Path) -> dict:
    """What ``bench.gpu_runs unpack`` recorded about a carried run's weights; nothing for a run
    trained here."""
    marks = run / CARRIED
    return json.loads(marks.read_text()) if marks.is_file() else {}


def same_point(a: dict, b: dict) -> bool:
    return all(a.get(key, "") == b.get(key, "") for key in ("method", "variant", "conversations"))


def measurement(args: argparse.Namespace) -> dict:
    return {"k": args.k, "prompts_per_category": args.prompts_per_category, "max_tokens": args.max_tokens}


def earlier_points(path: Path, args: argparse.Namespace) -> list[dict]:
    """Points an earlier run wrote to the same ``--out`` with the same measurement: an ablation
    adds its points beside the main curve's."""
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    return earlier["points"] if earlier.get("measurement") == measurement(args) else []


def point_command(results: dict, point: dict) -> str:
    """The command that measured ``point``: its own, or for a point written before points kept
    one, the file's (the last run's)."""
    return point.get("command", results["command"])


def rounded(point: dict) -> bool:
    """Whether the point's drafter was carried from a GPU machine with its weights in float16."""
    return point.get("weights_rounded_to") == "float16"


def render(results: dict) -> str:
    """report.md: one row per point; when the points come from several runs (an ablation beside
    the main curve), a numbered list of their commands and a column naming each row's."""
    rows = sorted(results["points"], key=lambda r: (r["method"], r.get("variant", ""), r["conversations"]))
    commands = [point_command(results, r) for r in rows]
    runs = list(dict.fromkeys(commands))
    several = len(runs) > 1
    lines = [f"# Learning curve: served τ (K={results['k']}, T=0) against training positions", "",
             f"Command: `{runs[0]}`  " if not several else f"Commands: the {len(runs)} runs listed below the table.  ",
             f"Machine: {describe(results['machine'])}; drafters trained in float32"
             + (", those marked ° carried back from a GPU machine in float16" if any(map(rounded, rows)) else "")
             + f", target served in {rows[0]['dtype']}.  ",
             f"Held out: {results['held_out']}.  ",
             f"Seen: {results.get('seen', 'not measured')}.", "",
             "| method | conversations | positions | τ | τ (sequence) | acceptance per position | τ on seen prompts "
             "| train acc (last epoch) | training wall time |" + (" run |" if several else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if several else "")]
    for r, command in zip(rows, commands):
        name = r["method"] + (f" `{r['variant']}`" if r.get("variant") else "") + (" °" if rounded(r) else "")
        sequence = f"{r['tau_sequence']:.3f}" if r.get("tau_sequence") else "-"
        lines.append(f"| {name} | {r['conversations']} | {r['positions']:,} | {r['tau']:.3f} | {sequence} | "
                     + " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
                     + (f" | {r['tau_seen']:.3f}" if "tau_seen" in r else " | -")
                     + f" | {r['train_acc_per_step'][0]:.2f} | {r['train_wall_s'] / 60:.1f} min |"
                     + (f" {runs.index(command) + 1} |" if several else ""))
    if several:
        lines += ["", *(f"{n}. `{command}`" for n, command in enumerate(runs, 1))]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for method, variant in sorted({(r["method"], r.get("variant", "")) for r in results["points"]}):
        rows = sorted((r for r in results["points"] if (r["method"], r.get("variant", "")) == (method, variant)),
                      key=lambda r: r["positions"])
        ax.plot([r["positions"] for r in rows], [r["tau"] for r in rows], marker="o",
                label=f"{method} {variant}".strip())
    ax.set(xscale="log", xlabel="training positions", ylabel="τ (served, T=0)",
           title=f"Learning curve, K={results['k']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checked(args: argparse.Namespace) -> tuple[list[int], tuple[int, ...], list[str]]:
    """The sizes, the extra feature layers and the methods asked for; a bad value is refused in
    one line before anything runs."""
    sizes = sorted(set(numbers("--sizes", args.sizes, int, 1)))
    feature_layers = () if args.feature_layers is None else tuple(
        numbers("--feature-layers", args.feature_layers, int, 0))
    if args.drafters_from and args.train_only:
        raise EDSDError("--train-only trains; --drafters-from measures drafters already trained: give one of them")
    if args.drafters_from and len(sizes) != 1:
        raise EDSDError("--drafters-from measures one run: give its number of conversations as --sizes N")
    methods = args.methods.split(",")
    if unknown := sorted(set(methods) - set(METHODS)):
        raise EDSDError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.drafters_from:
        check_built(Path(args.drafters_from), methods)
    return sizes, feature_layers, methods


def new_results(args: argparse.Namespace, out: Path) -> dict:
    """The results file's header, with the points an earlier run of the same measurement kept."""
    return {"command": args.command, "machine": machine(), "k": args.k, "measurement": measurement(args),
            "points": earlier_points(out / "results.json", args),
            "held_out": f"the bench's prompts, {args.prompts_per_category} per category "
                        f"({', '.join(CATEGORIES)}), {args.max_tokens} tokens each, batched",
            "seen": f"the first {args.prompts_per_category * len(CATEGORIES)} training prompts (every size "
                    "trains on them), measured alike"}


def train_only(plan, sizes: list[int], methods: list[str], args: argparse.Namespace,
               feature_layers: tuple[int, ...]) -> int:
    """``--train-only``: every point's training run, none measured (vLLM need not be here)."""
    for size in sizes:
        for method in methods:
            drafter = train_point(plan, method, size, args.train_extra.split(), feature_layers)
            print(f"trained: {method} {args.train_extra} at {size} conversations -> {drafter}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Every (size, method) point not yet measured: train or reuse, measure, write."""
    args.work = str(Path(args.drafters_from or args.work).expanduser())
    sizes, feature_layers, methods = checked(args)
    from vllm_edsd.pipeline.stages import run_pipeline

    out = Path(args.out)
    plan = demo_plan(args, sizes[-1])
    run_pipeline(plan.cfg, stop_after="select")  # the data and EDSelect's layers
    if args.train_only:
        return train_only(plan, sizes, methods, args, feature_layers)
    results = new_results(args, out)
    started = time.time()
    for size in tqdm(sizes, desc="sizes", unit="size"):
        for method in methods:
            key = {"method": method, "variant": args.train_extra, "conversations": size}
            if not args.remeasure and any(same_point(r, key) for r in results["points"]):
                print(f"kept: {method} {args.train_extra} at {size} conversations, measured in {out}")
                continue
            new = {**point(plan, method, size, args, feature_layers), "command": args.command}
            results["points"] = [r for r in results["points"] if not same_point(r, new)] + [new]
            out.mkdir(parents=True, exist_ok=True)  # at the first result: a run in progress leaves no empty folder
            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
            (out / "report.md").write_text(render(results))
    plot(results, out / "learning_curve.png")
    print(render(results))
    print(f"({(time.time() - started) / 60:.1f} min; written to {out})")
    return 0
