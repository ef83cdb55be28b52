"""Mode (c): hsx end to end. `hsx serve` in a child process; the client's real `hsx
extract` run loop in this one, writing a speculators corpus (every sample fsync'ed and
recorded); profile points for the server alone (bodies dropped, leases released unread)
and an optional RSS soak."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from hsx.sizes import fmt_bytes
from hsx_tools.bench.common import child_env, log, make_prompts
from hsx_tools.bench.memory import TreeSampler, own_memory, reset_own_hwm
from hsx_tools.server_process import ServerProcess


async def _fire(url: str, prompts: list[list[int]], concurrency: int, compression: str, on_done=None,
                lease: bool = False) -> dict[str, int]:
    """Requests through HsxClient, bodies decoded and dropped (warm-up, RSS soak); with
    `lease`, same-host leases released unread (the server side's own ceiling)."""
    from hsx_client.api import HsxClient
    from hsx_client.lease_stream import LeaseStream

    sem = asyncio.Semaphore(concurrency)
    totals = {"wire": 0, "body": 0, "n": 0, "leased": 0}

    async with HsxClient([url], concurrency_per_server=concurrency, compression=compression) as client:
        async def leased_unread(p: list[int]) -> None:
            """A whole lease released at once, or a sample in the chunked lease form walked
            chunk by chunk (each chunk's lease released as the next is asked for): never
            collected, however long the sample. A body (no lease offered) is read and dropped."""
            s = await client.hidden_states_stream({"input_ids": p}, lease_ok=True)
            try:
                if isinstance(s, LeaseStream):
                    totals["leased"] += 1
                    async for _ in s.chunks():
                        pass
                elif s.lease is not None:
                    totals["leased"] += 1
                    await s.release()
                else:
                    async for c in s.chunks():
                        totals["body"] += c.data.nbytes
                totals["wire"] += s.wire_bytes
            finally:
                await s.aclose()

        async def one(p: list[int]) -> None:
            async with sem:
                if lease:
                    await leased_unread(p)
                else:
                    r = await client.hidden_states_response({"input_ids": p})
                    totals["wire"] += r.wire_bytes
                    totals["body"] += len(r.body)
            totals["n"] += 1
            if on_done is not None:
                on_done(totals["n"])

        await asyncio.gather(*(one(p) for p in prompts))
    return totals


def run_mode_c(ctx: dict[str, Any], args: argparse.Namespace, workdir: Path, prompts: list[list[int]],
               warm: list[list[int]], timeout: float) -> dict[str, Any]:
    inputs = workdir / "prompts-c.jsonl"
    with open(inputs, "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")
    out_dir = Path(args.output_dir or (workdir / "corpus-c"))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    srv_args = ["--layers", ",".join(map(str, ctx["layers"])), *ctx["engine_flags"], *args.server_arg]
    if args.codec_kind == "zstd":
        srv_args += ["--zstd-level", str(args.codec_level)]
    log(f"(c) starting hsx serve {' '.join(shlex.quote(a) for a in srv_args)}")
    t = time.monotonic()
    server = ServerProcess(ctx["model"], *srv_args, log_path=workdir / "server-c.log", env=child_env())
    res: dict[str, Any] = {"mode": "c", "server_cmd": server.cmd, "server_log": str(server.log_path),
                           "corpus_dir": str(out_dir), "codec": args.codec}
    sampler = None
    try:
        server.wait_ready(timeout)
        res["engine_start_s"] = time.monotonic() - t
        log(f"(c) server ready in {res['engine_start_s']:.1f}s at {server.url}")
        sampler = TreeSampler(server.proc.pid).start()
        t = time.monotonic()
        asyncio.run(_fire(server.url, warm, args.concurrency, args.compression))
        log(f"(c) warm-up: {len(warm)} prompts in {time.monotonic() - t:.1f}s")
        # Profile point: server + HTTP + decompression only (bodies dropped, nothing written),
        # on fresh prompts of the same shape, so (c)'s gap splits into server vs client side.
        fresh = make_prompts(len(prompts), ctx["prompt_len"], ctx["vocab"], ctx["seed"] + 777)
        t = time.monotonic()
        fired = asyncio.run(_fire(server.url, fresh, args.concurrency, args.compression))
        dt = time.monotonic() - t
        res["server_http_only"] = {"tokens_per_s": len(fresh) * ctx["prompt_len"] / dt, "seconds": dt,
                                   "wire_bytes": fired["wire"], "body_bytes": fired["body"]}
        log(f"(c) server+HTTP+decompress only (bodies dropped): {res['server_http_only']['tokens_per_s']:,.0f} tokens/s")
        if "auto" in args.transfers:  # the server side's ceiling with leases: nothing read or written
            t = time.monotonic()
            fired = asyncio.run(_fire(server.url, fresh, args.concurrency, args.compression, lease=True))
            dt = time.monotonic() - t
            res["server_lease_only"] = {"tokens_per_s": len(fresh) * ctx["prompt_len"] / dt, "seconds": dt,
                                        "leased": fired["leased"]}
            log(f"(c) server+lease only (states not read): {res['server_lease_only']['tokens_per_s']:,.0f} tokens/s, "
                f"{fired['leased']}/{len(fresh)} leased")
        for i, transfer in enumerate(args.transfers):
            out = out_dir if i == 0 else out_dir.with_name(f"{out_dir.name}-{transfer.replace(':', '-')}")
            before = server_phases(server)
            if getattr(args, "client_process", False):
                one = _measure_in_own_process(ctx, args, server, inputs, out, prompts, transfer, timeout, workdir)
            else:
                one = _measure_extract(ctx, args, server, inputs, out, prompts, transfer, timeout)
            one["server_phases"] = _phase_delta(before, server_phases(server))
            res.setdefault("by_transfer", {})[transfer] = one
            if i == 0:  # the headline figures: the first transfer asked for (auto = lease when same host)
                res.update(one)
            if i > 0 and not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if args.codec_sample:
            from hsx_tools.bench.codec import measure_corpus_codecs

            res["codec_on_corpus"] = measure_corpus_codecs(out_dir, args.codec_sample)
        if args.rss_soak:
            res["soak"] = soak(server.url, sampler, ctx, args)
    finally:
        try:
            res["server_phases"] = phases = server_phases(server)
            lag = phases.get("loop_lag")  # per 0.1 s timer, not per request: said apart
            log("(c) server time per request by phase (mean s): " + ", ".join(
                f"{k} {v['mean_s']:.4f}" for k, v in phases.items() if k != "loop_lag")
                + (f"; event loop lag {lag['mean_s']:.4f} s per timer" if lag else ""))
        except Exception as exc:  # profile only
            log(f"(c) no phase metrics: {exc}")
        if sampler is not None:
            res["engine_memory"] = sampler.stop()
        server.stop(60)
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    return res


def _measure_in_own_process(ctx: dict[str, Any], args: argparse.Namespace, server: ServerProcess, inputs: Path,
                            out_dir: Path, prompts: list[list[int]], transfer: str, timeout: float,
                            workdir: Path) -> dict[str, Any]:
    """`_measure_extract` in a child of its own session (tools/bench/client_proc.py)."""
    import subprocess
    import sys

    name = transfer.replace(":", "-")
    spec_path, out_path = workdir / f"client-{name}.json", workdir / f"client-{name}.result.json"
    spec = {"ctx": ctx, "url": server.url, "server_log": str(server.log_path), "inputs": str(inputs),
            "out_dir": str(out_dir), "prompts": prompts, "transfer": transfer, "timeout": timeout,
            "args": {k: getattr(args, k, None) for k in ("concurrency", "compression", "codec", "workers", "max_buffer_bytes")}}
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    log(f"(c) client in its own process tree (transfer {transfer})")
    rc = subprocess.run([sys.executable, "-m", "hsx_tools.bench.client_proc", str(spec_path), str(out_path)],
                        env=child_env(), start_new_session=True).returncode
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"(c) the client process ended {rc}\n{server.log_tail()}")
    res = json.loads(out_path.read_text())
    res["client_process"] = True
    return res


