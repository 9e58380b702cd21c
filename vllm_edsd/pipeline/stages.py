"""The pipeline's stages (``Plan``: each one's output, whether it is finished, what it runs)
and the runner (``run_pipeline``): the stages not yet done run in order, each skipped when its
output is finished; an interrupted one goes on where it stopped when the same config is rerun.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_edsd.checkpoint.files import finished_checkpoint
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import METHODS
from vllm_edsd.methods.registry import EDSD

from .config import Config
from .conversations import drafter_prompts, write_conversations

# The `edsd` subcommands the stages run, each through its own module.
COMMANDS = {"select": "vllm_edsd.selection.cli", "features": "vllm_edsd.features.cli",
            "train": "vllm_edsd.training.cli", "convert": "vllm_edsd.conversion.cli"}


def run_command(argv: list[str]) -> None:
    """``edsd NAME ARGS...`` through the subcommand's own module (the ``edsd`` table is above
    the pipeline)."""
    from vllm_edsd.command import call

    if call(importlib.import_module(COMMANDS[argv[0]]), argv[1:]) != 0:
        raise EDSDError(f"the pipeline stopped at `edsd {shlex.join(argv)}`")


def feature_layers(cfg: Config, layers_json: Path) -> list[int]:
    """Every method's layers (EDSD's from EDSelect or the config, EAGLE-3's from the config or
    vLLM's default): the features all drafters train on, extracted once."""
    from vllm_edsd.checkpoint.target import decoder_layers

    ids: set[int] = set()
    for name in cfg.train.methods:
        drafting = METHODS[name]
        given = getattr(cfg.layers, name)
        if given:
            ids |= set(given)
        elif drafting.default_layers is None:
            ids |= set(json.loads(layers_json.read_text())["aux_layer_ids"])
        else:
            ids |= set(drafting.default_layers(decoder_layers(cfg.target.path)))
    return sorted(ids)


