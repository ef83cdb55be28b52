"""`hsx bench --image-chat`: chats with images, hsx's states path against vLLM's own prefill.

The same chats (1 to 3 images each, PNG and JPEG of several sizes, as data URIs) go
(v) through vLLM's own chat path, `LLM.chat(..., SamplingParams(max_tokens=1))` in a child
process (vLLM's template rendering, image loading, processor and prefill: the least any
image-chat prefill costs on this engine), then (h) through `hsx serve` on the same model and
engine flags: `POST /hidden_states` with the messages from an `HsxClient` at --concurrency,
every body decoded. One engine at a time; each mode warms up on chats of its own first.
The report prints tokens/s and chats/s of each and hsx's ratio to vLLM's."""

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


def _image(i: int) -> tuple[str, bytes]:
    from PIL import Image

    w, h = SIZES[i % len(SIZES)]
    img = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    img.paste((40 * i % 256, 90, 200 - 30 * i % 200), (0, 0, w // 2, h // 2))
    buf = io.BytesIO()
    kind = "PNG" if i % 2 else "JPEG"
    img.save(buf, kind)
    return f"image/{kind.lower()}", buf.getvalue()


def make_chats(count: int, seed: int) -> list[list[dict[str, Any]]]:
    """`count` chats: a system turn, a user turn with 1 to 3 images and a question, an answer."""
    chats = []
    for n in range(count):
        parts = []
        for k in range(1 + (n + seed) % 3):
            mime, data = _image(n * 3 + k + seed)
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


async def _fire(url: str, chats: list, concurrency: int) -> list[tuple[int, int]]:
    """(tokens, image tokens) of each chat's states, every body decoded."""
    from hsx.wire import decode
    from hsx_client.api import HsxClient

    sem = asyncio.Semaphore(concurrency)
    async with HsxClient([url], concurrency_per_server=concurrency, compression="zstd") as client:
        async def one(chat: list) -> tuple[int, int]:
            async with sem:
                r = await client.hidden_states_response({"messages": chat})
                d = decode(r.body)
                return len(d.token_ids), int(d.media_mask.sum()) if d.media_mask is not None else 0

        return list(await asyncio.gather(*(one(c) for c in chats)))


def _run_hsx(ctx: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    from hsx_tools.server_process import ServerProcess

    args = ["--dtype", ctx["dtype"], "--max-model-len", str(ctx["max_model_len"]), "--max-images-per-request", "4",
            *(["--layers", ctx["layers"]] if ctx["layers"] else []), *ctx["engine_flags"]]
    t = time.monotonic()
    server = ServerProcess(ctx["model"], *args, log_path=workdir / "server-h.log", env=child_env())
    try:
        server.wait_ready(timeout)
        start_s = time.monotonic() - t
        asyncio.run(_fire(server.url, make_chats(ctx["warmup"], ctx["seed"] + 1000), ctx["concurrency"]))
        chats = make_chats(ctx["chats"], ctx["seed"])
        t0 = time.monotonic()
        got = asyncio.run(_fire(server.url, chats, ctx["concurrency"]))
        seconds = time.monotonic() - t0
    finally:
        server.stop()
    return {"engine_start_s": start_s, "seconds": seconds, "tokens": [g[0] for g in got],
            "image_tokens": [g[1] for g in got]}


def _summary(name: str, res: dict[str, Any], chats: int) -> dict[str, Any]:
    tokens = sum(res["tokens"])
    out = {"mode": name, "chats": chats, "tokens": tokens, "seconds": round(res["seconds"], 3),
           "tokens_per_s": round(tokens / res["seconds"], 1), "chats_per_s": round(chats / res["seconds"], 3),
           "engine_start_s": round(res["engine_start_s"], 1)}
    if "image_tokens" in res:
        out["image_tokens"] = sum(res["image_tokens"])
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.image_worker:
        return worker_main(args.image_worker)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-image-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = args.model
        if model is None:
            from hsx_tools.tiny_model import make_tiny_model

            model = str(make_tiny_model(workdir / "tiny-qwen2_5_vl", "qwen2_5_vl", num_layers=4, dtype=args.dtype))
        flags = args.engine_arg or ["--enforce-eager"]
        ctx = {"model": model, "chats": args.chats, "warmup": args.warmup, "seed": args.seed, "dtype": args.dtype,
               "max_model_len": args.max_model_len, "layers": args.layers, "concurrency": args.concurrency,
               "engine_flags": ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *flags]}
        log(f"image chats: {args.chats} (+{args.warmup} warm-up) on {model}")
        v = _summary("vllm_chat_prefill", _run_vllm(ctx, workdir, args.start_timeout), args.chats)
        log(f"(v) vLLM LLM.chat, max_tokens=1: {v['tokens_per_s']:,.0f} tokens/s, {v['chats_per_s']:.2f} chats/s")
        ctx["engine_flags"] = flags  # hsx serve takes --dtype / --max-model-len itself
        h = _summary("hsx_hidden_states", _run_hsx(ctx, workdir, args.start_timeout), args.chats)
        log(f"(h) hsx /hidden_states: {h['tokens_per_s']:,.0f} tokens/s, {h['chats_per_s']:.2f} chats/s")
        result = {"workload": "image-chat", "model": model if args.model else "tiny random Qwen2.5-VL (4 layers)",
                  "chats": args.chats, "warmup": args.warmup, "concurrency": args.concurrency,
                  "engine_flags": ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *flags],
                  "modes": [v, h], "hsx_vs_vllm_tokens_per_s": round(h["tokens_per_s"] / v["tokens_per_s"], 3),
                  "same_tokens": v["tokens"] == h["tokens"], "hardware": hardware(), "versions": versions_light(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime())}
        print(json.dumps({k: result[k] for k in ("modes", "hsx_vs_vllm_tokens_per_s", "same_tokens")}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
