"""A zstd-coded /hidden_states body, decoded while it arrives (HsxClient since 2026-12-02;
client/zstd_stream.py, the client's one incremental decoder) against received whole and then
decoded in one step (before), in one process, against one server process.

The server is uvicorn with hsx serve's own body coder (hsx_service.body.encode.encode_body: one
zstd frame compressed in 4 MiB steps on its compression pool, sent as each step ends), so
a body arrives at the pace a real server compresses it. Per request: the time from the
request to the decoded body, and what is left after the last byte (the decode that is not
hidden behind the receive).

    python bench/zstd_stream.py                  # 67 MB bodies (Llama-8B shape, 2048 tokens), 16 requests
    python bench/zstd_stream.py --mb 32 --concurrency 4 --out r.json
    python bench/zstd_stream.py --concurrency 1 --frame-threads 2   # the server's zstd threads per body
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

HIDDEN = 4096
LAYERS = 4


def _states(mb: int):
    import numpy as np

    tokens = max(1, (mb << 20) // (LAYERS * HIDDEN * 2))
    rng = np.random.default_rng(0)
    bits = (rng.standard_normal(tokens * LAYERS * HIDDEN).astype(np.float32) * 3).view(np.uint32) >> 16
    return tokens, bits.astype(np.uint16)


def _serve(port: int, mb: int, threads: int, frame_threads: int) -> None:
    import uvicorn

    from hsx.wire import TensorSpec
    from hsx_service.body.encode import encode_body
    from hsx_service.body.compress import CompressPool
    from hsx_service.body.negotiate import choose_coding
    from hsx_service.body.response import Stats

    tokens, states = _states(mb)
    specs = [TensorSpec("hidden_states", "BF16", (tokens, LAYERS, HIDDEN))]
    pool = CompressPool(threads, 64, 1, frame_threads=frame_threads)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        h = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        coding = choose_coding(h.get("accept"), h.get("accept-encoding"), "bfloat16")
        headers, stream = encode_body(specs, [memoryview(states).cast("B")], {}, coding, Stats(), pool)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.lower().encode(), str(v).encode()) for k, v in headers.items()]})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def _streamed(url: str, n: int, concurrency: int) -> list[tuple[float, float]]:
    """HsxClient as it is: (request -> decoded body s, decode left after the last byte s)."""
    from hsx_client.api import HsxClient

    out = []
    async with HsxClient([url], compression="zstd", concurrency_per_server=concurrency) as c:
        server = c._servers[0]
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                before = server.decode_s
                t = time.perf_counter()
                await c.hidden_states_raw({"input_ids": [1]}, request_id=f"s{i}")
                out.append((time.perf_counter() - t, server.decode_s - before))

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


async def _whole(url: str, n: int, concurrency: int) -> list[tuple[float, float]]:
    """Before: the whole (compressed) body received, then decoded in one step in a thread."""
    import httpx
    import zstandard

    from hsx.wire import check_body
    from hsx_client.transport import HsxTransport

    out = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(transport=HsxTransport(concurrency), timeout=600) as c:
        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                async with c.stream("POST", url + "/hidden_states", content=b"{}",
                                    headers={"Accept-Encoding": "zstd"}) as r:
                    raw = b"".join([b async for b in r.aiter_raw()])
                t_body = time.perf_counter()
                body = await asyncio.to_thread(zstandard.ZstdDecompressor().decompress, raw)
                check_body(body)
                out.append((time.perf_counter() - t, time.perf_counter() - t_body))

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=67, help="body size, MiB of states [67]")
    p.add_argument("--requests", type=int, default=16, help="requests per run [16]")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight [2]")
    p.add_argument("--threads", type=int, default=2, help="the server's compression threads [2]")
    p.add_argument("--frame-threads", type=int, default=0, help="the server's --zstd-frame-threads [0]")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, alternating; the median request counts [3]")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = mp.get_context("spawn").Process(target=_serve, args=(port, args.mb, args.threads, args.frame_threads), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    runs: dict[str, list[tuple[float, float]]] = {"whole_then_decode": [], "streamed": []}
    try:
        asyncio.run(_streamed(url, 2, 1))  # warm-up
        for _ in range(args.repeat):
            runs["whole_then_decode"] += asyncio.run(_whole(url, args.requests, args.concurrency))
            runs["streamed"] += asyncio.run(_streamed(url, args.requests, args.concurrency))
    finally:
        server.terminate()
    result = {"bench": "zstd_stream", "date": time.strftime("%Y-%m-%d"), "mb": args.mb,
              "requests": args.requests, "concurrency": args.concurrency, "server_threads": args.threads,
              "frame_threads": args.frame_threads}
    for name, rows in runs.items():
        result[name] = {"request_s": round(statistics.median(r[0] for r in rows), 4),
                        "after_last_byte_s": round(statistics.median(r[1] for r in rows), 4)}
        print(f"{name:18s} per request (median): {result[name]['request_s']:.3f} s, of it after the last byte "
              f"{result[name]['after_last_byte_s']:.3f} s")
    result["request_ratio"] = round(result["streamed"]["request_s"] / result["whole_then_decode"]["request_s"], 3)
    print(f"streamed / whole-then-decode, time per request: {result['request_ratio']:.3f}")
    from hsx_tools.bench.common import hardware

    result["hardware"] = hardware()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
