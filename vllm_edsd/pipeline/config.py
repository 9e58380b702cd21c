"""The ``edsd pipeline`` config file: one dataclass per TOML table (``Target``, ``Data``,
``Layers``, ``Train``, ``Output``, gathered in ``Config``) whose fields are the table's keys,
with their types, defaults and what else a value must be (field metadata: ``RELATIVE``,
``MINIMUM``, ``CHOICES``). ``load_config`` reads a file and checks it against them with one
walk over the fields, so a bad key, type or count is one line naming it before any stage runs.

A field whose type admits None is optional with None as its default: the stage's own default
(the flag is not passed). A field without a default is required.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import SUPPORTED_DTYPES
from vllm_edsd.errors import EDSDError, is_int, positive_int
from vllm_edsd.features.shards import BACKENDS  # what runs the target for its features
from vllm_edsd.methods import METHODS
from vllm_edsd.methods.edsd.config import TOKEN_NORMS
from vllm_edsd.methods.registry import EAGLE3, EDSD
from vllm_edsd.training.recipe import AUTOCAST_DTYPES

EXAMPLE = f"""\
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
methods = {json.dumps([EDSD, EAGLE3])}
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
# token_norm = "layernorm"               # EDSD's token-stream norm (default rmsnorm, SpecForge's)
# [train.eagle3]                         # one method's own values of [train]'s keys, over them
# lr = 5e-4

[output]
work = "runs/smollm2"                    # data, caches, checkpoints, logs (rerun to resume)
dtype = "float16"                        # the converted EDSD drafter's weights
"""

# What a field's metadata may say besides its type and default.
RELATIVE = "relative"  # True: a path, relative to the config file's directory
MINIMUM = "minimum"  # the least integer it may be
CHOICES = "choices"  # the values it may take
PATH = {RELATIVE: True}  # the metadata of a path field



def count(default: int | None = None) -> Any:
    """A field of 1 or more, refused when the file is read: the stage that reads it would refuse
    it only when it runs, hours in."""
    return field(default=default, metadata={MINIMUM: 1})


@dataclass(frozen=True)
class Target:
    """``[target]``: the model the drafters are made for, and how vLLM runs it."""

    path: str = field(metadata=PATH)  # a transformers directory
    verifier: str | None = None  # the target the converted drafter names
    vllm: dict = field(default_factory=dict)  # vLLM's LLM(...) arguments: regeneration, features
    features_backend: str | None = field(default=None, metadata={CHOICES: BACKENDS})


@dataclass(frozen=True)
class Data:
    """``[data]``: the conversations, from a file or first user turns of ShareGPT (seeded)."""

    file: str | None = field(default=None, metadata=PATH)
    sharegpt_chat: int = field(default=0, metadata={MINIMUM: 0})
    sharegpt_code: int = field(default=0, metadata={MINIMUM: 0})
    seed: int = 0  # the ShareGPT prompts' order
    exclude: list[str] = field(default_factory=list)  # held-out prompts, never sampled
    regenerate: bool = False  # the target answers the prompts
    answer_tokens: int = count(192)


@dataclass(frozen=True)
class Layers:
    """``[layers]``: each method's target layers (None: EDSelect's for EDSD, vLLM's default for
    EAGLE-3) and EDSelect's calibration."""

    edsd: list[int] | None = None
    eagle3: list[int] | None = None
    select_samples: int = 128
    select_max_length: int | None = count()


def other_methods_fields(method: str) -> set[str]:
    """The ``[train]`` keys of other methods' architectures that ``method``'s is without."""
    others = {name for m in METHODS.values() if m.name != method for name in m.own_train_fields}
    return others - set(METHODS[method].own_train_fields)


