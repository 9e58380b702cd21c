"""``edsd pipeline CONFIG``: one TOML file says how a drafter is made (the target, the data, the
layers, the training budget, the output), and the stages not yet done run, in the order of the
data flow (docs/architecture.md):

1. ``data``          the conversations: a JSON(L) file, or first user turns of ShareGPT (seeded);
2. ``regenerate``    the target answers them through vLLM (greedy), so the drafters learn the
   target's own distribution (optional);
3. ``select``        EDSelect's two layers (``edsd select``), unless ``[layers] edsd`` names them;
4. ``features``      the target's features for every method's layers, extracted once
   (``edsd features``: by vLLM where the installed vLLM can, docs/scale.md);
5. ``train-METHOD``  ``edsd train`` per method: same data, order, seed and budget;
6. ``convert``       the EDSD drafter to vLLM's layout (``edsd convert``), checked against the target.

A stage is skipped when its output is finished (a data file written, a complete checkpoint);
an interrupted one goes on where it stopped (training from its last epoch): rerun the same
command. Relative paths in the file are relative to the file.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import importlib.util
import json
import re
import shlex
import sys
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import finished_checkpoint, replace_file
from vllm_edsd.errors import EDSDError, is_int, positive_int
from vllm_edsd.features.shards import BACKENDS  # what runs the target for its features

EXAMPLE = """\
# edsd pipeline smollm2.toml            (relative paths are relative to this file)
[target]
path = "models/SmolLM2-135M-Instruct"   # transformers directory (required)
verifier = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the target the converted drafter names (optional)
# features_backend = "auto"              # vllm where it can extract (auto), or transformers
# [target.vllm]                          # passed to vLLM's LLM(...): regeneration, features
# tensor_parallel_size = 2

[data]
sharegpt_chat = 480                      # first user turns of ShareGPT: chat requests...
sharegpt_code = 240                      # ...and code requests (these need regenerate = true)
seed = 0                                 # their order
# file = "conversations.jsonl"           # or your conversations (what `edsd train --data` reads)
regenerate = true                        # the target answers them (vLLM, greedy)
answer_tokens = 192

[layers]
# edsd = [8, 20]                         # EDSD's two aux layers (default: EDSelect picks them)
select_samples = 64
select_max_length = 384

[train]                                  # a key left out: `edsd train`'s default
methods = ["edsd", "eagle3"]
epochs = 5
ttt_steps = 4
lr = 1e-3
batch_size = 8
draft_vocab_size = 4096
# max_length = 448                       # default: answer_tokens + 256 when regenerating (at most the
                                         # target's context less one, like every length here)
seed = 0
device = "cuda"
# save_every = 500                       # batches: also save the state within an epoch (resumable)

[output]
work = "runs/smollm2"                    # data, caches, checkpoints, logs (rerun to resume)
dtype = "float16"                        # the converted EDSD drafter's weights
"""

REQUIRED = object()
# section -> key -> (type, default); None: the stage's own default (the flag is not passed).
SCHEMA: dict[str, dict[str, tuple[Any, Any]]] = {
    "target": {"path": (str, REQUIRED), "verifier": (str, None), "vllm": (dict, {}), "features_backend": (str, None)},
    "data": {"file": (str, None), "sharegpt_chat": (int, 0), "sharegpt_code": (int, 0), "seed": (int, 0),
             "exclude": (list[str], []), "regenerate": (bool, False), "answer_tokens": (int, 192)},
    "layers": {"edsd": (list[int], None), "eagle3": (list[int], None), "select_samples": (int, 128),
               "select_max_length": (int, None)},
    "train": {"methods": (list[str], ["edsd"]), "epochs": (int, None), "ttt_steps": (int, None),
              "lr": (float, None), "lr_schedule": (str, None), "warmup": (float, None),
              "weight_decay": (float, None), "batch_size": (int, None), "draft_vocab_size": (int, None),
              "max_length": (int, None), "max_samples": (int, None), "seed": (int, None), "device": (str, None),
              "feature_noise": (float, None), "save_every": (int, None)},
    "output": {"work": (str, REQUIRED), "dtype": (str, None), "convert": (bool, True)},
}
PATHS = (("target", "path"), ("data", "file"), ("output", "work"))  # relative to the config file
# Counts of 1 or more, refused here: the stage that reads one would refuse it only when it runs, hours in.
POSITIVE = (("data", "answer_tokens"), ("layers", "select_max_length"), ("train", "epochs"), ("train", "ttt_steps"),
            ("train", "batch_size"), ("train", "draft_vocab_size"), ("train", "max_length"), ("train", "max_samples"))
METHODS = ("edsd", "eagle3")
DTYPES = ("float16", "bfloat16", "float32")
# The `edsd` subcommands the stages run, each through its own module.
COMMANDS = {"select": "vllm_edsd.selection.cli", "features": "vllm_edsd.features.cli",
            "train": "vllm_edsd.training.cli", "convert": "vllm_edsd.conversion.cli"}
PROMPT_CHARS = 600  # ShareGPT prompts are cut: training cost grows with every token of context
CODE_REQUEST = re.compile(r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|function|code|script|"
                          r"class|regex|bash|html|css|program)\b", re.IGNORECASE)

Config = dict[str, dict[str, Any]]


# ---------------------------------------------------------------- the config file


def read_toml(path: Path) -> dict:
    """The file's tables, or one line saying why not."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise EDSDError(f"{path}: cannot read the config ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise EDSDError(f"{path}: not a text file, so not a TOML config ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise EDSDError(f"{path}: not valid TOML ({exc})") from None


