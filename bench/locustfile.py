"""Locust user for the latency and soak suites: one chat request per scheduled arrival.

``bench/latency.py`` writes the plan (arrival times, conversations, max_tokens, ignore_eos, timeouts) to the
JSON file named by ``EDSD_BENCH_PLAN``. Each user takes the next unclaimed arrival, sleeps until
it and sends the request, so arrivals are open loop: a slow server does not lower the offered
load, it only keeps more users busy. Every request's raw timings go as one JSON line to the file
named by ``EDSD_BENCH_RECORDS``; the request that completes the plan stops locust.

A soak plan (``bench/soak.py``) also names each request whole (``requests``: body, raw text or
a stream to walk away from, taken in turn), and may have no arrivals but ``stop_after_s``:
closed loop, every user sending its next request as soon as its last one ended, until that
many seconds have passed; the last request in flight then stops locust.

Chunks are read as they arrive (``chunk_size=None``) and timestamped on arrival; a chunk counts
when it carries output tokens (``return_token_ids``), so a token that detokenises to no text
still counts. Output tokens come from the final ``usage`` chunk.

Every request goes on a connection of its own (``Connection: close``): a user idle longer than
the server's keep-alive (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s) would otherwise send on a
pooled connection the server is closing at that moment, and fail with a ``ConnectionError`` the
server never saw (1 of 1,290 requests in a CI soak). A connection refused or reset is then the
server's doing; its message is kept in the record's error.
"""

import itertools
import json
import os
import time
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from locust.exception import StopUser

PLAN = json.loads(Path(os.environ["EDSD_BENCH_PLAN"]).read_text())
RECORDS = open(os.environ["EDSD_BENCH_RECORDS"], "a", buffering=1)  # one flushed line per request
ARRIVALS = PLAN.get("arrivals_s")
# shared by all users; greenlets switch only on I/O
NEXT = iter(range(len(ARRIVALS))) if ARRIVALS is not None else itertools.count()
state = {"t0": 0.0, "done": 0, "in_flight": 0, "stopped": False, "quitting": False, "runner": None}


@events.test_start.add_listener
def start_clock(**_kwargs) -> None:
    """Arrival times count from here plus a lead that covers spawning the users."""
    state["t0"] = time.perf_counter() + PLAN["start_lead_s"]


def chunk_token_ids(event: dict) -> list[int]:
    return [t for c in event.get("choices", ()) for t in c.get("token_ids") or ()]


def chunk_tokens(event: dict) -> int:
    """Output tokens in one chunk: its token ids, or 1 for text when the server sends no ids."""
    return len(chunk_token_ids(event)) or sum(bool(c["delta"].get("content")) for c in event.get("choices", ()))


def read_stream(lines, start: float, walk_away_after: int | None = None) -> dict:
    """Token-bearing chunks as [seconds since ``start``, tokens], output tokens, the output's
    token ids (what a soak compares) and error (None if ok). ``walk_away_after``: stop reading
    after that many token-bearing chunks, as a client that loses interest (``abandoned``)."""
    chunks, usage_tokens, token_ids = [], None, []
    for line in lines:
        arrived = time.perf_counter() - start
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            tokens = usage_tokens if usage_tokens is not None else sum(n for _, n in chunks)
            return {"chunks": chunks, "output_tokens": tokens, "token_ids": token_ids, "error": None}
        event = json.loads(line[6:])
        if "error" in event:
            return {"chunks": chunks, "output_tokens": 0, "token_ids": token_ids,
                    "error": f"stream error: {event['error'].get('type')}", "error_body": event["error"]}
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        token_ids += chunk_token_ids(event)
        if n := chunk_tokens(event):
            chunks.append([arrived, n])
        if walk_away_after is not None and len(chunks) >= walk_away_after:
            return {"chunks": chunks, "output_tokens": len(token_ids), "token_ids": token_ids, "error": None,
                    "abandoned": True}
    return {"chunks": chunks, "output_tokens": 0, "token_ids": token_ids, "error": "truncated stream (no [DONE])"}