def _timing_hooks(timings: dict[str, Any], total: int, prompt_len: int) -> Any:
    """The run loop's hooks that clock the run: t0 at the first request, last_stored at each
    sample on disk (a progress line every tenth), t1 and the client's figures at the end."""
    from hsx_client.corpus.run_state import RunHooks

    step = max(1, total // 10)

    def on_start(run) -> None:
        timings["t0"] = time.monotonic()

    def on_stored(run, index, entry) -> None:
        timings["last_stored"] = time.monotonic()
        stored = run.progress.samples
        if stored % step == 0:
            dt = time.monotonic() - timings["t0"]
            log(f"(c) {stored}/{total} samples stored, {stored * prompt_len / max(dt, 1e-9):,.0f} tokens/s")

    def on_end(run) -> None:
        timings["t1"] = time.monotonic()
        timings["stats"] = run.worker_stats or run.client.stats()  # --workers: the workers' clients did the work
        timings["store_s"] = run.store_s
        timings["life_s"] = run.life_s

    return RunHooks(on_start=on_start, on_stored=on_stored, on_end=on_end)


def _client_profile(stats: dict[str, Any], timings: dict[str, Any], done: int, concurrency: int,
                    measured: float, workers: int) -> dict[str, Any]:
    """Mean seconds per sample, summed over concurrent requests."""
    n = max(1, done)
    return {
        "response_s": stats.get("response_s", 0.0) / n,
        "receive_s": stats.get("receive_s", 0.0) / n, "decode_s": stats.get("decode_s", 0.0) / n,
        "store_s": timings.get("store_s", 0.0) / n, "life_s": timings.get("life_s", 0.0) / n,
        # Little's law: the mean life the throughput implies at this many in flight; well above
        # life_s, samples wait outside the workers' request loops (feeding, slots)
        "implied_life_s": concurrency * measured / n,
        "concurrency": concurrency, "workers": workers,
    }


def _measure_extract(ctx: dict[str, Any], args: argparse.Namespace, server: ServerProcess, inputs: Path,
                     out_dir: Path, prompts: list[list[int]], transfer: str, timeout: float) -> dict[str, Any]:
    """One timed `hsx extract` run loop (speculators corpus) against the running server:
    from the first request to the last sample recorded (RunHooks), finalize apart."""
    from hsx_client.byte_budget import default_max_buffer_bytes
    from hsx_client.corpus.extract import ExtractConfig, run_extract
    from hsx_client.settings import ClientSettings

    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    res: dict[str, Any] = {"transfer": transfer}
    transfer, _, coding = transfer.partition(":")  # http:bf16split: this run's coding
    compression = coding or args.compression
    res["compression"] = compression
    hwm_reset = reset_own_hwm()
    workers = getattr(args, "workers", 1)
    # With --workers the bodies live in the worker processes: this process's own peak is only
    # the manifest writer's, so the client's figure is the sampled tree (the server left out).
    server_proc = getattr(server, "proc", None)  # in --client-process the server is not our child
    exclude = (server_proc.pid,) if server_proc is not None else ()
    sampler = TreeSampler(os.getpid(), interval=0.25, exclude=exclude).start() if workers > 1 else None
    total = len(prompts)
    timings: dict[str, Any] = {}
    hooks = _timing_hooks(timings, total, ctx["prompt_len"])
    cfg = ExtractConfig(
        client=ClientSettings.given([server.url], concurrency_per_server=args.concurrency,
                                   timeout=max(600.0, timeout), compression=compression, transfer=transfer),
        output=out_dir, inputs=[str(inputs)], format="speculators", quiet=True, workers=workers,
        max_buffer_bytes=getattr(args, "max_buffer_bytes", None) or default_max_buffer_bytes(),
    )
    log(f"(c) measuring {total} prompts x {ctx['prompt_len']} tokens, concurrency {args.concurrency}, "
        f"transfer {transfer}, coding {compression} -> {out_dir}")
    t_run = time.monotonic()
    try:
        result = run_extract(cfg, run_hooks=hooks)
    finally:
        tree = sampler.stop() if sampler is not None else None
    res["run_s"] = time.monotonic() - t_run
    # Before the clock: planning, and with --workers the processes' start (imports, clients).
    res["start_s"] = timings["t0"] - t_run if "t0" in timings else None
    if result.exit_code != 0:
        raise RuntimeError(f"hsx extract ended {result.status}: {result.summary}\n{server.log_tail()}")
    stats = next(iter(timings["stats"].values()))
    summ = result.summary
    # To the last sample on disk, as (a) stops at its last output: with --workers, on_end
    # comes after the worker processes have also closed their clients and exited.
    last = timings.get("last_stored", timings["t1"])
    measured = last - timings["t0"]
    res["teardown_s"] = timings["t1"] - last
    tokens = int(summ.get("tokens") or len(prompts) * ctx["prompt_len"])
    finalize_s = summ.get("finalize_s")
    res.update(
        tokens=tokens, requests=int(summ["done"]), measured_s=measured, tokens_per_s=tokens / measured,
        finalize_s=finalize_s, tokens_per_s_with_finalize=tokens / (measured + (finalize_s or 0)),
        wire_bytes=stats["wire_bytes"], body_bytes=stats["body_bytes"],
        hs_bytes=tokens * len(ctx["layers"]) * ctx["hidden"] * ctx["itemsize"],
        client_retries=stats["retries"], client_errors=stats["errors"],
    )
    res["client_profile"] = _client_profile(stats, timings, int(summ["done"]), args.concurrency, measured, workers)
    # max_buffer_bytes: the client's memory budget (issue 29); peak_rss: its tree's peak
    res["client_memory"] = {**own_memory(), "hwm_reset_before_run": hwm_reset, "max_buffer_bytes": cfg.max_buffer_bytes}
    if tree is not None:  # peak_rss: the whole client (parent + workers); the parent alone kept apart
        res["client_memory"].update(parent_peak_rss=res["client_memory"]["peak_rss"],
                                    peak_rss=tree["peak_rss_sum"], tree=tree)
    res["corpus"] = check_corpus(out_dir, prompts, ctx)
    log(f"(c) [{transfer}] {res['tokens_per_s']:,.0f} tokens/s; finalize {res['finalize_s'] or 0:.1f}s; corpus "
        f"{res['corpus'].get('rows')} rows, {fmt_bytes(res['corpus'].get('disk_bytes'))} on disk")
    return res


def _phase_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The phases of the requests between two readings (one timed run)."""
    out = {}
    for p, a in after.items():
        b = before.get(p, {"count": 0, "total_s": 0.0})
        n, s = a["count"] - b["count"], a["total_s"] - b["total_s"]
        if n > 0:
            out[p] = {"mean_s": s / n, "count": n, "total_s": s}
    return out


def server_phases(server: ServerProcess) -> dict[str, dict[str, float]]:
    """Mean seconds per request in each server phase (wait, tokenize, engine, copy, send),
    and under `loop_lag` the API process's event loop lag (mean s per 0.1 s timer)."""
    m = server.metrics()
    sums, counts = m.by_label("hsx_phase_seconds_sum", "phase"), m.by_label("hsx_phase_seconds_count", "phase")
    out = {p: {"mean_s": sums[p] / counts[p], "count": counts[p], "total_s": sums[p]} for p in sums if counts.get(p)}
    lag_n = m.get("hsx_event_loop_lag_seconds_count", 0.0)
    if lag_n:  # servers before the lag probe have no such metric
        lag_s = m.get("hsx_event_loop_lag_seconds_sum")
        out["loop_lag"] = {"mean_s": lag_s / lag_n, "count": lag_n, "total_s": lag_s}
    return out


def check_corpus(out_dir: Path, prompts: list[list[int]], ctx: dict[str, Any]) -> dict[str, Any]:
    """The corpus as a trainer opens it: the datasets table, and sample files' shapes."""
    import datasets
    from safetensors import safe_open

    info: dict[str, Any] = {}
    hs_dir = out_dir / "hidden_states"
    info["disk_bytes"] = sum(p.stat().st_size for p in hs_dir.glob("*.safetensors"))
    info["files"] = len(list(hs_dir.glob("*.safetensors")))
    ds = datasets.load_from_disk(str(out_dir))
    info["rows"] = len(ds)
    row_ids = [list(map(int, ds[i]["input_ids"])) for i in (0, len(ds) - 1)]
    wanted = {tuple(p) for p in prompts}
    for i in sorted({0, info["rows"] - 1}):
        with safe_open(str(hs_dir / f"hs_{i}.safetensors"), framework="pt") as f:
            shape = list(f.get_slice("hidden_states").get_shape())
            tok = f.get_tensor("token_ids").tolist()
        want = [ctx["prompt_len"], len(ctx["layers"]), ctx["hidden"]]
        if shape != want:
            raise RuntimeError(f"corpus hs_{i}: shape {shape}, expected {want}")
        if tuple(tok) not in wanted:
            raise RuntimeError(f"corpus hs_{i}: token_ids are none of the prompts")
        if row_ids[0 if i == 0 else 1] != tok:
            raise RuntimeError(f"corpus hs_{i}: token_ids differ from table row {i}'s input_ids")
    info["ok"] = True
    return info


def soak(url: str, sampler: TreeSampler, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`--rss-soak N`: N x the prompt count more requests on the same server; the
    server's RSS at 10/50/100% of them (flat = no growth with the amount served)."""
    n = args.rss_soak * ctx["prompts"]
    marks = {max(1, int(n * f)): f for f in (0.1, 0.5, 1.0)}
    points: dict[str, Any] = {"before": sampler.sample()}
    lease = args.transfers[0] == "auto"  # the headline path; leases are released unread
    log(f"(c) RSS soak: {n} more requests ({'same-host leases' if lease else 'HTTP bodies'})")
    t = time.monotonic()
    seed = ctx["seed"] + 1000
    batch = max(ctx["prompts"], 1)
    done = 0
    while done < n:  # prompts made batch by batch: memory of this process stays flat too
        k = min(batch, n - done)
        ps = make_prompts(k, ctx["prompt_len"], ctx["vocab"], seed + done)

        def on_done(i: int, base: int = done) -> None:
            f = marks.get(base + i)
            if f is not None:
                m = sampler.sample()
                points[f"{int(f * 100)}%"] = m
                log(f"(c) soak {int(f * 100)}%: server tree RSS {fmt_bytes(m['rss'])}, PSS {fmt_bytes(m['pss'])}, "
                    f"API process {fmt_bytes(m['root_rss'])}")

        asyncio.run(_fire(url, ps, args.concurrency, args.compression, on_done, lease=lease))
        done += k
    s = time.monotonic() - t
    return {"requests": n, "seconds": s, "tokens_per_s": n * ctx["prompt_len"] / s, "points": points,
            "transfer": "lease" if lease else "http"}