def type_fits(value: Any, kind: Any) -> bool:
    """TOML's value against the schema's type (an integer is a float; a boolean is no integer)."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(type_fits(v, item) for v in value)
    if kind is float:
        return is_int(value) or isinstance(value, float)
    if kind is int:
        return is_int(value)
    return isinstance(value, kind)


def type_name(kind: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            dict: "a table"}.get(kind) or f"a list of {type_name(typing.get_args(kind)[0]).split()[-1]}s"


def check_section(where: Path, section: str, values: Any) -> dict[str, Any]:
    """One table with every key known and typed, the defaults filled in."""
    if not isinstance(values, dict):
        raise EDSDError(f"{where}: [{section}] must be a table")
    schema = SCHEMA[section]
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise EDSDError(f"{where}: unknown key {section}.{unknown[0]} (known: {', '.join(schema)})")
    out = {}
    for key, (kind, default) in schema.items():
        if key not in values:
            if default is REQUIRED:
                raise EDSDError(f"{where}: missing {section}.{key}")
            out[key] = copy.deepcopy(default)  # a table's default is never shared
        elif not type_fits(values[key], kind):
            raise EDSDError(f"{where}: {section}.{key} must be {type_name(kind)}, got {values[key]!r}")
        else:
            out[key] = values[key]
    return out


def check_meaning(where: Path, cfg: Config) -> None:
    """What the types cannot say: one source of data, known methods, the layers' counts."""
    data, train = cfg["data"], cfg["train"]
    sharegpt = data["sharegpt_chat"] or data["sharegpt_code"]
    if bool(data["file"]) == bool(sharegpt):
        raise EDSDError(f"{where}: [data] needs either file or sharegpt_chat/sharegpt_code (one of them)")
    if sharegpt and not data["regenerate"]:
        raise EDSDError(f"{where}: data.sharegpt_* are prompts without answers: set data.regenerate = true")
    if min(data["sharegpt_chat"], data["sharegpt_code"]) < 0:
        raise EDSDError(f"{where}: data.sharegpt_chat and sharegpt_code must be >= 0")
    for section, key in POSITIVE:
        if cfg[section][key] is not None:
            positive_int(cfg[section][key], f"{where}: {section}.{key}")
    methods = train["methods"]
    if not methods or len(set(methods)) != len(methods) or not set(methods) <= set(METHODS):
        raise EDSDError(f"{where}: train.methods must name distinct methods of {list(METHODS)}, got {methods}")
    for method, count in (("edsd", 2), ("eagle3", 3)):
        ids = cfg["layers"][method]
        if ids is not None and len(set(ids)) != count:
            raise EDSDError(f"{where}: layers.{method} must be {count} distinct layer ids, got {ids}")
    backend = cfg["target"]["features_backend"]
    if backend not in (None, *BACKENDS):
        raise EDSDError(f"{where}: target.features_backend must be one of {list(BACKENDS)}, got {backend!r}")
    if cfg["output"]["dtype"] not in (None, *DTYPES):
        raise EDSDError(f"{where}: output.dtype must be one of {list(DTYPES)}, got {cfg['output']['dtype']!r}")


