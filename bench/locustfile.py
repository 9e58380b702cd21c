"""Locust user for the latency suite: one streaming chat request per scheduled arrival.

``bench/latency.py`` writes the plan (arrival times, conversations, max_tokens, ignore_eos, timeouts) to the
JSON file named by ``EDSD_BENCH_PLAN``. Each user takes the next unclaimed arrival, sleeps until
it and sends the request, so arrivals are open loop: a slow server does not lower the offered
load, it only keeps more users busy. Every request's raw timings go as one JSON line to the file
named by ``EDSD_BENCH_RECORDS``; the request that completes the plan stops locust.

Chunks are read as they arrive (``chunk_size=None``) and timestamped on arrival; a chunk counts
when it carries output tokens (``return_token_ids``), so a token that detokenises to no text
still counts. Output tokens come from the final ``usage`` chunk.
"""

import json
import os
import time
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from locust.exception import StopUser

PLAN = json.loads(Path(os.environ["EDSD_BENCH_PLAN"]).read_text())
RECORDS = open(os.environ["EDSD_BENCH_RECORDS"], "a", buffering=1)  # one flushed line per request
NEXT = iter(range(len(PLAN["arrivals_s"])))  # shared by all users; greenlets switch only on I/O
state = {"t0": 0.0, "done": 0}


@events.test_start.add_listener
def start_clock(**_kwargs) -> None:
    """Arrival times count from here plus a lead that covers spawning the users."""
    state["t0"] = time.perf_counter() + PLAN["start_lead_s"]


def chunk_token_ids(event: dict) -> list[int]:
    return [t for c in event.get("choices", ()) for t in c.get("token_ids") or ()]


def chunk_tokens(event: dict) -> int:
    """Output tokens in one chunk: its token ids, or 1 for text when the server sends no ids."""
    return len(chunk_token_ids(event)) or sum(bool(c["delta"].get("content")) for c in event.get("choices", ()))


def read_stream(lines, start: float) -> dict:
    """Token-bearing chunks as [seconds since ``start``, tokens], output tokens, the output's
    token ids (what a soak compares) and error (None if ok)."""
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
                    "error": f"stream error: {event['error'].get('type')}"}
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        token_ids += chunk_token_ids(event)
        if n := chunk_tokens(event):
            chunks.append([arrived, n])
    return {"chunks": chunks, "output_tokens": 0, "token_ids": token_ids, "error": "truncated stream (no [DONE])"}


class ChatUser(HttpUser):
    wait_time = constant(0)

    @task
    def chat(self) -> None:
        i = next(NEXT, None)
        if i is None:
            raise StopUser()
        scheduled = state["t0"] + PLAN["arrivals_s"][i]
        gevent.sleep(max(0.0, scheduled - time.perf_counter()))
        start = time.perf_counter()
        result = self.send(PLAN["messages"][i], start)
        record = {"id": i, "scheduled_s": scheduled - state["t0"], "start_s": start - state["t0"],
                  "e2e_s": time.perf_counter() - start, **result}
        RECORDS.write(json.dumps(record) + "\n")
        state["done"] += 1
        if state["done"] == len(PLAN["arrivals_s"]):
            # From a greenlet of its own: quitting kills every user's greenlet, and killed from
            # this one it would stop half-way, leaving locust to run until --run-time.
            gevent.spawn(self.environment.runner.quit)

    def send(self, messages: list[dict], start: float) -> dict:
        """One streaming request; failures (HTTP status, exceptions, truncation) become the error."""
        body = {"model": "bench", "messages": messages, "max_tokens": PLAN["max_tokens"], "temperature": 0,
                "ignore_eos": PLAN["ignore_eos"], "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        with self.client.post("/v1/chat/completions", json=body, stream=True, name="chat", catch_response=True,
                              timeout=(10, PLAN["request_timeout_s"])) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}" if r.status_code else type(r.error).__name__
                result = {"chunks": [], "output_tokens": 0, "error": error}
            else:
                try:
                    result = read_stream(r.iter_lines(chunk_size=None), start)
                except Exception as exc:  # a broken stream is a failed request, not a crashed user
                    result = {"chunks": [], "output_tokens": 0, "error": type(exc).__name__}
            if result["error"]:
                r.failure(result["error"])
            else:
                r.success()
        return result
