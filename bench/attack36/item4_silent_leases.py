"""Issue 36.4 rerun: 33 same-host clients each take a chunked lease answer and then release
nothing. Each request must end (410 record, engine request aborted, window and KV freed)
within about --lease-timeout of its head, and the leased windows never pass half the arena
(it overshot by one window: 2,162,688 vs 2,097,152 bytes).

    python bench/attack36/item4_silent_leases.py [--lease-timeout 10] [--streams 33]

Starts its own `hsx serve` (stories260K, fp32, --arena-bytes 4MiB --stream-window-bytes
64KiB: a 451-token sample is 7 windows) and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from common import load, serve
from record import record
from silent_streams import stall_a_chunked_lease_stream

ARENA, WINDOW = 4 << 20, 64 << 10


async def attack(url: str, streams: int, timeout: float) -> dict:
    from hsx.protocol.lease import attach
    from hsx_tools.server_process import MetricValues

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 4)) as client:
        async def metrics() -> MetricValues:
            return MetricValues((await client.get(url + "/metrics")).text)

        arena = attach((await client.get(url + "/info")).json()["shm_lease"], None)
        peak = {"arena_used": 0.0, "inflight": 0.0, "kv": 0.0, "leases_live": 0.0}
        stop = asyncio.Event()

        async def watch():
            while not stop.is_set():
                m = await metrics()
                for key, name in (("arena_used", "hsx_arena_used_bytes"), ("inflight", "hsx_inflight_requests"),
                                  ("kv", "hsx_kv_cache_usage"), ("leases_live", "hsx_leases_live")):
                    peak[key] = max(peak[key], m.get(name, 0.0))
                await asyncio.sleep(0.25)

        watcher = asyncio.ensure_future(watch())
        t0 = time.monotonic()
        tasks = await asyncio.gather(*(stall_a_chunked_lease_stream(client, url, arena.session, [1] + [7 + i] * 450)
                                       for i in range(streams)))
        heads = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*tasks), timeout + 120)
        freed_at = None
        while freed_at is None:
            m = await metrics()
            if m.get("hsx_inflight_requests") == 0 and m.get("hsx_arena_used_bytes") == 0 and m.get("hsx_leases_live") == 0:
                freed_at = time.monotonic()
            else:
                await asyncio.sleep(0.25)
        stop.set()
        await watcher
        expired = (await metrics()).get("hsx_leases_total", 0, outcome="expired")
        after = await client.post(url + "/hidden_states", json={"input_ids": [1, 5, 6, 7]})
        arena.close()
    lease_ends = [at - t0 for at, records, kind in ended if kind == "lease"]
    last = [records[-1] if records else {} for _, records, kind in ended if kind == "lease"]
    return {"streams": streams, "lease_timeout_s": timeout, "lease_streams": len(lease_ends),
            "body_answers": sum(kind == "body" for *_, kind in ended),
            "all_heads_s": round(heads - t0, 2), "last_stream_end_s": round(max(lease_ends, default=0), 2),
            "freed_s": round(freed_at - t0, 2),
            "end_records": sorted({f"{r.get('status')}: {str(r.get('error'))[:60]}" for r in last}),
            "peak_arena_used_bytes": int(peak["arena_used"]), "half_arena_bytes": ARENA // 2,
            "peak_inflight": int(peak["inflight"]), "peak_kv_cache_usage": round(peak["kv"], 4),
            "peak_leases_live": int(peak["leases_live"]), "leases_expired": int(expired),
            "next_request_status": after.status_code}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lease-timeout", type=float, default=10)
    p.add_argument("--streams", type=int, default=33)
    args = p.parse_args()
    server = serve("--dtype", "float32", "--arena-bytes", str(ARENA), "--stream-window-bytes", str(WINDOW),
                   "--lease-timeout", f"{args.lease_timeout:g}", name="item4")
    try:
        before = load()
        figures = asyncio.run(attack(server.url, args.streams, args.lease_timeout))
    finally:
        server.stop()
    figures["load"] = max(before, load())
    figures["holds"] = (figures["last_stream_end_s"] <= figures["all_heads_s"] + args.lease_timeout + 15
                        and figures["peak_arena_used_bytes"] <= ARENA // 2 + WINDOW * figures["body_answers"]
                        and all(r.startswith("410") for r in figures["end_records"])
                        and figures["next_request_status"] == 200)
    record("4", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
