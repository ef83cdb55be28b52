"""`hsx bench --image-chat`: chats with images, hsx's states path against vLLM's own prefill.

The same chats (1 to 3 images each, PNG and JPEG of several sizes, as data URIs) go
(v) through vLLM's own chat path, `LLM.chat(..., SamplingParams(max_tokens=1))` in a child
process (vLLM's template rendering, image loading, processor and prefill: the least any
image-chat prefill costs on this engine), then (h) through `hsx serve` on the same model and
engine flags: `POST /hidden_states` with the messages from `HsxClient`s at --concurrency,
every body decoded, once per --transfer: `auto` (same-host leases: the states read from the
server's shared memory, then released), `http:none` (identity bodies), `http:zstd`; with
`--workers N` the chats are split over N client processes (as `hsx bench --workers`). One
engine at a time; each mode warms up on chats of its own first. `--make-model SPEC` writes a
Qwen2.5-VL of that shape (`hsx bench --make-model`'s keys, `family=qwen2_5_vl`, `vit_*` for the
vision tower, `weights=0` with `--engine-arg=--load-format=dummy`). The report prints
tokens/s and chats/s of each and hsx's ratio to vLLM's."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hsx_tools.bench.common import child_env, hardware, log, versions_light

SIZES = [(64, 64), (100, 80), (200, 150), (300, 40), (160, 240), (448, 336)]


def _image(i: int, variant: int = 0) -> tuple[str, bytes]:
    """Image `i` of a run: its size from SIZES, its pixels its own (a corner block coded from `i`
    and the run's `variant`), so that no image repeats within or across runs (vLLM's multimodal
    cache would serve a repeated one without processing it)."""
    from PIL import Image

    w, h = SIZES[i % len(SIZES)]
    img = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    img.paste((40 * i % 256, 90, 200 - 30 * i % 200), (0, 0, w // 2, h // 2))
    img.paste((i % 256, i // 256 % 256, 40 * variant % 256), (w - 16, h - 16, w, h))
    buf = io.BytesIO()
    kind = "PNG" if i % 2 else "JPEG"
    img.save(buf, kind)
    return f"image/{kind.lower()}", buf.getvalue()


def make_chats(count: int, seed: int, variant: int = 0) -> list[list[dict[str, Any]]]:
    """`count` chats: a system turn, a user turn with 1 to 3 images and a question, an answer.
    Each `variant` (one per measured run) has the same token counts and other pixels: no
    multimodal-cache hits across runs, and no prefix-cache hits past the first image (vLLM
    hashes a block's images into its key)."""
    chats = []
    for n in range(count):
        parts = []
        for k in range(1 + (n + seed) % 3):
            mime, data = _image(n * 3 + k + seed, variant)
            parts.append({"type": "image_url",
                          "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}})
        parts.append({"type": "text", "text": f"Chat {n}: what do these pictures show, and how do they differ?"})
        chats.append([{"role": "system", "content": "You describe pictures."},
                      {"role": "user", "content": parts},
                      {"role": "assistant", "content": "Gradients with a coloured block in one corner."}])
    return chats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsx bench --image-chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a vision-language model directory [a tiny random Qwen2.5-VL]")
    p.add_argument("--make-model", metavar="SPEC",
                   help="write a model of this shape (hsx bench --make-model keys; family defaults to qwen2_5_vl)")
    p.add_argument("--transfer", default="http:zstd",
                   help="(h): comma-separated transfers, each its own measured run on the one server: auto "
                        "(same-host leases), http:none, http:zstd [http:zstd]")
    p.add_argument("--workers", type=int, default=1,
                   help="(h): client processes, the chats split between them, each at --concurrency [1]")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG", help="an hsx serve flag, repeatable")
    p.add_argument("--chats", type=int, default=16, help="chats measured per mode [16]")
    p.add_argument("--warmup", type=int, default=2, help="warm-up chats per mode (not measured) [2]")
    p.add_argument("--concurrency", type=int, default=4, help="(h): requests in flight [4]")
    p.add_argument("--layers", help="(h): hsx serve --layers [the default set]")
    p.add_argument("--dtype", default="float32", help="engine --dtype [float32]")
    p.add_argument("--max-model-len", type=int, default=2048, help="engine --max-model-len [2048]")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a vLLM engine flag for both modes, repeatable [--enforce-eager]")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds an engine may take to start [900]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--workdir", help="model and logs (default: a new temp dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--image-worker", help=argparse.SUPPRESS)
    p.add_argument("--image-client", help=argparse.SUPPRESS)
    return p


def worker_main(config_path: str) -> int:
    """Child process of mode (v): vLLM's LLM.chat on the chats; figures to config['result']."""
    import os

    cfg = json.loads(Path(config_path).read_text())
    from vllm import LLM, SamplingParams

    from hsx_tools.bench.engines import engine_kwargs

    kw = engine_kwargs(cfg["model"], cfg["engine_flags"])
    t = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    chats, warm = make_chats(cfg["chats"], cfg["seed"]), make_chats(cfg["warmup"], cfg["seed"] + 1000)

    def run(batch: list) -> list:
        return llm.chat(batch, sp, add_generation_prompt=False, use_tqdm=False)

    run(warm)
    t0 = time.monotonic()
    outs = run(chats)
    seconds = time.monotonic() - t0
    tokens = [len(o.prompt_token_ids) for o in outs]
    Path(cfg["result"]).write_text(json.dumps({"engine_start_s": start_s, "seconds": seconds, "tokens": tokens}))
    sys.stdout.flush()
    os._exit(0)  # the engine's teardown is not measured


def _run_vllm(ctx: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    from hsx_tools.server_process import own, stop_process_group

    cfg = dict(ctx, result=str(workdir / "result-v.json"))
    cfg_path = workdir / "worker-v.json"
    cfg_path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "hsx_tools.bench", "--image-chat", "--image-worker",
                             str(cfg_path)], env=child_env(), start_new_session=True)
    own(proc)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log(f"(v) timed out after {timeout:.0f}s")
    finally:
        stop_process_group(proc, 5)
    if not Path(cfg["result"]).exists():
        raise RuntimeError(f"mode (v) failed (exit {proc.returncode}); see the lines above")
    return json.loads(Path(cfg["result"]).read_text())


TRANSFER_MODES = {"auto": ("auto", "none", True), "http:none": ("http", "none", False),
                  "http:zstd": ("http", "zstd", False)}


def _client(url: str, concurrency: int, transfer: str):
    from hsx_client.api import HsxClient

    mode, compression, _ = TRANSFER_MODES[transfer]
    return HsxClient([url], concurrency_per_server=concurrency, compression=compression, transfer=mode)


# A lease answered 410 at its release: the chat is redone, as hsx extract redoes such a sample,
# at most this many times (then the run fails: something ends leases it should not).
LEASE_REDOS = 3


async def _fire_with(client, chats: list, concurrency: int, transfer: str) -> tuple[list[tuple[int, int]], int]:
    """(tokens, image tokens) of each chat's states, every body decoded (leased states copied
    out of the server's shared memory, then released), and how many chats were redone: a lease
    gone at its release (410) redoes its chat, so that a run reports such leases instead of
    dying of the first one (the server's /metrics then say how they ended: `_lease_outcomes`)."""
    from hsx.wire import decode
    from hsx_client.errors import LeaseExpiredError

    lease_ok = TRANSFER_MODES[transfer][2]
    sem = asyncio.Semaphore(concurrency)
    redos = 0

    async def one(chat: list) -> tuple[int, int]:
        nonlocal redos
        async with sem:
            for attempt in range(LEASE_REDOS + 1):
                r = await client.hidden_states_response({"messages": chat}, lease_ok=lease_ok)
                if r.lease is None:
                    d = decode(r.body)
                    break
                d = r.decode()
                states = d.hidden_states.clone()  # what a consumer must do before the release
                try:
                    await client.release_lease(r.lease)
                except LeaseExpiredError:
                    redos += 1
                    if attempt == LEASE_REDOS:
                        raise
                    continue
                finally:
                    del states
                break
            return len(d.token_ids), int(d.media_mask.sum()) if d.media_mask is not None else 0

    got = list(await asyncio.gather(*(one(c) for c in chats)))
    return got, redos


def _lease_outcomes(server) -> dict[str, float]:
    """The server's lease counters by outcome (granted, released, expired, unsent, client_gone...)."""
    return server.metrics().by_label("hsx_leases_total", "outcome")


async def _fire(url: str, chats: list, concurrency: int,
                transfer: str = "http:zstd") -> tuple[list[tuple[int, int]], int]:
    async with _client(url, concurrency, transfer) as client:
        return await _fire_with(client, chats, concurrency, transfer)


async def _client_session(cfg: dict, chats: list) -> dict:
    """A --workers client: its connection warmed by one chat, then its share once the go-file appears."""
    go = Path(cfg["go"])
    async with _client(cfg["url"], cfg["concurrency"], cfg["transfer"]) as client:
        await _fire_with(client, make_chats(1, cfg["seed"] + 2000 + cfg["index"], cfg["variant"]), 1, cfg["transfer"])
        Path(cfg["ready"]).write_text("1")
        while not go.exists():
            await asyncio.sleep(0.002)
        t0 = time.time()
        got, redos = await _fire_with(client, chats, cfg["concurrency"], cfg["transfer"])
        return {"start": t0, "end": time.time(), "got": got, "lease_redos": redos}


def client_main(config_path: str) -> int:
    """A client process of --workers: its share of the chats once the parent's go-file appears."""
    cfg = json.loads(Path(config_path).read_text())
    chats = make_chats(cfg["chats"], cfg["seed"], cfg["variant"])[cfg["index"]::cfg["workers"]]
    result = asyncio.run(_client_session(cfg, chats))
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0


def _fire_workers(url: str, ctx: dict[str, Any], transfer: str, variant: int, workdir: Path,
                  timeout: float) -> tuple[float, list, int]:
    """The measured chats over ctx['workers'] client processes: (seconds, [(tokens, image tokens)]
    in chat order, chats redone after a lease gone at its release)."""
    from hsx_tools.server_process import own, stop_process_group

    n = ctx["workers"]
    run_dir = workdir / f"clients-{transfer.replace(':', '-')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    go = run_dir / "go"
    procs = []
    for i in range(n):
        cfg = {"url": url, "chats": ctx["chats"], "seed": ctx["seed"], "index": i, "workers": n,
               "concurrency": ctx["concurrency"], "transfer": transfer, "variant": variant, "go": str(go),
               "ready": str(run_dir / f"ready-{i}"), "result": str(run_dir / f"result-{i}.json")}
        (run_dir / f"client-{i}.json").write_text(json.dumps(cfg))
        proc = subprocess.Popen([sys.executable, "-m", "hsx_tools.bench", "--image-chat", "--image-client",
                                 str(run_dir / f"client-{i}.json")], env=child_env(), start_new_session=True)
        own(proc)
        procs.append(proc)
    try:
        deadline = time.monotonic() + timeout
        while not all((run_dir / f"ready-{i}").exists() for i in range(n)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("image-chat client processes did not start")
            time.sleep(0.01)
        t0 = time.time()
        go.write_text("1")
        for p in procs:
            p.wait(timeout)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"image-chat client processes failed: exits {[p.returncode for p in procs]}")
    finally:
        for p in procs:
            stop_process_group(p, 5)
    results = [json.loads((run_dir / f"result-{i}.json").read_text()) for i in range(n)]
    seconds = max(r["end"] for r in results) - t0
    got: list = [None] * ctx["chats"]
    for i, r in enumerate(results):
        got[i::n] = [tuple(g) for g in r["got"]]
    return seconds, got, sum(r.get("lease_redos", 0) for r in results)


def _run_hsx(ctx: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """One hsx serve; each transfer measured on it in turn (after a warm-up of its own)."""
    from hsx_tools.server_process import ServerProcess

    args = ["--dtype", ctx["dtype"], "--max-model-len", str(ctx["max_model_len"]), "--max-images-per-request", "4",
            *(["--layers", ctx["layers"]] if ctx["layers"] else []), *ctx["server_args"], *ctx["engine_flags"]]
    t = time.monotonic()
    server = ServerProcess(ctx["model"], *args, log_path=workdir / "server-h.log", env=child_env())
    out = []
    try:
        server.wait_ready(timeout)
        start_s = time.monotonic() - t
        for variant, transfer in enumerate(ctx["transfers"], 1):  # (v) ran variant 0
            asyncio.run(_fire(server.url, make_chats(ctx["warmup"], ctx["seed"] + 1000, variant), ctx["concurrency"],
                              transfer))
            before = _lease_outcomes(server)
            if ctx["workers"] > 1:
                seconds, got, redos = _fire_workers(server.url, ctx, transfer, variant, workdir, timeout)
            else:
                chats = make_chats(ctx["chats"], ctx["seed"], variant)
                t0 = time.monotonic()
                got, redos = asyncio.run(_fire(server.url, chats, ctx["concurrency"], transfer))
                seconds = time.monotonic() - t0
            after = _lease_outcomes(server)
            outcomes = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            out.append({"transfer": transfer, "engine_start_s": start_s, "seconds": seconds,
                        "tokens": [g[0] for g in got], "image_tokens": [g[1] for g in got],
                        "lease_redos": redos, "lease_outcomes": outcomes})
            log(f"(h) {transfer}: {sum(g[0] for g in got) / seconds:,.0f} tokens/s"
                + (f"; leases {outcomes}, {redos} chats redone after a 410" if outcomes or redos else ""))
    finally:
        server.stop()
    return out


def _summary(name: str, res: dict[str, Any], chats: int) -> dict[str, Any]:
    tokens = sum(res["tokens"])
    out = {"mode": name, **({"transfer": res["transfer"]} if "transfer" in res else {}), "chats": chats, "tokens": tokens, "seconds": round(res["seconds"], 3),
           "tokens_per_s": round(tokens / res["seconds"], 1), "chats_per_s": round(chats / res["seconds"], 3),
           "engine_start_s": round(res["engine_start_s"], 1)}
    if "image_tokens" in res:
        out["image_tokens"] = sum(res["image_tokens"])
    for key in ("lease_redos", "lease_outcomes"):
        if key in res:
            out[key] = res[key]
    return out


def _make_model(spec: str, workdir: Path, max_model_len: int) -> Path:
    from hsx_tools.bench.common import ensure_model, parse_spec

    if "family" not in parse_spec(spec):
        spec = "family=qwen2_5_vl," + spec
    return ensure_model(spec, workdir, max_model_len - 64)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.image_worker:
        return worker_main(args.image_worker)
    if args.image_client:
        return client_main(args.image_client)
    transfers = [t.strip() for t in args.transfer.split(",") if t.strip()]
    for t in transfers:
        if t not in TRANSFER_MODES:
            raise SystemExit(f"hsx bench --image-chat: --transfer {t!r}: one of {', '.join(TRANSFER_MODES)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-image-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = args.model
        if model is None and args.make_model:
            model = str(_make_model(args.make_model, workdir, args.max_model_len))
        elif model is None:
            from hsx_tools.tiny_model import make_tiny_model

            model = str(make_tiny_model(workdir / "tiny-qwen2_5_vl", "qwen2_5_vl", num_layers=4, dtype=args.dtype))
        flags = args.engine_arg or ["--enforce-eager"]
        ctx = {"model": model, "chats": args.chats, "warmup": args.warmup, "seed": args.seed, "dtype": args.dtype,
               "max_model_len": args.max_model_len, "layers": args.layers, "concurrency": args.concurrency,
               "transfers": transfers, "workers": max(1, args.workers), "server_args": args.server_arg,
               "engine_flags": ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *flags]}
        log(f"image chats: {args.chats} (+{args.warmup} warm-up) on {model}")
        v = _summary("vllm_chat_prefill", _run_vllm(ctx, workdir, args.start_timeout), args.chats)
        log(f"(v) vLLM LLM.chat, max_tokens=1: {v['tokens_per_s']:,.0f} tokens/s, {v['chats_per_s']:.2f} chats/s")
        ctx["engine_flags"] = flags  # hsx serve takes --dtype / --max-model-len itself
        hs = [_summary("hsx_hidden_states", r, args.chats) for r in _run_hsx(ctx, workdir, args.start_timeout)]
        for h in hs:
            log(f"(h) hsx /hidden_states, {h['transfer']}: {h['tokens_per_s']:,.0f} tokens/s, "
                f"{h['chats_per_s']:.2f} chats/s, {h['tokens_per_s'] / v['tokens_per_s']:.3f}x of (v)")
        from hsx_tools.bench.common import model_facts

        ratios = {h["transfer"]: round(h["tokens_per_s"] / v["tokens_per_s"], 3) for h in hs}
        result = {"workload": "image-chat",
                  "model": (model if args.model else args.make_model or "tiny random Qwen2.5-VL (4 layers)"),
                  "model_facts": model_facts(Path(model)),
                  "chats": args.chats, "warmup": args.warmup, "concurrency": args.concurrency,
                  "workers": ctx["workers"], "server_args": args.server_arg,
                  "engine_flags": ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *flags],
                  "modes": [v, *hs], "hsx_vs_vllm_tokens_per_s": ratios[transfers[0]] if len(hs) == 1 else ratios,
                  "same_tokens": all(v["tokens"] == h["tokens"] for h in hs), "hardware": hardware(),
                  "versions": versions_light(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
        print(json.dumps({k: result[k] for k in ("modes", "hsx_vs_vllm_tokens_per_s", "same_tokens")}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