def load_config(path: str | Path, overrides: Config | None = None) -> Config:
    """The checked config of ``path``, ``overrides`` (section -> key -> value) over its values,
    its relative paths made absolute from the file's directory."""
    path = Path(path)
    raw = read_toml(path)
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    unknown = sorted(set(raw) - set(SCHEMA))
    if unknown:
        raise EDSDError(f"{path}: unknown section [{unknown[0]}] (known: {', '.join(SCHEMA)})")
    cfg = {section: check_section(path, section, raw.get(section, {})) for section in SCHEMA}
    check_meaning(path, cfg)
    for section, key in PATHS:
        if cfg[section][key] is not None:
            cfg[section][key] = str(path.parent.absolute() / Path(cfg[section][key]).expanduser())
    return cfg


# ---------------------------------------------------------------- what each stage does


def run_command(argv: list[str]) -> None:
    """``edsd NAME ARGS...`` through the subcommand's own module (the ``edsd`` table is above
    the pipeline)."""
    from vllm_edsd.command import call

    if call(importlib.import_module(COMMANDS[argv[0]]), argv[1:]) != 0:
        raise EDSDError(f"the pipeline stopped at `edsd {shlex.join(argv)}`")


def drafter_prompts(chat: int, code: int, seed: int, exclude: Iterable[str] = ()) -> list[list[dict]]:
    """``chat`` + ``code`` single-turn prompts: distinct first user turns of ShareGPT in a seeded
    order, none of them in ``exclude`` (held-out prompts); a prompt is "code" when it names a
    language or code. They stay in that order, chat and code mixed, so a larger request extends a
    smaller one (its regenerated chunks are reused) and any prefix is a sample of both kinds."""
    from vllm_edsd.data import load_sharegpt

    held_out = set(exclude)
    wanted, counts = {"chat": chat, "code": code}, {"chat": 0, "code": 0}
    picked: list[str] = []
    seen: set[str] = set()
    for conv in load_sharegpt(None, seed):
        first = next((m["content"].strip() for m in conv if m["role"] == "user"), "")[:PROMPT_CHARS]
        if len(first) < 16 or first in seen or first in held_out:
            continue
        kind = "code" if CODE_REQUEST.search(first) else "chat"
        if counts[kind] < wanted[kind]:
            picked.append(first)
            seen.add(first)
            counts[kind] += 1
        if counts == wanted:
            break
    if counts != wanted:
        raise EDSDError(f"ShareGPT gave {counts['chat']} chat and {counts['code']} code prompts here; "
                        f"{chat} and {code} requested")
    return [[{"role": "user", "content": text}] for text in picked]


def write_conversations(path: Path, conversations: list) -> None:
    """JSON lines of ``{"messages": [...]}``, written whole or not at all."""
    replace_file(path, lambda tmp: tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations)))


def feature_layers(cfg: Config, layers_json: Path) -> list[int]:
    """Every method's layers (EDSD's from EDSelect or the config, EAGLE-3's from the config or
    vLLM's default): the features all drafters train on, extracted once."""
    from vllm_edsd.checkpoint.config import decoder_layers
    from vllm_edsd.training.drafter import eagle3_default_layers

    ids: set[int] = set()
    if "edsd" in cfg["train"]["methods"]:
        ids |= set(cfg["layers"]["edsd"] or json.loads(layers_json.read_text())["aux_layer_ids"])
    if "eagle3" in cfg["train"]["methods"]:
        ids |= set(cfg["layers"]["eagle3"] or eagle3_default_layers(decoder_layers(cfg["target"]["path"])))
    return sorted(ids)