def joined(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def flags(**values: object) -> list[str]:
    """``--key value`` for each key that is set (an unset one: the command's own default)."""
    return [arg for key, value in values.items() if value is not None
            for arg in (f"--{key.replace('_', '-')}", str(value))]


class Plan:
    """The stages of one config: their outputs, whether they are finished, what they run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.target = cfg.target.path
        self.work = Path(cfg.output.work)
        self.layers_json = self.work / "layers.json"
        train = cfg.train
        if train.max_length is None and cfg.data.regenerate:
            # a prompt of up to 256 tokens and its answer, as far as the target's context holds them
            train = dataclasses.replace(train, max_length=self.length(None, cfg.data.answer_tokens + 256,
                                                                      "train.max_length", 1))
        self.train = train

    def length(self, given: int | None, default: int, key: str, reserve: int = 0) -> int | None:
        """A length the stages run the target on (``sequence_length``), checked before any stage
        runs; a target not yet there (``--dry-run``) is left to the stage."""
        from vllm_edsd.checkpoint.target import sequence_length

        if not (Path(self.target) / "config.json").is_file():
            return given if given is not None else default
        return sequence_length(self.target, given, default, key, reserve)

    def check_lengths(self) -> None:
        """The lengths the config sets, against the target's context: one line now rather than
        at the stage that reads them, after the stages before it ran."""
        self.length(self.cfg.layers.select_max_length, 0, "layers.select_max_length")
        self.length(self.cfg.train.max_length, 0, "train.max_length", 1)

    # -- data
    def prompts(self) -> Path:
        data = self.cfg.data
        if data.file:
            return Path(data.file)
        return self.work / f"prompts-{data.sharegpt_chat}chat-{data.sharegpt_code}code-seed{data.seed}.jsonl"

    def write_prompts(self) -> None:
        data = self.cfg.data
        if data.file:
            raise EDSDError(f"data.file: {data.file}: no such file")
        write_conversations(self.prompts(), drafter_prompts(data.sharegpt_chat, data.sharegpt_code,
                                                            data.seed, data.exclude))

    # -- regenerate
    def data(self) -> Path:
        """The conversations the drafters train on, named by what they hold."""
        data = self.cfg.data
        if not data.regenerate:
            return self.prompts()
        tokens = data.answer_tokens
        if not data.file:
            return self.work / (f"regenerated-{data.sharegpt_chat}chat-{data.sharegpt_code}code-"
                                f"{tokens}tokens-seed{data.seed}.jsonl")
        source = Path(data.file)
        digest = hashlib.sha256(source.read_bytes() if source.is_file() else b"")
        digest.update(str(self.train.max_samples).encode())
        return self.work / f"regenerated-{source.stem}-{digest.hexdigest()[:12]}-{tokens}tokens.jsonl"

    def regenerate(self) -> None:
        from vllm_edsd.data import load_conversations
        from vllm_edsd.regeneration.answers import regenerate

        data = self.cfg.data
        limit = self.train.max_samples if data.file else None
        answered = regenerate(self.target, load_conversations(self.prompts(), limit), self.work / "cache",
                              data.answer_tokens, self.cfg.target.vllm, device=self.train.device)
        write_conversations(self.data(), answered)

    # -- select, features, train, convert: `edsd` subcommands
    def select_argv(self) -> list[str]:
        layers = self.cfg.layers
        plot = ["--plot", str(self.work / "layers.png")] if importlib.util.find_spec("matplotlib") else []
        return ["select", self.target, "--data", str(self.data()), "--samples", str(layers.select_samples),
                *flags(max_length=layers.select_max_length), "--out", str(self.layers_json),
                *plot, *flags(seed=self.train.seed, device=self.train.device)]

    def feature_ids(self) -> str:
        if EDSD in self.train.methods and not self.cfg.layers.edsd and not self.layers_json.is_file():
            return "LAYERS_FROM_SELECT"  # --dry-run before select: EDSelect's and the other methods' layers
        return joined(feature_layers(self.cfg, self.layers_json))

    def features_argv(self) -> list[str]:
        engine, train = self.cfg.target.vllm, self.train
        return ["features", self.target, "--data", str(self.data()), "--cache", str(self.work / "cache"),
                "--feature-layers", self.feature_ids(),
                *flags(max_length=train.max_length, max_samples=train.max_samples, device=train.device),
                *self.backend_flag(), *(["--vllm-args", json.dumps(engine)] if engine else [])]

    def backend_flag(self) -> list[str]:
        """The features' backend, given to ``features`` and ``train`` alike: it is part of the
        shards' key, so train finds what features wrote."""
        backend = self.cfg.target.features_backend
        return ["--features-backend", backend] if backend else []

    def features_marker(self) -> Path:
        return self.work / "features.done"

    def features_finished(self) -> bool:
        """The same extraction finished before (the shards are content-named; the marker names
        the command that wrote them)."""
        marker = self.features_marker()
        return marker.is_file() and marker.read_text() == shlex.join(self.features_argv())

    def extract_features(self) -> None:
        argv = self.features_argv()
        run_command(argv)
        self.features_marker().write_text(shlex.join(argv))

    def train_argv(self, method: str, out: Path | None = None) -> list[str]:
        """``edsd train`` for one method, into ``out`` (default ``WORK/METHOD``)."""
        given = getattr(self.cfg.layers, method)
        if given:
            own = ["--layers", joined(given)]
        else:
            own = ["--layers-from", str(self.layers_json)] if METHODS[method].default_layers is None else []
        return ["train", self.target, "--out", str(out or self.work / method), "--method", method, *own,
                "--data", str(self.data()), *flags(**self.train.budget(method)),
                "--cache", str(self.work / "cache"), "--feature-layers", self.feature_ids(), *self.backend_flag()]

    def converted(self) -> Path:
        return self.work / "edsd-vllm"

    def convert_argv(self) -> list[str]:
        out = self.cfg.output
        verifier = ["--verifier", self.cfg.target.verifier] if self.cfg.target.verifier else []
        dtype = ["--dtype", out.dtype] if out.dtype else []
        return ["convert", str(self.work / EDSD / "final"), str(self.converted()), "--target", self.target,
                *verifier, *dtype, "--force"]

    def stages(self) -> list[Stage]:
        data, methods = self.cfg.data, self.train.methods
        stages = [
            Stage("data", self.prompts(), self.prompts().is_file, self.write_prompts,
                  lambda: f"given: {data.file}" if data.file else
                  f"write {data.sharegpt_chat} chat + {data.sharegpt_code} code ShareGPT prompts"),
            Stage("regenerate", self.data(), self.data().is_file, self.regenerate,
                  lambda: f"the target answers the prompts through vLLM, else transformers "
                          f"({data.answer_tokens} tokens at most)",
                  None if data.regenerate else "data.regenerate is false"),
            command_stage("select", self.layers_json, self.layers_json.is_file, self.select_argv,
                          "layers.edsd given" if self.cfg.layers.edsd else
                          None if EDSD in methods else f"no {EDSD} in train.methods"),
            Stage("features", self.features_marker(), self.features_finished, self.extract_features,
                  lambda: "edsd " + shlex.join(self.features_argv())),
        ]
        for method in methods:
            final = self.work / method / "final"
            stages.append(command_stage(f"train-{method}", final, lambda f=final: finished_checkpoint(f),
                                        lambda m=method: self.train_argv(m)))
        stages.append(command_stage("convert", self.converted(), lambda: finished_checkpoint(self.converted()),
                                    self.convert_argv,
                                    None if EDSD in methods and self.cfg.output.convert else
                                    "output.convert is false" if EDSD in methods else f"no {EDSD} drafter"))
        return stages


@dataclass
class Stage:
    """One step of the pipeline: finished when its output is, else ``make`` writes it."""

    name: str
    output: Path
    finished: Callable[[], bool]
    make: Callable[[], None]
    show: Callable[[], str]  # what it runs, for --dry-run and the log
    skipped: str | None = None  # why it does not run at all


def command_stage(name: str, output: Path, finished: Callable[[], bool], argv: Callable[[], list[str]],
                  skipped: str | None = None) -> Stage:
    """A stage that is one ``edsd`` subcommand."""
    return Stage(name, output, finished, lambda: run_command(argv()), lambda: "edsd " + shlex.join(argv()), skipped)


# ---------------------------------------------------------------- running them


@dataclass
class Outcome:
    stage: Stage
    status: str  # done now, already done, skipped, failed, not run
    seconds: float | None = None


def execute(stages: list[Stage], stop_after: str | None = None) -> list[Outcome]:
    """Run the stages not finished, in order, up to ``stop_after``; what became of each."""
    outcomes = []
    stopped = False
    for stage in stages:
        if stopped:
            outcomes.append(Outcome(stage, "not run"))
        elif stage.skipped:
            outcomes.append(Outcome(stage, "skipped"))
        elif stage.finished():
            outcomes.append(Outcome(stage, "already done"))
        else:
            print(f"== {stage.name}: {stage.show()}", flush=True)
            started = time.time()
            outcome = Outcome(stage, "failed")
            outcomes.append(outcome)
            try:
                stage.make()
            except BaseException:
                outcome.seconds = time.time() - started
                print(summary(outcomes), file=sys.stderr)
                raise
            outcome.status, outcome.seconds = "done now", time.time() - started
        stopped = stopped or stage.name == stop_after or (stop_after == "train" and is_last_training(stage, stages))
    return outcomes


def is_last_training(stage: Stage, stages: list[Stage]) -> bool:
    return stage.name == [s.name for s in stages if s.name.startswith("train-")][-1]


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 60 else f"{seconds / 60:.1f}min"


def summary(outcomes: list[Outcome]) -> str:
    """A table a person reads at a glance: stage, what became of it, time, output."""
    rows = [("stage", "status", "time", "output")]
    for o in outcomes:
        output = f"({o.stage.skipped})" if o.status == "skipped" else str(o.stage.output)
        rows.append((o.stage.name, o.status, duration(o.seconds), output))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows)


