"""What a recorded engine job is checked against: the reference model's draft chains and its
predicted spec-decode counters, the draft steps read out of a recorded request, and the counters
of a drafter that always proposes one token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.specforge_layout import specforge_chains
from vllm_edsd.methods.registry import EDSD
from vllm_edsd.training.acceptance import replay, total


def drafting_steps(prompt: list[int], output: list[int], recorded: list) -> Iterator[tuple[int, list[int], int]]:
    """The draft steps of one recorded request (one request at a time): (context length,
    draft chain, drafts accepted). A draft is accepted where it equals the token the engine
    emitted (at temperature > 0 too: a rejected draft's replacement never equals it)."""
    context = len(prompt) + 1  # prompt plus the token sampled at prefill
    for step in recorded:
        assert len(step) == 1, "one request at a time"
        if context > len(prompt) + len(output):
            # drafted in the step that ended the request, after a token its output leaves out
            # (seen on a fresh 2-core EPYC at 44ceefc too): no step verified it
            break
        draft = step[0]
        accepted = 0
        while (accepted < len(draft) and context + accepted < len(prompt) + len(output)
               and draft[accepted] == output[context - len(prompt) + accepted]):
            accepted += 1
        yield context, draft, accepted
        context += accepted + 1


def assert_drafts_match(prompts: list[list[int]], phase: dict, chains_for, k: int) -> int:
    """Every chain vLLM drafted in a recorded phase (one request at a time) equals
    ``chains_for(sequence)[p]``, the chain drafted from the context that ends at index p+1 of
    ``prompt + output`` (a tensor row, or a list where chains may be cut short): first and
    fed-back draft steps. Returns how many chains matched."""
    import torch

    compared = 0
    for prompt, output, recorded in zip(prompts, phase["outputs"], phase["proposals"]):
        chains = chains_for(torch.tensor([prompt + output]))
        for context, draft, _accepted in drafting_steps(prompt, output, recorded):
            expected = chains[context - 2]
            assert draft == (expected.tolist() if isinstance(expected, torch.Tensor) else expected), \
                f"step at context length {context}"
            compared += 1
    return compared


def draft_agreement(prompts: list[list[int]], phase: dict, chains_for) -> tuple[int, int]:
    """(draft tokens equal to ``chains_for``'s, draft tokens) over a recorded phase (one request
    at a time): where exact parity cannot hold, such as float16 against the float32 reference."""
    import torch

    same = total = 0
    for prompt, output, recorded in zip(prompts, phase["outputs"], phase["proposals"], strict=True):
        chains = chains_for(torch.tensor([prompt + output]))
        for context, draft, _accepted in drafting_steps(prompt, output, recorded):
            same += sum(a == b for a, b in zip(draft, chains[context - 2].tolist(), strict=True))
            total += len(draft)
    return same, total


def reference_chains(target_dir: str, source: str, specforge: bool = False, k: int = 4, method: str = EDSD):
    """``chains_for(sequence)``: the reference model of ``method`` (its plain-PyTorch drafter)'s
    draft chains after every prefix of a sequence, the model loaded from ``source`` (for a
    SpecForge checkpoint, checked against SpecForge's own forward too)."""
    import torch
    from safetensors.torch import load_file

    from vllm_edsd.features.hidden_states import run_target
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.methods import method as drafting_method

    target = load_target(target_dir)
    drafter = drafting_method(method).model.from_pretrained(source, embed_tokens=target.model.embed_tokens.weight)
    layers = drafter.aux_layer_ids

    def chains_for(sequence):
        features = run_target(target, sequence, layers).features(layers)[:, :-1]
        chains = drafter.propose(features, sequence[:, 1:], k)
        if specforge:
            checkpoint = {
                n: t for f in sorted(Path(source).glob("model*.safetensors")) for n, t in load_file(f).items()
            }
            config = json.loads((Path(source) / "config.json").read_text())
            embed = target.model.embed_tokens.weight
            assert torch.equal(specforge_chains(checkpoint, config, embed, features, sequence[:, 1:], k), chains)
        return chains[0]

    return chains_for


def predicted_counters(trained: dict, outputs: list[list[int]], k: int, max_entropy: float | None = None,
                       caps: list[int] | None = None):
    """What the reference model, loaded from the unfolded conversion of the trained drafter,
    predicts for these greedy outputs of ``trained["prompts"]`` (with ``max_entropy``: under
    the adaptive draft length; with ``caps``: each request's draft-length cap)."""
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.methods.edsd.model import EDSDDraftModel
    from vllm_edsd.training.acceptance import predict

    target = load_target(trained["target"])
    drafter = EDSDDraftModel.from_pretrained(trained["edsd"], embed_tokens=target.model.embed_tokens.weight)
    return predict(drafter, target, list(zip(trained["prompts"], outputs)), k, max_entropy, caps)


def assert_counters_match(predicted, measured: dict) -> None:
    """vLLM's counters equal the reference's prediction up to argmax near-ties that float32
    rounding can flip between the reference and vLLM's kernels: 2% of the drafts per position
    (the parity tests show the chains themselves agree exactly). Over 5% of first drafts must
    be accepted (a random drafter: under 1%), so a drafter that proposes garbage cannot pass."""
    assert predicted.drafts == pytest.approx(measured["drafts"], rel=0.02)
    for p, m in zip(predicted.accepted_per_pos, measured["accepted_per_pos"], strict=True):
        assert abs(p - m) <= 0.02 * measured["drafts"] + 1, (predicted.accepted_per_pos, measured["accepted_per_pos"])
    assert measured["accepted_per_pos"][0] > 0.05 * measured["drafts"]


def simulate_constant_drafter(outputs: list[list[int]], token: int, k: int) -> tuple[int, list[int]]:
    """Drafts and accepted-per-position of a drafter that always proposes ``token``."""
    counters = total([replay(out, 0, k, lambda c: [token] * k) for out in outputs])
    return counters.drafts, counters.accepted_per_pos
