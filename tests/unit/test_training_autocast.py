"""``edsd train --autocast bfloat16``: the loss's forward runs in bfloat16 under torch.autocast,
the drafter's weights and AdamW stay float32, the step lands close to float32's, and the recipe
records it so that a resume trains the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_edsd.methods.edsd.config import EDSDConfig
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from vllm_edsd.training.fitter import Fitter
from vllm_edsd.training.options import TrainOptions
from vllm_edsd.training.recipe import Recipe

VOCAB, DRAFT_VOCAB, WIDTH, LENGTH = 64, 16, 32, 24


def drafter() -> EDSDDraftModel:
    cfg = EDSDConfig.from_dict({
        "hidden_size": WIDTH, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "edsd_config": {"aux_layer_ids": [1, 2], "aux_layer_id_convention": "layer_input",
                        "fuse_intermediate_size": 48}})
    torch.manual_seed(0)
    model = EDSDDraftModel(cfg)
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[:DRAFT_VOCAB] = True
    return model


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    final = torch.randn(2, LENGTH, WIDTH, generator=generator)
    return {"input_ids": torch.randint(0, DRAFT_VOCAB, (2, LENGTH), generator=generator),
            "loss_mask": torch.ones(2, LENGTH, dtype=torch.bool),
            "aux": torch.randn(2, LENGTH, 2 * WIDTH, generator=generator), "final": final,
            "target_argmax": torch.randint(0, DRAFT_VOCAB, (2, LENGTH), generator=generator),
            "target_entropy": torch.rand(2, LENGTH, generator=generator)}


def one_step(autocast: str | None) -> tuple[float, EDSDDraftModel, set[torch.dtype]]:
    """The loss of one optimizer step, the drafter after it and the dtypes its linear layers computed in."""
    model, head = drafter(), torch.randn(DRAFT_VOCAB, WIDTH, generator=torch.Generator().manual_seed(2))
    computed: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: computed.add(out.dtype))
    result = Fitter(model, head, Recipe(autocast=autocast, lr=1e-3)).step(batch(), 2, 0.0, 1e-3)
    return result.loss.item(), model, computed


def test_bfloat16_autocast_computes_in_bfloat16_and_keeps_float32_weights():
    plain_loss, plain, plain_dtypes = one_step(None)
    loss, model, dtypes = one_step("bfloat16")
    assert plain_dtypes == {torch.float32} and dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert loss == pytest.approx(plain_loss, rel=0.02) and loss != plain_loss
    untrained = drafter()
    for (name, before), after, float32_after in zip(untrained.named_parameters(), model.parameters(),
                                                    plain.parameters()):
        if before.requires_grad and not torch.equal(float32_after, before):  # what float32's step moved
            assert not torch.equal(after, before), f"{name} did not train under autocast"


def test_the_recipe_records_autocast():
    options = TrainOptions(target="t", out="o", autocast="bfloat16")
    assert Recipe.from_options(options).autocast == "bfloat16"
    assert Recipe.from_options(dataclasses.replace(options, autocast=None)).autocast is None
