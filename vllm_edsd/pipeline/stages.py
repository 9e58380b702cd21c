"""The pipeline's stages (``Plan``: each one's output, whether it is finished, the options it
runs with) and the runner (``run_pipeline``): the stages not yet done run in order, each
skipped when its output is finished; an interrupted one goes on where it stopped when the same
config is rerun. A stage of the flow is a call of its room's typed API (``run(options)``),
shown as the ``edsd`` command that does the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import file_hash, finished_checkpoint
from vllm_edsd.command import command_line
from vllm_edsd.conversion.stage import ConvertOptions
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.stage import FeaturesOptions
from vllm_edsd.methods import METHODS
from vllm_edsd.methods.registry import EDSD
from vllm_edsd.regeneration.stage import RegenerateOptions
from vllm_edsd.selection.stage import SelectOptions, chosen_with
from vllm_edsd.training.options import TrainOptions

from .config import Config
from .conversations import drafter_prompts, write_conversations

# What --dry-run shows for the feature layers before EDSelect has chosen its own.
LAYERS_FROM_SELECT = "LAYERS_FROM_SELECT"


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


def set_only(**values: Any) -> dict[str, Any]:
    """The values the config sets (an unset one, None, leaves the stage's own default)."""
    return {key: value for key, value in values.items() if value is not None}


class Plan:
    """The stages of one config: their outputs, whether they are finished, the options each
    stage runs with."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.target = cfg.target.path
        self.work = Path(cfg.output.work)
        self.layers_json = self.work / "layers.json"
        self.cache = str(self.work / "cache")
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
        digest = file_hash(source) if source.is_file() else hashlib.sha256()
        digest.update(str(self.train.max_samples).encode())
        return self.work / f"regenerated-{source.stem}-{digest.hexdigest()[:12]}-{tokens}tokens.jsonl"

    def regenerate_options(self) -> RegenerateOptions:
        """The target answers the prompts (of a given file, as many as training reads)."""
        data = self.cfg.data
        return RegenerateOptions(target=self.target, out=str(self.data()), data=str(self.prompts()),
                                 max_samples=self.train.max_samples if data.file else None,
                                 answer_tokens=data.answer_tokens, cache=self.cache, device=self.train.device,
                                 vllm_args=self.cfg.target.vllm)

    # -- select, features, train, convert
    def select_options(self) -> SelectOptions:
        layers = self.cfg.layers
        plot = str(self.work / "layers.png") if importlib.util.find_spec("matplotlib") else None
        return SelectOptions(target=self.target, out=str(self.layers_json), data=str(self.data()),
                             samples=layers.select_samples, max_length=layers.select_max_length, plot=plot,
                             **set_only(seed=self.train.seed, device=self.train.device))

    def layers_chosen(self) -> bool:
        """EDSelect's choice is there and was made on this run's calibration data and settings;
        one made on other data is chosen again, and the log says why."""
        if not self.layers_json.is_file():
            return False
        if chosen_with(self.layers_json, self.select_options()):
            return True
        print(f"{self.layers_json}: chosen on other calibration data or settings (its \"calibration\"); "
              "choosing again", flush=True)
        return False

    def feature_ids(self) -> tuple[int, ...] | None:
        """Every method's layers, or None before EDSelect has chosen those it chooses (a
        ``--dry-run`` before ``select``)."""
        if any(map(self.selects_layers, self.train.methods)) and not self.layers_json.is_file():
            return None
        return tuple(feature_layers(self.cfg, self.layers_json))

    def selects_layers(self, method: str) -> bool:
        """Whether ``method`` trains on EDSelect's layers: the config names none, nor does the method."""
        return not getattr(self.cfg.layers, method) and METHODS[method].default_layers is None

    def features_options(self) -> FeaturesOptions:
        train = self.train
        return FeaturesOptions(target=self.target, data=str(self.data()), cache=self.cache,
                               feature_layers=self.feature_ids() or (), vllm_args=self.cfg.target.vllm,
                               **set_only(max_length=train.max_length, max_samples=train.max_samples,
                                          device=train.device, features_backend=self.cfg.target.features_backend))

    def features_marker(self) -> Path:
        return self.work / "features.done"

    def features_finished(self) -> bool:
        """The same extraction finished before (the shards are content-named; the marker names
        the command that wrote them)."""
        marker = self.features_marker()
        return marker.is_file() and marker.read_text() == self.shown("features", self.features_options())

    def extract_features(self) -> None:
        from vllm_edsd.features.stage import run

        options = self.features_options()
        run(options)
        self.features_marker().write_text(self.shown("features", options))

    def train_options(self, method: str, out: Path | None = None) -> TrainOptions:
        """``edsd train``'s options for one method, into ``out`` (default ``WORK/METHOD``): the
        same data, features, budget and seed for every method; the features' backend is part of
        the shards' key, so training finds what ``features`` wrote."""
        given = getattr(self.cfg.layers, method)
        return TrainOptions(target=self.target, out=str(out or self.work / method), method=method,
                            layers=tuple(given) if given else None,
                            layers_from=str(self.layers_json) if self.selects_layers(method) else None,
                            data=str(self.data()), cache=self.cache, feature_layers=self.feature_ids(),
                            **set_only(features_backend=self.cfg.target.features_backend,
                                       **self.train.budget(method)))

    def converted(self) -> Path:
        return self.work / f"{EDSD}-vllm"

    def convert_options(self) -> ConvertOptions:
        out = self.cfg.output
        return ConvertOptions(src=str(self.work / EDSD / "final"), dst=str(self.converted()), target=self.target,
                              verifier=self.cfg.target.verifier, dtype=out.dtype, force=True)

    def shown(self, name: str, options: Any) -> str:
        """The ``edsd`` command equivalent to a stage's options (what --dry-run and the log
        show); feature layers not chosen yet are named so."""
        unknown = {"feature_layers": LAYERS_FROM_SELECT} if self.feature_ids() is None else {}
        return "edsd " + shlex.join(command_line(name, options, **unknown))

    def stages(self) -> list[Stage]:
        from vllm_edsd.conversion.stage import run as convert
        from vllm_edsd.regeneration.stage import run as regenerate
        from vllm_edsd.selection.stage import run as select
        from vllm_edsd.training.stage import run as train

        data, methods = self.cfg.data, self.train.methods
        stages = [
            Stage("data", self.prompts(), self.prompts().is_file, self.write_prompts,
                  lambda: f"given: {data.file}" if data.file else
                  f"write {data.sharegpt_chat} chat + {data.sharegpt_code} code ShareGPT prompts"),
            self.stage("regenerate", self.data(), self.data().is_file, regenerate, self.regenerate_options,
                       None if data.regenerate else "data.regenerate is false"),
            self.stage("select", self.layers_json, self.layers_chosen, select, self.select_options,
                       f"layers.{EDSD} given" if getattr(self.cfg.layers, EDSD) else
                       None if EDSD in methods else f"no {EDSD} in train.methods"),
            Stage("features", self.features_marker(), self.features_finished, self.extract_features,
                  lambda: self.shown("features", self.features_options())),
        ]
        for method in methods:
            final = self.work / method / "final"
            stages.append(self.stage(f"train-{method}", final, lambda f=final: finished_checkpoint(f), train,
                                     lambda m=method: self.train_options(m), command="train"))
        stages.append(self.stage("convert", self.converted(), lambda: finished_checkpoint(self.converted()),
                                 convert, self.convert_options,
                                 None if EDSD in methods and self.cfg.output.convert else
                                 "output.convert is false" if EDSD in methods else f"no {EDSD} drafter"))
        return stages

    def stage(self, name: str, output: Path, finished: Callable[[], bool], run: Callable[[Any], Any],
              options: Callable[[], Any], skipped: str | None = None, command: str | None = None) -> Stage:
        """A stage that is one call of a stage's typed API (``run(options())``), shown as the
        ``edsd`` command that does the same."""
        return Stage(name, output, finished, lambda: run(options()),
                     lambda: self.shown(command or name, options()), skipped)


@dataclass
class Stage:
    """One step of the pipeline: finished when its output is, else ``make`` writes it."""

    name: str
    output: Path
    finished: Callable[[], bool]
    make: Callable[[], None]
    show: Callable[[], str]  # what it runs, for --dry-run and the log
    skipped: str | None = None  # why it does not run at all


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
