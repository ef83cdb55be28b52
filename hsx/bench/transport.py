"""The HTTP client transport study (`hsx bench --transport-only`, `python -m hsx.bench.transport`):
the hand-written transport (client/fast_http.py) against maintained stacks, on bodies
of /hidden_states' size, for throughput and CPU seconds per GB received.

The server is synthetic and fast (one asyncio process writing one prebuilt body per
POST, keep-alive, Content-Length or chunked), so the client is what is measured; each
client runs in a process of its own (`--client` re-entry) so its CPU time is its own.
`--url` points it at a real `hsx serve` instead (bodies then cost the engine too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

CLIENTS = ("fast_http", "httpx", "aiohttp")


async def _serve(port: int, body_bytes: int, chunked: bool, ready) -> None:
    body = os.urandom(1 << 20) * (body_bytes >> 20)
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-safetensors\r\n"
            + (b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % len(body)) + b"\r\n")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await reader.readuntil(b"\r\n\r\n")
                n = next((int(line.split(b":")[1]) for line in req.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(n)
                writer.write(head)
                if chunked:
                    for i in range(0, len(body), 4 << 20):
                        piece = body[i : i + (4 << 20)]
                        writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    ready()
    async with server:
        await server.serve_forever()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run_client(kind: str, url: str, n: int, concurrency: int) -> dict[str, Any]:
    payload = json.dumps({"input_ids": list(range(1, 2049))}).encode()
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    sem = asyncio.Semaphore(concurrency)
    got = 0
    if kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                        read_bufsize=4 << 20, auto_decompress=False)

        async def one() -> int:
            async with sem, session.post(url, data=payload, headers=headers) as r:
                return len(await r.read())
    else:
        import httpx

        from hsx_client.fast_http import FastTransport

        transport = FastTransport() if kind == "fast_http" else None
        session = httpx.AsyncClient(transport=transport, timeout=600,
                                    limits=httpx.Limits(max_connections=concurrency))

        async def one() -> int:
            async with sem, session.stream("POST", url, content=payload, headers=headers) as r:
                return sum([len(c) async for c in r.aiter_raw()])
    try:
        await one()  # warm: connections, imports
        t, c = time.perf_counter(), _cpu()
        got = sum(await asyncio.gather(*(one() for _ in range(n))))
        wall, cpu = time.perf_counter() - t, _cpu() - c
    finally:
        await (session.close() if kind == "aiohttp" else session.aclose())
    return {"client": kind, "requests": n, "bytes": got, "wall_s": wall, "cpu_s": cpu,
            "gb_per_s": got / wall / 1e9, "cpu_s_per_gb": cpu / (got / 1e9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hsx bench --transport-only", description=__doc__.split("\n\n")[0])
    p.add_argument("--body-mb", type=int, default=64, help="body size, MiB [64: 2048 tokens x 4 x 4096 bf16]")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunked", action="store_true", help="chunked bodies instead of Content-Length")
    p.add_argument("--url", help="a real `hsx serve`'s /hidden_states instead of the synthetic server")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:  # re-entry: one client in this process
        print(json.dumps(asyncio.run(_run_client(args.client, args.url, args.requests, args.concurrency))))
        return 0
    from hsx.bench.common import child_env, log
    from hsx.server_process import free_port

    server = None
    url = args.url
    if not url:
        port = free_port()
        code = (f"import asyncio; from hsx.bench.transport import _serve; "
                f"asyncio.run(_serve({port}, {args.body_mb << 20}, {args.chunked}, lambda: print('ready', flush=True)))")
        server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(), text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}/hidden_states"
    rows = []
    try:
        for kind in args.clients.split(","):
            out = subprocess.run([sys.executable, "-m", "hsx.bench.transport", "--client", kind, "--url", url,
                                  "--requests", str(args.requests), "--concurrency", str(args.concurrency)],
                                 env=child_env(), capture_output=True, text=True)
            if out.returncode != 0:
                log(f"transport {kind}: failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            log(f"transport {kind:9s}: {row['gb_per_s']:.2f} GB/s, {row['cpu_s_per_gb']:.2f} CPU s per GB "
                f"({row['requests']} x {args.body_mb} MiB, {args.concurrency} in flight, "
                f"{'chunked' if args.chunked else 'Content-Length'}{'' if not args.url else ', ' + url})")
    finally:
        if server is not None:
            server.kill()
    res = {"transport_study": 1, "body_mb": args.body_mb, "chunked": args.chunked, "url": args.url, "rows": rows,
           "cpu_count": os.cpu_count()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
