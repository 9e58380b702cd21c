"""Small models made on the spot: a byte-level BPE tokenizer, tiny random-weight targets
(Llama, Qwen3) and EDSD and EAGLE-3 drafters for them.

They exist so that tests and a first demo run on a machine with no model hub. Their
weights are random: they exercise every code path of serving, but acceptance measured on
them says nothing about EDSD's quality.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from vllm_edsd.checkpoint.layouts import Layout
from vllm_edsd.methods.blocks import DraftHead, RMSNorm
from vllm_edsd.methods.eagle3.model import Eagle3DraftModel
from vllm_edsd.methods.edsd.config import RMSNORM, EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM
from vllm_edsd.methods.edsd.model import EDSDDraftModel

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def toy_corpus() -> str:
    return (Path(__file__).parent / "toy_corpus.txt").read_text()


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path, chat_template: bool = True) -> None:
    """Train a byte-level BPE and save it as a transformers fast tokenizer, with a chat template
    unless ``chat_template`` is False (as a base model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_target(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    seed: int = 0,
    train_steps: int = 0,
    chat_template: bool = True,
    max_position_embeddings: int = 2048,
    first_token_spike: float = 0.0,
) -> Path:
    """A causal LM with a tokenizer, loadable by transformers and vLLM: random weights, or
    with ``train_steps`` a model fitted to the toy corpus (confident where it memorised); a
    base model's tokenizer, without a chat template, where ``chat_template`` is False; a
    context of ``max_position_embeddings`` tokens. ``first_token_spike`` sets one dimension of
    the BOS token's embedding to that value: the residual stream carries it through every
    layer, like the massive first-token activation of real LLMs (SmolLM2-135M: about 24,800)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(toy_corpus().splitlines(), vocab_size, out_dir, chat_template)
    common = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if arch not in classes:
        raise ValueError(f"unknown toy architecture {arch!r}; choose from {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(torch.float32)
    if train_steps:
        _fit_to_corpus(model, out_dir, train_steps)
    if first_token_spike:
        with torch.no_grad():
            model.get_input_embeddings().weight[common["bos_token_id"], 0] = first_token_spike
    model.save_pretrained(str(out_dir))
    return out_dir


def _fit_to_corpus(model, tokenizer_dir: Path, steps: int, window: int = 64) -> None:
    """A few hundred AdamW steps on the toy corpus (under a minute on a CPU)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = torch.tensor(tokenizer(toy_corpus())["input_ids"])
    chunks = ids[: len(ids) // window * window].view(-1, window)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    # One thread: beside the other xdist worker's engine, two OpenMP threads took 178 s for the
    # fitted target's 300 steps in CI, one thread 50 s alone; the weights are bit-identical either
    # way (2-core AMD EPYC, AVX512-BF16, float32).
    with one_torch_thread():
        for _ in range(steps):
            loss = model(input_ids=chunks, labels=chunks).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()


def target_config(target_dir: str | Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def make_drafter(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    aux_layer_ids: tuple[int, int] = (1, 3),
    draft_vocab_size: int | None = None,
    layout: Layout = EDSD_VLLM,
    token_norm: str = RMSNORM,
    seed: int = 0,
    constant_token: int | None = None,
    fusion_gain: float = 1.0,
    **switches: bool,
) -> EDSDDraftModel:
    """A random EDSD drafter for a toy target, its token norm's weights random too (so that
    a wrong norm or a wrong fold changes its drafts). ``fusion_gain`` multiplies EDFuse's gate
    and down projections: at 5 the fed-back state grows about tenfold per draft step, as a
    trained EDSD drafter's grows about fivefold.

    With ``constant_token`` the drafter always proposes that token: the final norm is
    zero, so every draft logit is 0 and the argmax is draft id 0, which ``d2t`` maps to
    ``constant_token``. Its acceptance is therefore predictable from the target's output.
    ``switches`` (``EDSDConfig``'s: ``attention_reads_token``, ``feature_norm``, ``norm_before_fc``,
    ``fc_norm``, ``norm_before_residual``) build the draft layer that reads the token, the normed
    feature, fc's normed input (their norms' weights random as well), the normed residual.
    """
    cfg = EDSDConfig.for_target(
        target_config(target_dir), aux_layer_ids, draft_vocab_size=draft_vocab_size, token_norm=token_norm
    ).with_updates(**switches)
    torch.manual_seed(seed)
    model = EDSDDraftModel(cfg)
    with torch.no_grad():
        randomise(model, [model.edfuse.token_norm, model.edfuse.feature_norm, model.midlayer.token_norm,
                          *model.fc_input_norms()])
        model.edfuse.gate_proj.weight.mul_(fusion_gain)
        model.edfuse.down_proj.weight.mul_(fusion_gain)
        vocab, draft_vocab = cfg.vocab_size, cfg.draft_vocab_size
        first = 0 if constant_token is None else constant_token
        if first + draft_vocab > vocab:
            raise ValueError(f"constant_token {constant_token} + draft vocab {draft_vocab} exceeds vocab {vocab}")
        set_draft_vocab(model, torch.arange(first, first + draft_vocab)
                        if constant_token is not None and draft_vocab < vocab else None)
        if constant_token is not None:
            model.norm.weight.zero_()
    model.save_pretrained(out_dir, layout=layout)
    return model


def make_eagle3_drafter(target_dir: str | Path, out_dir: str | Path, *, aux_layer_ids: tuple[int, int, int] = (1, 2, 3),
                        draft_vocab_size: int = 256, seed: int = 0, **switches: bool) -> Eagle3DraftModel:
    """A random EAGLE-3 drafter for a toy target in the layout vLLM's ``eagle3`` loads, with
    EAGLE 3.1's ``switches`` (``methods/eagle3/config.py``). Every norm's weights are random too,
    so that a norm vLLM applies elsewhere, or not at all, changes its drafts."""
    cfg = EDSDConfig.for_target(target_config(target_dir), aux_layer_ids[:2], draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    model = Eagle3DraftModel.build(cfg, aux_layer_ids, **switches)
    with torch.no_grad():
        randomise(model, [module for module in model.modules() if isinstance(module, RMSNorm)])
        set_draft_vocab(model)
    model.save_pretrained(out_dir)
    return model


def randomise(model: DraftHead, norms: list) -> None:
    """Random projections (N(0, 0.05)) and random ``norms`` (None: absent): weights in
    [0.5, 1.5], biases N(0, 0.1)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.normal_(0.0, 0.05)
    for norm in filter(None, norms):
        for name, tensor in norm.named_parameters():
            tensor.uniform_(0.5, 1.5) if name == "weight" else tensor.normal_(0.0, 0.1)


def set_draft_vocab(model: DraftHead, used: torch.Tensor | None = None) -> None:
    """The draft vocabulary's target ids (``d2t``, ``t2d``): ``used``, or else spread evenly over
    the target's vocabulary (all of it where the draft vocabulary is the whole)."""
    vocab, draft_vocab = model.config.vocab_size, model.config.draft_vocab_size
    if used is None:
        used = torch.linspace(0, vocab - 1, draft_vocab).round().long().unique() if draft_vocab < vocab \
            else torch.arange(vocab)
    model.d2t.copy_(used - torch.arange(draft_vocab))
    model.t2d.zero_()
    model.t2d[used] = True


def built_by_edsd_train(target_dir: str | Path, **switches) -> DraftHead:
    """The EDSD drafter ``edsd train`` builds (``training.drafter.build_model``) for a toy target
    with ``switches`` on: aux layers (1, 3), a draft vocabulary of its first 256 tokens."""
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.training.drafter import build_model
    from vllm_edsd.training.options import TrainOptions

    raw = target_config(target_dir)
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[:256] = True
    options = TrainOptions(target=str(target_dir), out="unused", data="unused", **switches)
    return build_model(options, load_target(target_dir), raw, (1, 3), d2t, t2d)


@contextlib.contextmanager
def one_torch_thread():
    """Torch on one CPU thread inside the block, as many as before after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