def joined(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def flags(values: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """``--key value`` for each key that is set (an unset one: the command's own default)."""
    return [arg for key in keys if values[key] is not None for arg in (f"--{key.replace('_', '-')}", str(values[key]))]


BUDGET = ("epochs", "ttt_steps", "lr", "lr_schedule", "warmup", "weight_decay", "batch_size", "draft_vocab_size",
          "max_length", "max_samples", "seed", "device", "feature_noise", "save_every")


class Plan:
    """The stages of one config: their outputs, whether they are finished, what they run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.target = cfg["target"]["path"]
        self.work = Path(cfg["output"]["work"])
        self.layers_json = self.work / "layers.json"
        train = dict(cfg["train"])
        if train["max_length"] is None and cfg["data"]["regenerate"]:
            # a prompt of up to 256 tokens and its answer, as far as the target's context holds them
            train["max_length"] = self.length(None, cfg["data"]["answer_tokens"] + 256, "train.max_length", 1)
        self.train = train

    def length(self, given: int | None, default: int, key: str, reserve: int = 0) -> int | None:
        """A length the stages run the target on (``sequence_length``), checked before any stage
        runs; a target not yet there (``--dry-run``) is left to the stage."""
        from vllm_edsd.checkpoint.config import sequence_length

        if not (Path(self.target) / "config.json").is_file():
            return given if given is not None else default
        return sequence_length(self.target, given, default, key, reserve)

    def check_lengths(self) -> None:
        """The lengths the config sets, against the target's context: one line now rather than
        at the stage that reads them, after the stages before it ran."""
        self.length(self.cfg["layers"]["select_max_length"], 0, "layers.select_max_length")
        self.length(self.cfg["train"]["max_length"], 0, "train.max_length", 1)

    # -- data
    def prompts(self) -> Path:
        data = self.cfg["data"]
        if data["file"]:
            return Path(data["file"])
        return self.work / f"prompts-{data['sharegpt_chat']}chat-{data['sharegpt_code']}code-seed{data['seed']}.jsonl"

    def write_prompts(self) -> None:
        data = self.cfg["data"]
        if data["file"]:
            raise EDSDError(f"data.file: {data['file']}: no such file")
        write_conversations(self.prompts(), drafter_prompts(data["sharegpt_chat"], data["sharegpt_code"],
                                                            data["seed"], data["exclude"]))

    # -- regenerate
    def data(self) -> Path:
        """The conversations the drafters train on, named by what they hold."""
        data = self.cfg["data"]
        if not data["regenerate"]:
            return self.prompts()
        tokens = data["answer_tokens"]
        if not data["file"]:
            return self.work / (f"regenerated-{data['sharegpt_chat']}chat-{data['sharegpt_code']}code-"
                                f"{tokens}tokens-seed{data['seed']}.jsonl")
        source = Path(data["file"])
        digest = hashlib.sha256(source.read_bytes() if source.is_file() else b"")
        digest.update(str(self.train["max_samples"]).encode())
        return self.work / f"regenerated-{source.stem}-{digest.hexdigest()[:12]}-{tokens}tokens.jsonl"

    def regenerate(self) -> None:
        from vllm_edsd.data import load_conversations
        from vllm_edsd.regeneration.answers import regenerate

        data = self.cfg["data"]
        limit = self.train["max_samples"] if data["file"] else None
        answered = regenerate(self.target, load_conversations(self.prompts(), limit), self.work / "cache",
                              data["answer_tokens"], self.cfg["target"]["vllm"], device=self.train["device"])
        write_conversations(self.data(), answered)

    # -- select, features, train, convert: `edsd` subcommands
    def select_argv(self) -> list[str]:
        layers = self.cfg["layers"]
        plot = ["--plot", str(self.work / "layers.png")] if importlib.util.find_spec("matplotlib") else []
        return ["select", self.target, "--data", str(self.data()), "--samples", str(layers["select_samples"]),
                *flags({"max_length": layers["select_max_length"]}, ("max_length",)), "--out", str(self.layers_json),
                *plot, *flags(self.train, ("seed", "device"))]

    def feature_ids(self) -> str:
        if "edsd" in self.train["methods"] and not self.cfg["layers"]["edsd"] and not self.layers_json.is_file():
            return "LAYERS_FROM_SELECT"  # --dry-run before select: EDSelect's and the other methods' layers
        return joined(feature_layers(self.cfg, self.layers_json))

    def features_argv(self) -> list[str]:
        engine = self.cfg["target"]["vllm"]
        return ["features", self.target, "--data", str(self.data()), "--cache", str(self.work / "cache"),
                "--feature-layers", self.feature_ids(), *flags(self.train, ("max_length", "max_samples", "device")),
                *self.backend_flag(), *(["--vllm-args", json.dumps(engine)] if engine else [])]

    def backend_flag(self) -> list[str]:
        """The features' backend, given to ``features`` and ``train`` alike: it is part of the
        shards' key, so train finds what features wrote."""
        backend = self.cfg["target"]["features_backend"]
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
        given = self.cfg["layers"][method]
        if given:
            own = ["--layers", joined(given)]
        else:
            own = ["--layers-from", str(self.layers_json)] if method == "edsd" else []
        return ["train", self.target, "--out", str(out or self.work / method), "--method", method, *own,
                "--data", str(self.data()), *flags(self.train, BUDGET),
                "--cache", str(self.work / "cache"), "--feature-layers", self.feature_ids(), *self.backend_flag()]

    def converted(self) -> Path:
        return self.work / "edsd-vllm"

    def convert_argv(self) -> list[str]:
        out = self.cfg["output"]
        verifier = ["--verifier", self.cfg["target"]["verifier"]] if self.cfg["target"]["verifier"] else []
        dtype = ["--dtype", out["dtype"]] if out["dtype"] else []
        return ["convert", str(self.work / "edsd" / "final"), str(self.converted()), "--target", self.target,
                *verifier, *dtype, "--force"]

    def stages(self) -> list[Stage]:
        data, methods = self.cfg["data"], self.train["methods"]
        stages = [
            Stage("data", self.prompts(), self.prompts().is_file, self.write_prompts,
                  lambda: f"given: {data['file']}" if data["file"] else
                  f"write {data['sharegpt_chat']} chat + {data['sharegpt_code']} code ShareGPT prompts"),
            Stage("regenerate", self.data(), self.data().is_file, self.regenerate,
                  lambda: f"the target answers the prompts through vLLM, else transformers "
                          f"({data['answer_tokens']} tokens at most)",
                  None if data["regenerate"] else "data.regenerate is false"),
            command_stage("select", self.layers_json, self.layers_json.is_file, self.select_argv,
                          "layers.edsd given" if self.cfg["layers"]["edsd"] else
                          None if "edsd" in methods else "no edsd in train.methods"),
            Stage("features", self.features_marker(), self.features_finished, self.extract_features,
                  lambda: "edsd " + shlex.join(self.features_argv())),
        ]
        for method in methods:
            final = self.work / method / "final"
            stages.append(command_stage(f"train-{method}", final, lambda f=final: finished_checkpoint(f),
                                        lambda m=method: self.train_argv(m)))
        stages.append(command_stage("convert", self.converted(), lambda: finished_checkpoint(self.converted()),
                                    self.convert_argv,
                                    None if "edsd" in methods and self.cfg["output"]["convert"] else
                                    "output.convert is false" if "edsd" in methods else "no edsd drafter"))
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
    if not (Path(cfg["target"]["path"]) / "config.json").is_file():
        raise EDSDError(f"target.path: {cfg['target']['path']} is not a model directory (no config.json)")
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


# ---------------------------------------------------------------- the `edsd pipeline` subcommand (vllm_edsd.command)

name = "pipeline"
help = "make a drafter from one TOML description: data, regeneration, layers, features, training, conversion"
STAGE_NAMES = ("data", "regenerate", "select", "features", "train-edsd", "train-eagle3", "train", "convert")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = ("examples:\n  edsd pipeline --example > smollm2.toml   # a commented config to start from\n"
                     "  edsd pipeline smollm2.toml --dry-run      # what each stage would run, what is done\n"
                     "  edsd pipeline smollm2.toml                # run (rerun to resume)\n"
                     "  edsd pipeline smollm2.toml --stop-after select\n\nan example config:\n\n" + EXAMPLE)
    parser.add_argument("config", nargs="?", help="the TOML file")
    parser.add_argument("--stop-after", choices=STAGE_NAMES, help="stop after this stage ('train': after all)")
    parser.add_argument("--dry-run", action="store_true", help="print what each stage would run and what is done")
    parser.add_argument("--example", action="store_true", help="print an example config and exit")


def run(args: argparse.Namespace) -> int:
    if args.example:
        print(EXAMPLE, end="")
        return 0
    if not args.config:
        raise EDSDError("name a config file (edsd pipeline --example prints one)")
    run_pipeline(load_config(args.config), args.stop_after, args.dry_run)
    return 0
