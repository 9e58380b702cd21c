"""The target's greedy answers through transformers: regeneration where vLLM is not installed
(a training machine with torch alone, docs/scale.md "Regeneration without vLLM").

Prompts are rendered with the chat template exactly as the features see them
(``vllm_edsd.data``), left-padded into batches of similar length (a token budget bounds each
batch's cache), and decoded greedily up to an end-of-sequence token, which is not part of the
answer, as in vLLM's ``LLM.chat``.
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from vllm_edsd.data import Conversation, template_ids


def length_batches(lengths: list[int], max_tokens: int, token_budget: int) -> list[list[int]]:
    """Indices grouped longest first so that each batch's rows × (longest prompt + ``max_tokens``)
    stays within ``token_budget`` (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * (lengths[batches[-1][0]] + max_tokens) <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def end_tokens(model, tokenizer) -> set[int]:
    """Every token that ends an answer: the generation config's (one id or a list) and the
    tokenizer's end of sequence."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def greedy_replies(
    model, tokenizer, chats: list[Conversation], max_tokens: int, *, token_budget: int = 65536
) -> list[str]:
    """The target's greedy reply to each chat (the chat template's generation prompt appended)."""
    prompts = [template_ids(tokenizer, chat, generation_prompt=True) for chat in chats]
    return greedy_answers(model, tokenizer, prompts, max_tokens, token_budget=token_budget)


def greedy_answers(
    model, tokenizer, prompts: list[list[int]], max_tokens: int, *, token_budget: int = 65536,
    window: int | None = None,
) -> list[str]:
    """The target's greedy answer to each prompt of token ids, as text (``greedy_answer_ids``)."""
    answers = greedy_answer_ids(model, tokenizer, prompts, max_tokens, token_budget=token_budget, window=window)
    return [tokenizer.decode(answer, skip_special_tokens=True) for answer in answers]


@torch.inference_mode()
def greedy_answer_ids(
    model, tokenizer, prompts: list[list[int]], max_tokens: int, *, token_budget: int = 65536,
    window: int | None = None,
) -> list[list[int]]:
    """The target's greedy answer to each prompt of token ids, as the token ids it generated up
    to its first end token. With ``window`` (the target's context), no sequence of a batch grows
    past it: the batch's answers stop where its longest prompt (left-padded, every row's length)
    reaches the context, as vLLM stops a request at its ``max_model_len``; a prompt must be
    shorter than ``window``."""
    stops = end_tokens(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    device = next(model.parameters()).device
    # greedy and nothing else, as vLLM's explicit SamplingParams(temperature=0): no processor
    # (repetition penalty...) from the checkpoint's generation_config.json
    plain = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(stops), pad_token_id=pad)
    answers: list[list[int]] = [[] for _ in prompts]
    for batch in tqdm(length_batches([len(p) for p in prompts], max_tokens, token_budget),
                      desc="answering", unit="batch"):
        width = len(prompts[batch[0]])
        room = max_tokens if window is None else min(max_tokens, window - width)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=plain,
                             max_new_tokens=room)
        for row, i in enumerate(batch):
            answer = out[row, width:].tolist()
            ends = [k for k, token in enumerate(answer) if token in stops]
            answers[i] = answer[: ends[0]] if ends else answer
    return answers