def dry_run(stages: list[Stage]) -> str:
    """Each stage: whether it is done, and what it would run."""
    lines = []
    for stage in stages:
        state = f"skipped ({stage.skipped})" if stage.skipped else "done" if stage.finished() else "to do"
        lines.append(f"{stage.name}: {state}\n    {stage.show()}\n    -> {stage.output}")
    return "\n".join(lines)


def run_pipeline(cfg: Config, stop_after: str | None = None, dry: bool = False) -> list[Outcome]:
    """The stages of ``cfg`` that are not yet done (``dry``: only say what they would run)."""
    if not (Path(cfg.target.path) / "config.json").is_file():
        raise EDSDError(f"target.path: {cfg.target.path} is not a model directory (no config.json)")
    plan = Plan(cfg)
    plan.check_lengths()
    stages = plan.stages()
    if stop_after not in (None, "train", *(s.name for s in stages)):
        raise EDSDError(f"--stop-after {stop_after}: not a stage of this config ({', '.join(s.name for s in stages)})")
    if dry:
        print(dry_run(stages))
        return []
    plan.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    outcomes = execute(stages, stop_after)
    print(f"\n{summary(outcomes)}\npipeline: {(time.time() - started) / 60:.1f} min this run, in {plan.work}")
    return outcomes
