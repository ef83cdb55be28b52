#!/usr/bin/env python
"""Milliseconds per decoded token after the first, single requests one at a time:
`python bench/decode_latency.py URL MODEL [PAIRS] [--max-tokens N]`.

Each pair times one greedy chat completion with max_tokens=1 and one with max_tokens=N
against the same OpenAI-compatible server (`hsx serve` or `vllm serve`); their difference over
the extra tokens is the cost of a decode step, free of the route, the tokenizer and the
prefill. Prints one JSON line (per-pair figures and their median). Run it interleaved
across servers that are up at once: on a shared machine only interleaved medians compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request


def complete(url: str, model: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": "Once upon a time there was a little dog"}],
            "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req).read())
    return time.perf_counter() - t, out["usage"]["completion_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("pairs", type=int, nargs="?", default=5)
    p.add_argument("--max-tokens", type=int, default=129)
    args = p.parse_args()
    complete(args.url, args.model, 4)  # warm-up
    per_token = []
    for _ in range(args.pairs):
        t1, _ = complete(args.url, args.model, 1)
        tn, k = complete(args.url, args.model, args.max_tokens)
        per_token.append((tn - t1) / (k - 1) * 1000)
    print(json.dumps({"url": args.url, "ms_per_token": [round(x, 2) for x in per_token],
                      "median": round(statistics.median(per_token), 2), "tokens": k}))


if __name__ == "__main__":
    main()
