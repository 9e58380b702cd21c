"""The demo target: a Llama whose decoder linears are trained as rank-r factorizations.

Why low rank: speculation pays on a CPU only when one target forward costs much more than
vLLM's per-step overhead (an ~80M-parameter dense model here), but a model that size can
neither be trained on two CPU cores in a session nor shipped in a few tens of MB. Training
each ``W`` (out x in) as ``B @ A`` (``B``: out x r, ``A``: r x in) cuts training compute and
shipped size several-fold; :func:`expand` multiplies the factors back into an ordinary dense
``LlamaForCausalLM`` checkpoint, which is what vLLM serves, at the dense model's cost.
The served model is exactly the trained one (up to the serving dtype).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from vllm_edsd.formats.files import SAFETENSORS, atomic_directory, cast_floating, save_safetensors
from vllm_edsd.errors import EDSDError

FACTOR_FILE = "factors.safetensors"
SPEC_FILE = "lowrank.json"
LOW_RANK_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TargetShape:
    """The dense architecture vLLM serves, and the rank its linears are trained at."""

    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 4096
    rank: int = 64
    max_position_embeddings: int = 2048

    def llama_config(self, special: dict[str, int]):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size, head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=True,
            rope_theta=10000.0, rms_norm_eps=1e-5, **special,
        )


class LowRankLinear(nn.Module):
    """``y = x A^T B^T``: a bias-free linear layer of rank ``rank``."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
        self.b = nn.Parameter(torch.randn(out_features, rank) / math.sqrt(rank) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.T) @ self.b.T


def low_rank_model(shape: TargetShape, special: dict[str, int], seed: int):
    """A transformers Llama whose decoder projections are :class:`LowRankLinear`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.llama_config(special))
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LOW_RANK_PROJECTIONS:
                dense = getattr(parent, name, None)
                if isinstance(dense, nn.Linear):
                    setattr(parent, name, LowRankLinear(dense.in_features, dense.out_features, shape.rank))
    return model


def packed_sequences(token_stream: list[int], length: int) -> torch.Tensor:
    usable = len(token_stream) // length * length
    if usable == 0:
        raise EDSDError(f"not enough text to fill one training sequence of {length} tokens")
    return torch.tensor(token_stream[:usable], dtype=torch.long).view(-1, length)


@dataclass
class TargetRecipe:
    """Next-token training in cosine cycles: each warms up to its peak and decays to a tenth of it.
    A later cycle restarts the learning rate (at ``restart_lr``), so a finished target can be
    trained further without redoing, or changing, what came before."""

    cycles: tuple[int, ...] = (700,)  # what the shipped target was trained with
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    restart_lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    checkpoint_every: int = 25
    compile: bool = False  # torch.compile the forward: ~1.5x faster on this CPU, needs a C++ compiler

    @property
    def steps(self) -> int:
        return sum(self.cycles)

    def lr_at(self, step: int) -> float:
        start = 0
        for index, length in enumerate(self.cycles):
            if step < start + length or index == len(self.cycles) - 1:
                break
            start += length
        peak, local = (self.lr if index == 0 else self.restart_lr), step - start
        if local < self.warmup:
            return peak * (local + 1) / self.warmup
        progress = (local - self.warmup) / max(1, length - self.warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _batches(data: torch.Tensor, recipe: TargetRecipe, start: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The same seeded batch sequence on every run, so a resumed run sees what it would have."""
    order: list[int] = []
    epoch = 0
    for step in range(recipe.steps):
        while len(order) < (step + 1) * recipe.batch_size:
            perm = list(range(len(data)))
            random.Random(recipe.seed * 1000 + epoch).shuffle(perm)
            order += perm
            epoch += 1
        if step >= start:
            yield step, data[order[step * recipe.batch_size : (step + 1) * recipe.batch_size]]


def train_target(model, data: torch.Tensor, recipe: TargetRecipe, work: Path, *, device: str = "cpu") -> list[dict]:
    """Next-token training with AdamW on ``recipe``'s schedule; bf16 autocast. Resumes from
    ``work/target_state.pt`` (saved every ``checkpoint_every`` steps) with the same result."""
    state_path, log_path = work / "target_state.pt", work / "target_log.jsonl"
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    start, log = 0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log = [json.loads(l) for l in log_path.read_text().splitlines()] if log_path.exists() else []
        log = [entry for entry in log if entry["step"] <= start]
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
    forward = torch.compile(model) if recipe.compile else model
    bar = tqdm(total=recipe.steps, initial=start, desc="target LM", unit="step")
    window, t0 = [], time.time()
    for step, batch in _batches(data, recipe, start):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step)
        batch = batch.to(device)
        with autocast:
            loss = forward(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        window.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
        if done % recipe.checkpoint_every == 0 or done == recipe.steps:
            entry = {"step": done, "loss": sum(window) / len(window), "lr": optimizer.param_groups[0]["lr"],
                     "tokens": done * recipe.batch_size * recipe.seq_len, "seconds": round(time.time() - t0, 1)}
            log.append(entry)
            window = []
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done}, tmp)
            tmp.replace(state_path)
            log_path.write_text("".join(json.dumps(e) + "\n" for e in log))
    bar.close()
    model.eval()
    return log


def save_factors(model, shape: TargetShape, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    """What ships: the factors and every other tensor, plus the shape, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    save_safetensors(cast_floating(state, dtype), out_dir / FACTOR_FILE)
    (out_dir / SPEC_FILE).write_text(json.dumps(asdict(shape), indent=2) + "\n")


def expand(factor_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Multiply the shipped factors into a dense ``LlamaForCausalLM`` checkpoint (with the
    tokenizer files) that transformers and vLLM load like any other; atomic."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    factor_dir, out_dir = Path(factor_dir), Path(out_dir)
    if not (factor_dir / SPEC_FILE).is_file() or not (factor_dir / FACTOR_FILE).is_file():
        raise EDSDError(f"{factor_dir}: not a low-rank demo target ({SPEC_FILE} and {FACTOR_FILE} expected)")
    shape = TargetShape(**json.loads((factor_dir / SPEC_FILE).read_text()))
    tokenizer = AutoTokenizer.from_pretrained(str(factor_dir), local_files_only=True)
    factors = load_file(str(factor_dir / FACTOR_FILE))
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in factors.items():
        if name.endswith(".a"):
            base = name[: -len(".a")]
            dense[base + ".weight"] = (factors[base + ".b"].float() @ tensor.float()).to(dtype)
        elif not name.endswith(".b"):
            dense[name] = tensor.to(dtype)
    config = shape.llama_config(special_token_ids(tokenizer))
    config.dtype = dtype
    with atomic_directory(out_dir, force=True) as tmp:
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        save_safetensors(dense, tmp / SAFETENSORS)
    return out_dir


def special_token_ids(tokenizer) -> dict[str, int]:
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.convert_tokens_to_ids("<|end|>"),
            "pad_token_id": tokenizer.pad_token_id}
