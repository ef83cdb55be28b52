"""One client's big texts against another client's small requests (issue 36.1).

A flood client sends `--flood` concurrent chats of `--mb` MB of text each (far past the
server's token limit) to `--route`, again as each answers, for `--seconds`; meanwhile another
client, from another loopback address (127.0.0.2: another peer to the server; --other-address),
sends a small two-message chat to /v1/chat/completions one after the other and records each
latency.

    hsx serve stories260K --chat-template llama3.jinja &           # any running server
    python bench/text_flood.py --url http://127.0.0.1:8001 --out r.json

Printed: the other client's p50 / p99 / max latency, and the flood's answers by status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from hsx_tools.bench.common import hardware

SMALL = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Tell me a story about a dog."}]


def big_chat(mb: float, reply: bool) -> list[dict]:
    words = "Once upon a time there was a little dog who liked to run in the park. "
    text = (words * (int(mb * 1e6) // len(words) + 1))[:int(mb * 1e6)]
    return [{"role": "user", "content": text}, *([{"role": "assistant", "content": "The end."}] if reply else [])]


async def flood(url: str, route: str, n: int, mb: float, stop: asyncio.Event, statuses: Counter) -> None:
    states = route != "/v1/chat/completions"  # a chat with a reply to supervise; no max_tokens there
    body = json.dumps({"messages": big_chat(mb, states), **({} if states else {"max_tokens": 4})}).encode()
    headers = {"content-type": "application/json"}

    async def one_sender(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await client.post(url + route, content=body, headers=headers)
                statuses[r.status_code] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        await asyncio.gather(*(one_sender(client) for _ in range(n)))


async def other_client(url: str, stop: asyncio.Event, latencies: list[float], address: str) -> None:
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(transport=transport, timeout=120) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", json={"messages": SMALL, "max_tokens": 4})
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)


async def main_async(args) -> dict:
    stop = asyncio.Event()
    statuses: Counter = Counter()
    latencies: list[float] = []
    quiet: list[float] = []
    quiet_stop = asyncio.Event()
    asyncio.get_running_loop().call_later(2.0, quiet_stop.set)
    await other_client(args.url, quiet_stop, quiet, args.other_address)  # the baseline, no flood
    flooding = asyncio.create_task(flood(args.url, args.route, args.flood, args.mb, stop, statuses))
    await asyncio.sleep(0.5)  # the flood's bodies are on their way
    asyncio.get_running_loop().call_later(args.seconds, stop.set)
    await other_client(args.url, stop, latencies, args.other_address)
    await flooding

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "settings": vars(args), "hardware": hardware(),
        "quiet": {"n": len(quiet), "p50_s": pct(quiet, 0.5), "max_s": max(quiet)},
        "under_flood": {"n": len(latencies), "p50_s": pct(latencies, 0.5), "p99_s": pct(latencies, 0.99),
                        "max_s": max(latencies)},
        "flood_answers": {str(k): v for k, v in statuses.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--route", default="/v1/chat/completions")
    p.add_argument("--flood", type=int, default=24, help="concurrent big requests")
    p.add_argument("--mb", type=float, default=3.9, help="MB of text in each")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--other-address", default="127.0.0.2",
                   help="the other client's address (127.0.0.1: the same peer as the flood)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    u, q = result["under_flood"], result["quiet"]
    print(f"other client: quiet p50 {q['p50_s']:.3f} s; under the flood p50 {u['p50_s']:.3f} s, "
          f"p99 {u['p99_s']:.3f} s, max {u['max_s']:.3f} s ({u['n']} requests); "
          f"flood answers {result['flood_answers']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
