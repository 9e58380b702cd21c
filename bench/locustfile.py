"""Locust user for the latency suite: one streaming chat request per arrival.

Arrivals are Poisson: each of the ``EDSD_BENCH_USERS`` users waits an exponential time with
mean users/qps between requests, so the aggregate rate is about ``EDSD_BENCH_QPS``. Each request
("chat", failures counted there) reports its end-to-end time to the last streamed token
("e2e"), its time to first token ("ttft") and its mean inter-token latency ("itl") as entries.
"""

import json
import os
import random
import time

from locust import HttpUser, task

PROMPTS = json.loads(open(os.environ["EDSD_BENCH_PROMPTS"]).read())
QPS = float(os.environ["EDSD_BENCH_QPS"])
USERS = int(os.environ["EDSD_BENCH_USERS"])
MAX_TOKENS = int(os.environ["EDSD_BENCH_MAX_TOKENS"])
RNG = random.Random(int(os.environ.get("EDSD_BENCH_SEED", "0")))


class ChatUser(HttpUser):
    def wait_time(self):
        return RNG.expovariate(QPS / USERS)

    @task
    def chat(self):
        body = {"model": "bench", "messages": RNG.choice(PROMPTS), "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        stamps = []
        with self.client.post("/v1/chat/completions", json=body, stream=True, name="chat", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        stamps.append(time.perf_counter())
        end = time.perf_counter()
        fire = self.environment.events.request.fire
        fire(request_type="METRIC", name="e2e", response_time=(end - start) * 1000, response_length=len(stamps),
             exception=None, context={})
        if not stamps:  # tokens that detokenise to no text (special tokens): no TTFT/ITL sample
            return
        fire(request_type="METRIC", name="ttft", response_time=(stamps[0] - start) * 1000, response_length=0,
             exception=None, context={})
        if len(stamps) > 1:
            itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000
            fire(request_type="METRIC", name="itl", response_time=itl, response_length=0, exception=None, context={})