def read_whole(reply) -> dict:
    """A non-streaming reply's output tokens and their ids (``return_token_ids``)."""
    choice = reply.json()["choices"][0]
    token_ids = choice.get("token_ids") or []
    return {"chunks": [], "output_tokens": len(token_ids), "token_ids": token_ids, "error": None}


def latency_request(i: int) -> dict:
    """The latency suite's request: the plan's conversation ``i``, greedy, streamed."""
    return {"body": {"model": "bench", "messages": PLAN["messages"][i], "max_tokens": PLAN["max_tokens"],
                     "temperature": 0, "ignore_eos": PLAN["ignore_eos"], "stream": True,
                     "stream_options": {"include_usage": True}, "return_token_ids": True}}


def refused(r) -> dict:
    """A request the server did not answer with 200: its status and the error it sent."""
    error = f"HTTP {r.status_code}" if r.status_code else f"{type(r.error).__name__}: {r.error}"[:300]
    try:
        body = r.json().get("error", {})
    except ValueError:
        body = {"message": r.text[:500]}
    return {"chunks": [], "output_tokens": 0, "error": error, "error_body": body}


def should_stop() -> bool:
    """Whether a closed-loop plan's time is up (an open-loop plan ends with its arrivals)."""
    return ARRIVALS is None and time.perf_counter() - state["t0"] > PLAN["stop_after_s"]


def finish_if_done() -> None:
    """Stop locust once the plan is through and nothing is in flight, from a greenlet of its own:
    quitting kills every user's greenlet, and killed from this one it would stop half-way,
    leaving locust to run until --run-time."""
    through = state["done"] == len(ARRIVALS) if ARRIVALS is not None else state["stopped"]
    if through and state["in_flight"] == 0 and not state["quitting"]:
        state["quitting"] = True
        gevent.spawn(state["runner"].quit)


class ChatUser(HttpUser):
    wait_time = constant(0)

    @task
    def chat(self) -> None:
        state["runner"] = self.environment.runner
        i = next(NEXT, None)
        if i is None or should_stop():
            state["stopped"] = True
            finish_if_done()
            raise StopUser()
        scheduled = state["t0"] + (ARRIVALS[i] if ARRIVALS is not None else 0.0)
        state["in_flight"] += 1  # from the claim on: a user sleeping until its arrival is not through
        gevent.sleep(max(0.0, scheduled - time.perf_counter()))
        start = time.perf_counter()
        plan_index = i % len(PLAN["requests"]) if "requests" in PLAN else i
        result = self.send(PLAN["requests"][plan_index] if "requests" in PLAN else latency_request(i), start)
        record = {"id": i, "request": plan_index, "scheduled_s": scheduled - state["t0"],
                  "start_s": start - state["t0"], "e2e_s": time.perf_counter() - start, **result}
        RECORDS.write(json.dumps(record) + "\n")
        state["done"] += 1
        state["in_flight"] -= 1
        finish_if_done()

    def send(self, request: dict, start: float) -> dict:
        """One request (streamed when its body says so); failures (HTTP status, exceptions,
        truncation) become the error, with the server's error body when it sent one."""
        raw = request.get("raw")
        body = request.get("body") or {}
        stream = bool(body.get("stream"))
        with self.client.post("/v1/chat/completions", data=raw, json=None if raw else body, stream=stream,
                              name="chat", catch_response=True, timeout=(10, PLAN["request_timeout_s"]),
                              headers={"Content-Type": "application/json", "Connection": "close"}) as r:
            if r.status_code != 200:
                result = refused(r)
            else:
                try:
                    result = (read_stream(r.iter_lines(chunk_size=None), start, request.get("walk_away_after"))
                              if stream else read_whole(r))
                except Exception as exc:  # a broken stream is a failed request, not a crashed user
                    result = {"chunks": [], "output_tokens": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}
            if result.get("abandoned"):
                r.close()  # the socket, unread: the server sees its client gone
            result["status"] = r.status_code
            if result["error"]:
                r.failure(result["error"])
            else:
                r.success()
        return result
