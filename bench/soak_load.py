"""The soak suite's load and its verdicts, pure: what one round of requests holds, and how each
request's record is judged.

A round mixes, in one batch: greedy (T=0) requests of every prompt, streamed and not, capped at
0, 1 and K drafts (``vllm_xargs``); seeded sampled (T>0) requests; a stream its client walks away
from; and bad requests a server must refuse with a 4xx naming the field at fault (a bad cap,
a prompt beyond the context, bad sampling values, a body that is not JSON). Each request of the
round says what it expects, so a record is judged from itself and its request alone.
"""

from __future__ import annotations

import json
from collections import Counter

from vllm_edsd.launch.replies import first_difference

CAP_KEY = "num_speculative_tokens"  # the per-request cap's key in vllm_xargs
WALK_AWAY_AFTER = 4  # token-bearing chunks a client that walks away reads first
WALK_AWAY_TOKENS = 512  # what it asked for: far from its end when it leaves
SEED = 1234

# Outcomes, one per record.
OK = "ok"
ABANDONED = "abandoned by its client"
REFUSED = "bad request refused (4xx naming the field)"
REFUSED_UNNAMED = "bad request refused without naming the field"
BAD_ACCEPTED = "bad request answered 200"
GOOD_REFUSED = "good request refused (4xx)"
SERVER_ERROR = "server error (5xx)"
FAILED = "failed (no answer, broken stream)"
FAULTS = (REFUSED_UNNAMED, BAD_ACCEPTED, GOOD_REFUSED, SERVER_ERROR, FAILED)


def chat_body(messages: list[dict], max_tokens: int, stream: bool, **extra) -> dict:
    """A chat request whose reply carries its token ids (streamed with a final usage chunk)."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "return_token_ids": True, **extra}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


def greedy_requests(prompts: list[list[dict]], max_tokens: int, k: int) -> list[dict]:
    """Every prompt at T=0, alternately streamed and not, capped in turn at 0, 1, K and not at all:
    each reply is compared with the same prompt's reply sent alone (``greedy``: its index)."""
    caps = (0, 1, k, None)
    requests = []
    for i, messages in enumerate(prompts):
        cap = caps[i % len(caps)]
        extra = {} if cap is None else {"vllm_xargs": {CAP_KEY: cap}}
        requests.append({"body": chat_body(messages, max_tokens, stream=i % 2 == 0, temperature=0, **extra),
                         "greedy": i, "what": f"T=0, cap {cap}"})
    return requests


def sampled_and_abandoned(prompts: list[list[dict]], max_tokens: int, k: int) -> list[dict]:
    """Seeded requests at T=0.8, streamed and not, and a stream its client walks away from."""
    sampled = [{"body": chat_body(prompts[i % len(prompts)], max_tokens, stream=i == 0, temperature=0.8,
                                  seed=SEED + i, vllm_xargs={CAP_KEY: k}), "what": "T=0.8, seeded"}
               for i in range(2)]
    walk_away = {"body": chat_body(prompts[-1], WALK_AWAY_TOKENS, stream=True, temperature=0),
                 "walk_away_after": WALK_AWAY_AFTER, "what": "stream abandoned by its client"}
    return [*sampled, walk_away]


def bad_requests(prompt: list[dict], max_tokens: int, k: int, max_model_len: int) -> list[dict]:
    """Requests a server must refuse with a 4xx; ``field``: what the refusal must name (in its
    message or its ``param``)."""
    def bad(field: str, what: str, **extra) -> dict:
        return {"body": chat_body(prompt, max_tokens, stream=False, **extra), "field": field, "what": what}

    beyond = [{"role": "user", "content": "word " * (2 * max_model_len)}]
    return [
        bad(CAP_KEY, "cap -1", vllm_xargs={CAP_KEY: -1}),
        bad(CAP_KEY, f"cap K+1 ({k + 1})", vllm_xargs={CAP_KEY: k + 1}),
        bad(CAP_KEY, 'cap "x"', vllm_xargs={CAP_KEY: "x"}),
        {"body": chat_body(beyond, max_tokens, stream=False), "field": "context length",
         "what": "prompt beyond the context"},
        bad("temperature", "temperature -1", temperature=-1),
        bad("top_p", "top_p 2", top_p=2),
        {"raw": json.dumps(chat_body(prompt, max_tokens, stream=False))[:-7], "field": "JSON",
         "what": "malformed JSON body"},
    ]


def round_requests(prompts: list[list[dict]], max_tokens: int, k: int, max_model_len: int) -> list[dict]:
    """One round of the soak: the greedy requests with the sampled, abandoned and bad ones spread
    between them, so that every batch the server forms holds a mix."""
    extras = sampled_and_abandoned(prompts, max_tokens, k) + bad_requests(prompts[0], max_tokens, k, max_model_len)
    greedy = greedy_requests(prompts, max_tokens, k)
    mixed, step = [], max(1, len(greedy) // len(extras))
    for i, request in enumerate(greedy):
        mixed.append(request)
        if i % step == step - 1 and extras:
            mixed.append(extras.pop(0))
    return mixed + extras


def names_field(record: dict, field: str) -> bool:
    """Whether a refusal's error names ``field``, in its message or its ``param``."""
    body = record.get("error_body") or {}
    text = f"{body.get('message', '')} {body.get('param', '')}" if isinstance(body, dict) else str(body)
    return field.lower() in text.lower()


def outcome(record: dict, request: dict) -> str:
    """One of the outcomes above, for a record of ``request``."""
    status = record.get("status") or 0
    if status >= 500:
        return SERVER_ERROR
    if "field" in request:
        if 400 <= status < 500:
            return REFUSED if names_field(record, request["field"]) else REFUSED_UNNAMED
        return BAD_ACCEPTED if status == 200 else FAILED
    if 400 <= status < 500:
        return GOOD_REFUSED
    if status != 200 or record["error"] is not None:
        return FAILED
    return ABANDONED if record.get("abandoned") else OK


def judge(records: list[dict], requests: list[dict]) -> dict:
    """Requests per outcome; every fault (5xx, a bad request not refused as it should be, a good one
    that failed) with what was sent and what came back; each kind of bad request's outcomes."""
    outcomes, faults, bad = Counter(), [], {}
    for record in records:
        request = requests[record["request"]]
        verdict = outcome(record, request)
        outcomes[verdict] += 1
        if "field" in request:
            bad.setdefault(request["what"], Counter())[verdict] += 1
        if verdict in FAULTS:
            faults.append({"outcome": verdict, "what": request["what"], "status": record.get("status"),
                           "error": record["error"], "error_body": record.get("error_body")})
    return {"outcomes": dict(outcomes), "faults": faults[:50], "fault_count": len(faults),
            "bad_requests": {what: dict(counts) for what, counts in bad.items()}}


def compare_greedy(records: list[dict], requests: list[dict], alone: list[list[int]]) -> dict:
    """Greedy replies under load against the same prompts' replies sent alone: how many are equal,
    and which differ (prompt, request id, first position where they part)."""
    compared, differ = 0, []
    for record in records:
        index = requests[record["request"]].get("greedy")
        if index is None or outcome(record, requests[record["request"]]) != OK:
            continue
        compared += 1
        got, expected = record["token_ids"], alone[index]
        if got != expected:
            differ.append({"prompt": index, "request": record["id"],
                           "first_difference_at": first_difference(got, expected)})
    return {"compared": compared, "equal": compared - len(differ),
            "equal_share": (compared - len(differ)) / compared if compared else None, "differ": differ[:50]}
