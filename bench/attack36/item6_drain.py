"""Issue 36.6 rerun: the drain budget. `--shutdown-timeout 10`, 10 stalled chunk-lease streams
and 20 generations in flight, SIGTERM: in-flight work is cut at the timeout, the process is gone
within timeout + 10 s (it was gone at 19.1 s, the drain 15 s). Then `kill -9` of `hsx serve`
mid-generation: every VLLM::Worker / EngineCore process gone within 2 s (10-15 s before).

    python bench/attack36/item6_drain.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil

from common import TEMPLATES, load, serve
from record import record
from silent_streams import stall_a_chunked_lease_stream

TIMEOUT = 10


def server_args() -> tuple[str, ...]:
    return ("--dtype", "float32", "--chat-template", str(TEMPLATES / "llama3.jinja"), "--stream-window-bytes",
            str(64 << 10), "--lease-timeout", "120", "--shutdown-timeout", str(TIMEOUT))


def generations(client, url: str, n: int) -> list[asyncio.Future]:
    return [asyncio.ensure_future(client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": f"Tell a long story {i}"}], "max_tokens": 400}))
        for i in range(n)]


async def drain(server) -> dict:
    from hsx.protocol.lease import attach

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as client:
        arena = attach((await client.get(server.url + "/info")).json()["shm_lease"], None)
        streams = [await stall_a_chunked_lease_stream(client, server.url, arena.session, [1] + [7 + i] * 450)
                   for i in range(10)]
        gens = generations(client, server.url, 20)
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        server.signal(signal.SIGTERM)
        ended = await asyncio.gather(*streams)
        code = await asyncio.to_thread(server.proc.wait, 120)
        gone = time.monotonic() - t0
        answers = await asyncio.gather(*gens, return_exceptions=True)
        arena.close()
    statuses, first_error = {}, None
    for a in answers:
        if isinstance(a, httpx.Response) and a.status_code not in (200, 503) and first_error is None:
            first_error = a.text[:300]
        key = str(a.status_code) if isinstance(a, httpx.Response) else type(a).__name__
        statuses[key] = statuses.get(key, 0) + 1
    return {"shutdown_timeout_s": TIMEOUT, "streams_last_end_s": round(max(at - t0 for at, *_ in ended), 2),
            "stream_end_records": sorted({str(r[-1].get("status")) + ": " + str(r[-1].get("error"))[:70]
                                          for _, r, _ in ended if r}),
            "generations": statuses, "generation_error": first_error, "exit": code, "gone_s": round(gone, 2), "budget_s": TIMEOUT + 10}


async def kill9(server) -> dict:
    engine = [c for c in psutil.Process(server.proc.pid).children(recursive=True)
              if c.name().startswith("VLLM") or "EngineCore" in " ".join(c.cmdline())]
    async with httpx.AsyncClient(timeout=120) as client:
        gens = generations(client, server.url, 8)
        await asyncio.sleep(1.5)  # the worker computing
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL)
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine) and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        answers = await asyncio.gather(*gens, return_exceptions=True)
    left = [p.pid for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"engine_processes": sorted({p.name() for p in engine}) if engine else [], "gone_s": round(took, 2),
            "left": left, "generations": sorted({type(a).__name__ if not isinstance(a, httpx.Response)
                                                 else str(a.status_code) for a in answers})}


def main() -> None:
    before = load()
    server = serve(*server_args(), name="item6-drain")
    try:
        d = asyncio.run(drain(server))
    finally:
        server.stop()
    d["load"] = max(before, load())
    print(json.dumps(d, indent=1), flush=True)
    before = load()
    server = serve(*server_args(), name="item6-kill9")
    try:
        k = asyncio.run(kill9(server))
    finally:
        server.stop()
    k["load"] = max(before, load())
    figures = {"drain": d, "kill9": k,
               "holds": (d["gone_s"] <= d["budget_s"] and d["exit"] == 0 and d["streams_last_end_s"] <= TIMEOUT + 1.5
                         and k["gone_s"] <= 2 and not k["left"])}
    record("6", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
