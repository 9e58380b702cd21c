"""``edsd convert`` as a call: ``ConvertOptions`` (the command's flags, with its defaults) and
``run``, which the command and the pipeline both call."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_edsd.command import POSITIONAL
from vllm_edsd.methods.edsd.config import DEFAULT_SPECULATIVE_TOKENS

from .converter import Summary, convert


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """The drafter to convert, where to, and what ``convert`` checks and records on the way."""

    src: str = field(metadata={POSITIONAL: True})  # this project's training layout or SpecForge's
    dst: str = field(metadata={POSITIONAL: True})  # the vLLM layout, written whole or not at all
    dtype: str | None = None  # the output's weights; None: the source's
    target: str | None = None  # checked against, its fingerprint recorded
    fold_token_norm: bool = False  # EDFuse's token norm folded into a draft-owned embedding table
    layer_id_convention: str | None = None  # how SRC numbers its aux layers; None: as its layout says
    verifier: str | None = None  # the target `vllm serve DST` loads; None: --target, made absolute
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # K when DST is served alone
    force: bool = False  # replace DST if it exists


def run(options: ConvertOptions) -> Summary:
    """``src`` converted into ``dst``; the summary is printed and returned. A progress bar shows
    on a terminal."""
    summary = convert(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}, progress=progress)
    print(summary.render())
    return summary


def progress(items: Iterable, total: int) -> Iterable:
    """``items``, counted by a progress bar where stderr is a terminal."""
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc="converting", unit="tensor")