@dataclass(frozen=True)
class Train:
    """``[train]``: the methods, and the budget every one of them trains with: each key but
    ``methods`` is the ``edsd train`` flag of its name (``budget``)."""

    methods: list[str] = field(default_factory=lambda: [EDSD])
    # the sizes
    epochs: int | None = count()
    ttt_steps: int | None = count()
    batch_size: int | None = count()
    draft_vocab_size: int | None = count()
    max_length: int | None = count()
    max_samples: int | None = count()
    # the optimizer and the features' noise
    lr: float | None = None
    lr_schedule: str | None = None
    warmup: float | None = None
    weight_decay: float | None = None
    feature_noise: float | None = None
    autocast: str | None = field(default=None, metadata={CHOICES: AUTOCAST_DTYPES})  # the loss's forward in bfloat16
    # EDSD's architecture (EAGLE-3 has no such part: its runs leave these out)
    token_norm: str | None = field(default=None, metadata={CHOICES: TOKEN_NORMS})
    fuse_intermediate_size: int | None = count()  # EDFuse's width (default: the target's FFN)
    attention_reads_token: bool | None = None  # the draft layer also reads the token (not the paper's)
    feature_norm: bool | None = None  # EDFuse's gate reads the normed feature (not the paper's)
    fuse_residual: bool | None = None  # EDFuse adds its feature input to its output (not the paper's)
    # EAGLE 3.1's norms for both methods' runs: fc's input (norm_before_fc or fc_norm, not both), the residual
    norm_before_fc: bool | None = None  # one RMSNorm over fc's whole input
    fc_norm: bool | None = None  # one RMSNorm per target layer before fc
    norm_before_residual: bool | None = None  # the draft layer's residual is its normed input
    # EAGLE 3.1's fed-back state (EDSD's feature_norm is its own: its runs leave this out)
    norm_output: bool | None = None  # the fed-back state is the final norm's output
    # the run
    seed: int | None = None
    device: str | None = None
    save_every: int | None = None
    # ``[train.edsd]``, ``[train.eagle3]``: one method's own values of the keys above, over them
    edsd: dict = field(default_factory=dict)
    eagle3: dict = field(default_factory=dict)

    def for_method(self, method: str) -> Train:
        """The budget ``method`` trains with: ``[train]`` with ``[train.METHOD]`` over it."""
        return dataclasses.replace(self, **getattr(self, method))

    def budget(self, method: str) -> dict[str, Any]:
        """``method``'s ``edsd train`` flags, name -> value, in the order of the fields."""
        left_out = {"methods", *METHODS} | other_methods_fields(method)
        own = self.for_method(method)
        return {f.name: getattr(own, f.name) for f in dataclasses.fields(self) if f.name not in left_out}


@dataclass(frozen=True)
class Output:
    """``[output]``: where everything is written, and the converted drafter."""

    work: str = field(metadata=PATH)  # data, caches, checkpoints, logs
    dtype: str | None = field(default=None, metadata={CHOICES: SUPPORTED_DTYPES})  # the EDSD drafter's, converted
    convert: bool = True


@dataclass(frozen=True)
class Config:
    """The whole file: one field per table, typed by its dataclass."""

    target: Target
    data: Data
    layers: Layers
    train: Train
    output: Output


# ---------------------------------------------------------------- reading and checking


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


def value_type(hint: Any) -> Any:
    """The type a value in the file must have: ``X`` of ``X | None`` (None is a field's unset
    default, which a file cannot write)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (kind,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kind
    return hint


def type_fits(value: Any, kind: Any) -> bool:
    """TOML's value against a field's type (an integer is a float; a boolean is no integer)."""
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


def check_value(what: str, value: Any, kind: Any, rules: typing.Mapping[str, Any]) -> None:
    """One value against its field's type and metadata; ``what`` names it in the error."""
    if not type_fits(value, kind):
        raise EDSDError(f"{what} must be {type_name(kind)}, got {value!r}")
    least = rules.get(MINIMUM)
    if least == 1:
        positive_int(value, what)
    elif least is not None and value < least:
        raise EDSDError(f"{what} must be >= {least}, got {value!r}")
    if CHOICES in rules and value not in rules[CHOICES]:
        raise EDSDError(f"{what} must be one of {list(rules[CHOICES])}, got {value!r}")


def is_required(spec: dataclasses.Field) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


