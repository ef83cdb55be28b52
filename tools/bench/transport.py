"""The HTTP client transport study (`hsx bench --transport-only`, `python -m hsx_tools.bench.transport`):
client CPU seconds per GB received and GB/s, for /hidden_states-sized bodies, of

- `httpx`: httpx's default transport (httpcore + h11), the baseline of every ratio;
- `aiohttp`: aiohttp's ClientSession directly;
- `httpx_aiohttp`: httpx over the `httpx-aiohttp` transport (what openai-python offers), as
  HsxClient uses it (client/transport.py).

The hand-written transport HsxClient used before (client/fast_http.py) was measured here
against them and lost (figures: bench/results-cpu-2026-12-01-transport.json); the study
on a checkout from before its deletion compares it again.

Each (body size, encoding, concurrency) cell runs every client in a process of its own
(`--client` re-entry), so its CPU time (all its threads, getrusage) is its own; the
clients alternate within a cell, `--repeat` times, and the cheapest run of each counts.
Every client reads the raw body the way HsxClient does: the whole (still compressed)
body in memory, no decoding (zstd decoding costs the same whatever received the bytes).
The server is synthetic and fast (tools/bench/transport_server.py, another process, its
CPU not counted); `--url` points the clients at a real `hsx serve`'s /hidden_states.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

CLIENTS = ("httpx", "aiohttp", "httpx_aiohttp")
BASELINE = "httpx"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _session(kind: str, concurrency: int):
    """(session, fetch(url, payload, headers) -> bytes received, close)."""
    if kind == "aiohttp":
        import aiohttp

        # auto_decompress off: HsxClient decodes zstd itself (in a thread, with large steps)
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False,
                                  timeout=aiohttp.ClientTimeout(total=600))

        async def fetch(url: str, payload: bytes, headers: dict) -> int:
            async with s.post(url, data=payload, headers=headers) as r:
                r.raise_for_status()
                return len(await r.read())

        return fetch, s.close
    import httpx

    if kind == "httpx":
        transport = None
    elif kind == "httpx_aiohttp":
        from hsx_client.transport import HsxTransport

        transport = HsxTransport(concurrency)
    else:
        raise SystemExit(f"unknown client {kind!r} (known: {', '.join(CLIENTS)})")
    c = httpx.AsyncClient(transport=transport, timeout=600,
                          limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))

    async def fetch(url: str, payload: bytes, headers: dict) -> int:
        async with c.stream("POST", url, content=payload, headers=headers) as r:
            r.raise_for_status()
            chunks = [b async for b in r.aiter_raw()]  # as HsxClient._post_hidden_states
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            return len(body)

    return fetch, c.aclose


async def _run_client(kind: str, url: str, n: int, concurrency: int, payload: bytes, encoding: str) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "Accept-Encoding": encoding}
    fetch, close = _session(kind, concurrency)
    sem = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with sem:
            return await fetch(url, payload, headers)

    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm: connections, imports
        t, c = time.perf_counter(), _cpu()
        got = sum(await asyncio.gather(*(one() for _ in range(n))))
        wall, cpu = time.perf_counter() - t, _cpu() - c
    finally:
        await close()
    return {"client": kind, "requests": n, "bytes": got, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
            "gb_per_s": round(got / wall / 1e9, 4), "cpu_s_per_gb": round(cpu / (got / 1e9), 4),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsx bench --transport-only", description=__doc__.split("\n\n")[0])
    p.add_argument("--body-mb", default="8,64,200", help="body sizes, MiB [8,64,200]")
    p.add_argument("--encodings", default="identity,zstd", help="Content-Encodings [identity,zstd]")
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight [1,4,16]")
    p.add_argument("--gb", type=float, default=1.0, help="GB received per client per cell (at least "
                   "`concurrency` requests) [1]")
    p.add_argument("--requests", type=int, help="requests per client per cell instead of --gb")
    p.add_argument("--repeat", type=int, default=2, help="runs of each client per cell; the cheapest counts [2]")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"[{','.join(CLIENTS)}]")
    p.add_argument("--url", help="a real `hsx serve`'s /hidden_states instead of the synthetic server "
                   "(body_mb 0 in the result; --requests, default 200)")
    p.add_argument("--prompt-len", type=int, default=256, help="with --url: tokens per request [256]")
    p.add_argument("--fresh-blocks", action="store_true", help="leave glibc's defaults (a fresh mmap per "
                   "body over 32 MiB), as before 2026-12-02; by default the clients run as `hsx extract` does")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--encoding", default="identity", help=argparse.SUPPRESS)
    return p


def _child(args: argparse.Namespace) -> int:
    payload = json.dumps({"input_ids": [1 + i % 200 for i in range(args.prompt_len)]}).encode()
    kept = False
    if not args.fresh_blocks:  # every client in the allocator `hsx extract` runs with (client/allocator.py)
        from hsx_client.malloc_tuning import keep_large_blocks

        kept = keep_large_blocks()
    row = asyncio.run(_run_client(args.client, args.url, args.requests, int(args.concurrency), payload,
                                  args.encoding))
    row["large_blocks_kept"] = kept
    print(json.dumps(row))
    return 0


def _start_server(sizes: list[int], encodings: list[str]):
    from hsx_tools.bench.common import child_env
    from hsx_tools.server_process import free_port

    port = free_port()
    code = ("import json; from hsx import lifeline; lifeline.hold(); from hsx_tools.bench.transport_server import serve; "
            f"serve({port}, {sizes!r}, {encodings!r}, lambda w: print(json.dumps(w), flush=True))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(), text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("hsx bench --transport-only: the synthetic server did not start")
    return proc, f"http://127.0.0.1:{port}", json.loads(line)


def _hardware() -> dict[str, Any]:
    from hsx.host import usable_cores

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cores": usable_cores(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("httpx", "httpcore", "h11", "aiohttp", "httpx-aiohttp"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def _summarise(cell_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cheapest run per client, with ratios against the baseline's cheapest."""
    best: dict[str, dict[str, Any]] = {}
    for r in cell_rows:
        if r["client"] not in best or r["cpu_s_per_gb"] < best[r["client"]]["cpu_s_per_gb"]:
            best[r["client"]] = dict(r)
    base = best.get(BASELINE)
    for r in best.values():
        r["runs_cpu_s_per_gb"] = [x["cpu_s_per_gb"] for x in cell_rows if x["client"] == r["client"]]
        if base:  # > 1: better than httpx's default on that figure
            r["cpu_vs_httpx"] = round(base["cpu_s_per_gb"] / r["cpu_s_per_gb"], 3)
            r["speed_vs_httpx"] = round(r["gb_per_s"] / base["gb_per_s"], 3)
    return list(best.values())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client:  # re-entry: one client in this process
        return _child(args)
    from hsx_tools.bench.common import child_env, log

    sizes, encodings, concs = _ints(args.body_mb), args.encodings.split(","), _ints(args.concurrency)
    if args.url:  # the server decides the body size
        sizes, args.requests = [0], args.requests or 200
    clients = args.clients.split(",")
    server, wire = None, {}
    base = args.url
    if not base:
        server, base, wire = _start_server(sizes, encodings)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cells = []
    try:
        for enc in encodings:
            for mb in sizes:
                for conc in concs:
                    url = args.url or f"{base}/body?mb={mb}&enc={enc}"
                    per = wire.get(f"{mb},{enc}", mb << 20)
                    n = args.requests or max(conc, round(args.gb * 1e9 / per))
                    runs = []
                    for _ in range(args.repeat):
                        for kind in clients:
                            cmd = [sys.executable, "-m", "hsx_tools.bench.transport", "--client", kind, "--url", url,
                                   "--requests", str(n), "--concurrency", str(conc), "--encoding", enc,
                                   "--prompt-len", str(args.prompt_len)] + (["--fresh-blocks"] if args.fresh_blocks else [])
                            out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
                            if out.returncode != 0:
                                raise SystemExit(f"transport {kind}: failed: {out.stderr.strip()[-2000:]}")
                            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    rows = _summarise(runs)
                    cells.append({"body_mb": mb, "encoding": enc, "concurrency": conc, "requests": n, "rows": rows})
                    if args.out:  # after every cell: a run cut short keeps what it measured
                        _write(args.out, started, args, argv, cells)
                    log(f"transport {mb} MiB {enc} x{conc} ({n} requests):  " + "  ".join(
                        f"{r['client']} {r['cpu_s_per_gb']:.3f} s/GB {r['gb_per_s']:.2f} GB/s"
                        f" ({r.get('cpu_vs_httpx', 0):.2f}x cpu)" for r in rows))
    finally:
        if server is not None:
            server.kill()
            server.wait()
    res = _write(args.out, started, args, argv, cells)
    for line in res["summary"]["lines"]:
        log(line)
    return 0


def _write(path: str | None, started: str, args: argparse.Namespace, argv, cells: list) -> dict[str, Any]:
    res = {"transport_study": 2, "started": started, "url": args.url, "hardware": _hardware(),
           "versions": _versions(), "argv": sys.argv[1:] if argv is None else argv, "cells": cells,
           "summary": summary(cells)}
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
    return res


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client, the geometric mean over cells of CPU/GB vs httpx's default, and the cheapest."""
    import math

    by: dict[str, list[float]] = {}
    for cell in cells:
        for r in cell["rows"]:
            if "cpu_vs_httpx" in r:
                by.setdefault(r["client"], []).append(r["cpu_vs_httpx"])
    gm = {k: round(math.exp(sum(map(math.log, v)) / len(v)), 3) for k, v in by.items()}
    lines = [f"geomean CPU/GB advantage over httpx default: {k} {v:.2f}x" for k, v in gm.items()]
    out: dict[str, Any] = {"cpu_vs_httpx_geomean": gm}
    if gm:
        out["cheapest"] = max(gm, key=gm.get)
        lines.append(f"cheapest client per GB: {out['cheapest']}")
    out["lines"] = lines
    return out


if __name__ == "__main__":
    sys.exit(main())