def check_section(where: Path, section: str, schema: type, values: Any) -> Any:
    """One table as an instance of its dataclass ``schema``: every key known and checked, the
    defaults filled in, relative paths made absolute from the file's directory."""
    if not isinstance(values, dict):
        raise EDSDError(f"{where}: [{section}] must be a table")
    specs = dataclasses.fields(schema)
    unknown = sorted(set(values) - {spec.name for spec in specs})
    if unknown:
        raise EDSDError(f"{where}: unknown key {section}.{unknown[0]} (known: {', '.join(s.name for s in specs)})")
    hints = typing.get_type_hints(schema)
    given = {}
    for spec in specs:
        if spec.name not in values:
            if is_required(spec):
                raise EDSDError(f"{where}: missing {section}.{spec.name}")
            continue
        value = values[spec.name]
        check_value(f"{where}: {section}.{spec.name}", value, value_type(hints[spec.name]), spec.metadata)
        if spec.metadata.get(RELATIVE) and value:  # "": no path, as a key left out
            value = str(where.parent.absolute() / Path(value).expanduser())
        given[spec.name] = value
    return schema(**given)


def check_meaning(where: Path, cfg: Config) -> None:
    """What one field's type and metadata cannot say: one source of data, distinct known
    methods, each method's count of layers, a combination of switches a method refuses."""
    data = cfg.data
    sharegpt = data.sharegpt_chat or data.sharegpt_code
    if bool(data.file) == bool(sharegpt):
        raise EDSDError(f"{where}: [data] needs either file or sharegpt_chat/sharegpt_code (one of them)")
    if sharegpt and not data.regenerate:
        raise EDSDError(f"{where}: data.sharegpt_* are prompts without answers: set data.regenerate = true")
    methods = cfg.train.methods
    if not methods or len(set(methods)) != len(methods) or not set(methods) <= set(METHODS):
        raise EDSDError(f"{where}: train.methods must name distinct methods of {list(METHODS)}, got {methods}")
    for method in METHODS.values():
        ids = getattr(cfg.layers, method.name)
        if ids is not None and len(set(ids)) != method.aux_layers:
            raise EDSDError(f"{where}: layers.{method.name} must be {method.aux_layers} distinct layer ids, got {ids}")
        own = getattr(cfg.train, method.name)
        check_method_table(where, method.name, own)
        if method.refuse_switches is not None:
            train = cfg.train.for_method(method.name)
            switches = {name: getattr(train, name) for name in method.switches}
            table = f"train.{method.name}."
            method.refuse_switches(switches, str(where),
                                   lambda name, own=own, table=table: (table if name in own else "train.") + name)


# What every method reads alike (the features are extracted once, for all of them): a method's
# own table may not set these.
SHARED_TRAIN_KEYS = ("methods", "max_length", "max_samples", "device", *METHODS)


def check_method_table(where: Path, method: str, values: dict) -> None:
    """``[train.METHOD]``: keys of ``[train]``, each checked as there, but none every method
    reads alike and none of another method's architecture alone."""
    shared = sorted(set(values) & set(SHARED_TRAIN_KEYS))
    if shared:
        raise EDSDError(f"{where}: train.{method}.{shared[0]} is every method's: set it in [train]")
    foreign = sorted(set(values) & other_methods_fields(method))
    if foreign:
        raise EDSDError(f"{where}: train.{method}.{foreign[0]} is not a key of {method}'s drafter")
    check_section(where, f"train.{method}", Train, values)


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """The checked config of ``path``, ``overrides`` (section -> key -> value) over its values,
    its relative paths made absolute from the file's directory. An override of None (which TOML
    cannot write) takes the key out: the field's default."""
    path = Path(path)
    raw = read_toml(path)
    for section, values in (overrides or {}).items():
        table = raw.setdefault(section, {})
        table.update(values)
        for key in [key for key, value in values.items() if value is None]:
            del table[key]
    sections = typing.get_type_hints(Config)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise EDSDError(f"{path}: unknown section [{unknown[0]}] (known: {', '.join(sections)})")
    cfg = Config(**{section: check_section(path, section, schema, raw.get(section, {}))
                    for section, schema in sections.items()})
    check_meaning(path, cfg)
    return cfg
