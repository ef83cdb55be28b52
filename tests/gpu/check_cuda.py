"""The service's correctness check on a CUDA machine (run by hand on the lent H200).

Same checks as tests/service/test_service_correctness.py, against a real `hsx serve` with torch.compile
and CUDA graphs on (vLLM's defaults): a random bf16 Llama (concurrent mixed lengths, a
prompt longer than --max-num-batched-tokens, shared prefixes with prefix caching, same-host
leases, requests hung up mid-flight), the trained stories260K with real chats through a real
template, and any extra model directory (e.g. a tiny random hybrid, MoE or DeepSeek-V3 from
`hsx make-tiny-model`) with every layer compared, also served quantized with
`--extra-quantization fp8`. The reference is transformers in fp32.
After each server's load: the arena, hsx's in-flight counters and vLLM's KV-cache usage
(`hsx_kv_cache_usage`, where this hsx exposes it) back to idle, read from /metrics. The model
runner that registered hsx's connector is read from the server log (`--expect-runner`).
Prints one line per check and PASS/FAIL; exit 1 on any failure; `--json FILE` keeps them.

    python tests/gpu/check_cuda.py --stories DIR --chats FILE --template FILE \
        [--tensor-parallel-size 2] [--extra-model DIR ...] [--expect-runner v2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _reference import per_layer_rel_err, reference_states  # noqa: E402
from _server import ServerProcess, engine_env  # noqa: E402

from hsx.wire import decode  # noqa: E402

BF16_TOL = 3e-2
FP32_TOL = 1e-3
# fp8 weights and activations (vLLM's on-the-fly --quantization fp8) against fp32: a bound that
# catches wrong or missing states, not a grade of fp8 (the measured figure goes to the JSON).
FP8_TOL = 0.15
# vLLM's DeepSeek-V2/V3 text model cannot capture id 0 (hsx refuses it at start).
NO_LAYER_ZERO = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
results: list[dict] = []
failures: list[str] = []


def verdict(name: str, ok: bool, detail: str, **figures: float) -> None:
    results.append({"check": name, "ok": ok, "detail": detail, **figures})
    if not ok:
        failures.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def report(name: str, errs: list[float], tol: float, extra: str = "") -> None:
    worst = max(errs) if errs else float("nan")
    verdict(name, bool(errs) and worst < tol, f"worst per-layer rel err {worst:.2e} (tol {tol:g}) {extra}",
            worst_rel_err=worst, tol=tol)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Peaks:
    """Polls /metrics while a load runs: the highest arena use and KV-cache usage seen."""

    def __init__(self, url: str):
        self.url, self.arena, self.kv, self._task = url, 0.0, 0.0, None

    async def _poll(self) -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            while True:
                text = (await c.get(self.url + "/metrics")).text
                for name, attr in (("hsx_arena_used_bytes", "arena"), ("hsx_kv_cache_usage", "kv")):
                    m = re.search(rf"^{name} (\S+)$", text, re.M)
                    if m:
                        setattr(self, attr, max(getattr(self, attr), float(m.group(1))))
                await asyncio.sleep(0.05)

    async def run(self, coro):
        self._task = asyncio.ensure_future(self._poll())
        try:
            return await coro
        finally:
            self._task.cancel()


async def fetch_all(url: str, bodies: list[dict], peaks: Peaks | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=600, headers={"Accept-Encoding": "zstd"}) as c:
        load = asyncio.gather(*[c.post(url + "/hidden_states", json=b) for b in bodies])
        return await (peaks.run(load) if peaks else load)


async def fetch_leased(url: str, bodies: list[dict]) -> list[tuple[bool, list[int], torch.Tensor, list[int]]]:
    """Through the client's same-host path: states read from the server's arena, then released."""
    from hsx_client.api import HsxClient

    async with HsxClient([url], concurrency_per_server=16) as c:
        async def one(b: dict):
            raw = await c.hidden_states_response(b, lease_ok=True)
            d = raw.decode()
            hs = d.hidden_states.clone()
            if raw.lease is not None:
                await c.release_lease(raw.lease)  # raises if the range was reused meanwhile
            return raw.lease is not None, d.token_ids.tolist(), hs, d.layer_ids

        return await asyncio.gather(*[one(b) for b in bodies])


async def hang_up_mid_flight(url: str, bodies: list[dict]) -> int:
    """Send `bodies` at once and close every connection as soon as the server reports a request
    inside the engine; return how many were still unanswered (aborted by the server)."""
    async with httpx.AsyncClient(timeout=120) as client, httpx.AsyncClient(timeout=10) as probe:
        calls = [asyncio.ensure_future(client.post(url + "/hidden_states", json=b)) for b in bodies]
        deadline = time.monotonic() + 30
        while re.search(r"^hsx_engine_requests 0\.0$", (await probe.get(url + "/metrics")).text, re.M):
            if time.monotonic() > deadline or all(c.done() for c in calls):
                break
        for call in calls:
            call.cancel()
        rs = await asyncio.gather(*calls, return_exceptions=True)
    return sum(isinstance(r, asyncio.CancelledError) for r in rs)


def check_leased(model_dir: str, got, bodies, tol: float, name: str) -> None:
    errs, bad = [], 0
    for b, (leased, ids, hs, layer_ids) in zip(bodies, got):
        if not leased or ids != b["input_ids"]:
            bad += 1
            continue
        ref = reference_states(model_dir, ids, layer_ids)
        errs.append(max(per_layer_rel_err(hs, ref.cpu())))
    report(name, errs + ([float("inf")] if bad else []), tol, f"({len(bodies)} requests, {bad} bad or not leased)")


def check(model_dir: str, rs, bodies, tol: float, name: str) -> None:
    errs, bad = [], 0
    for b, r in zip(bodies, rs):
        if r.status_code != 200:
            bad += 1
            print("   ", r.status_code, r.text[:300])
            continue
        d = decode(r.content)
        if "input_ids" in b and d.token_ids.tolist() != b["input_ids"]:
            bad += 1
        ref = reference_states(model_dir, d.token_ids.tolist(), d.layer_ids)
        errs.append(max(per_layer_rel_err(d.hidden_states.cpu(), ref.cpu())))
    report(name, errs + ([float("inf")] if bad else []), tol, f"({len(bodies)} requests, {bad} bad)")


def check_runner(srv: ServerProcess, name: str, expect: str) -> None:
    lines = re.findall(r"hsx connector: vLLM (\S+), ([^,]+), hidden-states cache view (.*)$",
                       srv.log_path.read_text(errors="replace"), re.M)
    if not lines:
        verdict(f"{name}: model runner", expect == "any", "no 'hsx connector:' line in the server log")
        return
    version, runner, view = lines[0]
    want = {"v2": "Model Runner V2", "v1": "V1 model runner"}.get(expect)
    verdict(f"{name}: model runner", want is None or runner == want,
            f"vLLM {version}, {runner} (expected {want or 'any'}), cache view {view} [{len(lines)} rank(s)]")


def check_idle(srv: ServerProcess, name: str, peaks: Peaks | None = None) -> None:
    """Arena, hsx's counters and vLLM's KV-cache usage back to idle after the load."""
    deadline, m = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        m = metrics(srv.url)
        if (m.get("hsx_arena_used_bytes", 1) == 0 and m.get("hsx_inflight_requests", 1) == 0
                and m.get("hsx_engine_requests", 1) == 0 and m.get("hsx_kv_cache_usage", 0) < 1e-9):
            break
        time.sleep(0.25)
    kv = m.get("hsx_kv_cache_usage")
    kv_text = "hsx_kv_cache_usage: not exposed by this hsx" if kv is None else f"KV-cache usage {kv:.4f}"
    seen = f"; peaks during the load: arena {peaks.arena / 2**20:.1f} MiB, KV {peaks.kv:.3f}" if peaks else ""
    ok = (m.get("hsx_arena_used_bytes") == 0 and m.get("hsx_inflight_requests") == 0
          and m.get("hsx_engine_requests") == 0 and (kv is None or kv < 1e-9))
    verdict(f"{name}: back to idle", ok, f"arena {m.get('hsx_arena_used_bytes')} B, in flight "
            f"{m.get('hsx_inflight_requests')}, in engine {m.get('hsx_engine_requests')}, {kv_text}{seen}")


def server(model: str, *args: str, a, log_dir: Path, name: str, mem: float) -> ServerProcess:
    tp = a.tensor_parallel_size
    flags = [*args, "--gpu-memory-utilization", str(mem)]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    t0 = time.time()
    srv = ServerProcess(model, *flags, log_dir=log_dir, name=name, compiled=True, env=engine_env(VLLM_LOGGING_LEVEL="INFO"))
    srv.wait_ready(900)
    info = httpx.get(srv.url + "/info").json()
    print(f"{name} ready in {time.time() - t0:.0f}s: vLLM {info['vllm_version']}, TP {tp}, layers {info['layer_ids']}",
          flush=True)
    check_runner(srv, name, a.expect_runner)
    return srv


def stop(srv: ServerProcess) -> None:
    print(f"  server exit code {srv.stop()}", flush=True)
    if failures:
        print(srv.log_tail(40))


def random_model_checks(a, work: Path) -> None:
    from hsx_tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(work / "rand-llama", num_layers=8, hidden_size=1024, intermediate_size=2816,
                            num_heads=8, num_kv_heads=4, vocab_size=32000, max_position_embeddings=4096,
                            dtype="bfloat16")
    srv = server(str(model), "--dtype", "bfloat16", "--max-model-len", "4096", "--enable-prefix-caching",
                 "--max-num-batched-tokens", "1024", a=a, log_dir=work, name="random-llama", mem=0.4)
    try:
        info = httpx.get(srv.url + "/info").json()
        rng = random.Random(0)
        mixed = [{"input_ids": [1] + [rng.randrange(6, 32000) for _ in range(rng.choice([3, 31, 200, 700, 1500, 3000]))]}
                 for _ in range(48)]
        peaks = Peaks(srv.url)
        t1 = time.time()
        rs = asyncio.run(fetch_all(srv.url, mixed, peaks))
        print(f"  48 concurrent mixed-length requests in {time.time() - t1:.1f}s", flush=True)
        check(str(model), rs, mixed, BF16_TOL, "random-llama bf16: 48 concurrent mixed lengths (3..3000 tokens, "
              "chunked prefill above 1024)")
        got = asyncio.run(fetch_leased(srv.url, mixed))
        check_leased(str(model), got, mixed, BF16_TOL, "random-llama bf16: the same 48 through same-host leases")
        prefix = [1] + [rng.randrange(6, 32000) for _ in range(600)]
        shared = [{"input_ids": prefix + [rng.randrange(6, 32000) for _ in range(rng.randrange(1, 300))]}
                  for _ in range(32)] + [{"input_ids": prefix}]
        asyncio.run(fetch_all(srv.url, [{"input_ids": prefix}]))
        rs = asyncio.run(fetch_all(srv.url, shared))
        check(str(model), rs, shared, BF16_TOL, "random-llama bf16: 33 prompts sharing a cached 601-token prefix")
        sub = asyncio.run(fetch_all(srv.url, [{"input_ids": prefix[:50], "layers": [info["layer_ids"][-1],
                                                                                    info["layer_ids"][0]]}]))[0]
        d = decode(sub.content)
        want = sorted([info["layer_ids"][0], info["layer_ids"][-1]])
        verdict("random-llama: layer subset comes back ascending", d.layer_ids == want, f"{d.layer_ids}")
        long_ones = [{"input_ids": [1] + [rng.randrange(6, 32000) for _ in range(4000)]} for _ in range(64)]
        hung = asyncio.run(hang_up_mid_flight(srv.url, long_ones))
        disconnected = metrics(srv.url).get('hsx_requests_total{status="disconnected"}', 0)
        verdict("random-llama: 64 x 4001-token requests hung up mid-flight", hung > 0,
                f"{hung} of 64 unanswered when the clients closed; server counted {disconnected:.0f} disconnected")
        check_idle(srv, "random-llama", peaks)
        rs = asyncio.run(fetch_all(srv.url, mixed[:8]))
        check(str(model), rs, mixed[:8], BF16_TOL, "random-llama bf16: 8 requests after the hang-ups")
        m = httpx.get(srv.url + "/metrics").text
        print("  " + " ".join(line for line in m.splitlines() if line.startswith(("hsx_compression_ratio",
                                                                                 "hsx_tokens_total"))), flush=True)
    finally:
        stop(srv)


def stories_checks(a, work: Path) -> None:
    srv = server(a.stories, "--dtype", "bfloat16", "--layers", "0,1,2,3,4,5", "--enable-prefix-caching",
                 "--max-num-batched-tokens", "256", "--chat-template", a.template, a=a, log_dir=work,
                 name="stories260K", mem=0.3)
    try:
        threads = [json.loads(line)["messages"] for line in open(a.chats)][:40]
        bodies = [{"messages": m, "max_length": 511, "truncation": "right"} for m in threads]
        rs = asyncio.run(fetch_all(srv.url, bodies))
        masks = [int(decode(r.content).loss_mask.sum()) for r in rs if r.status_code == 200]
        check(a.stories, rs, bodies, BF16_TOL, f"stories260K bf16: 40 OpenAssistant chats via llama3 template "
              f"(supervised tokens per chat: min {min(masks) if masks else 0})")
        check_idle(srv, "stories260K")
    finally:
        stop(srv)


def extra_model_checks(a, model_dir: str, work: Path, quantization: str | None = None) -> None:
    """Every layer 0..N (1..N for DeepSeek) of a model directory (hybrid, MoE, MLA, ...) against
    transformers fp32; with `quantization`, served with vLLM's --quantization (e.g. fp8 on the fly)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    n = int(text["num_hidden_layers"])
    first = 1 if text.get("model_type", cfg.get("model_type")) in NO_LAYER_ZERO else 0
    name = f"{Path(model_dir).name} ({'/'.join(cfg.get('architectures', ['?']))}, {n} layers)"
    tol = FP8_TOL if quantization else FP32_TOL if a.extra_dtype == "float32" else BF16_TOL
    quant = ["--quantization", quantization] if quantization else []
    label = f"{a.extra_dtype}{' + ' + quantization if quantization else ''}"
    srv = server(model_dir, "--dtype", a.extra_dtype, "--layers", ",".join(map(str, range(first, n + 1))),
                 "--max-model-len", "1024", "--max-num-batched-tokens", "256", *quant, *a.extra_serve_arg, a=a,
                 log_dir=work, name=Path(model_dir).name + (f"-{quantization}" if quantization else ""), mem=0.3)
    try:
        vocab = int(text.get("vocab_size", 1000))
        # Text-only prompts: a multimodal model's image placeholder without its image is embedded
        # as token 0 by transformers and as itself by vLLM (docs/compatibility.md, Kimi-K2.5).
        media = {cfg.get("image_token_id"), cfg.get("video_token_id")}
        ids = [i for i in range(6, vocab) if i not in media]
        rng = random.Random(3)
        bodies = [{"input_ids": [1] + [rng.choice(ids) for _ in range(rng.choice([5, 60, 300, 700]))]}
                  for _ in range(16)]
        peaks = Peaks(srv.url)
        rs = asyncio.run(fetch_all(srv.url, bodies, peaks))
        check(model_dir, rs, bodies, tol, f"{name} {label}: every layer of 16 concurrent prompts "
              "(5..700 tokens, chunked above 256)")
        check_idle(srv, Path(model_dir).name, peaks)
    finally:
        stop(srv)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stories")
    p.add_argument("--chats")
    p.add_argument("--template")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--extra-model", action="append", default=[], help="model directory: every layer checked")
    p.add_argument("--extra-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--extra-serve-arg", action="append", default=[],
                   help="hsx serve flag for the extra models only, e.g. --extra-serve-arg=--allow-unverified-hybrid")
    p.add_argument("--expect-runner", default="any", choices=["any", "v1", "v2"],
                   help="which vLLM model runner must have registered hsx's connector (v2: Model Runner V2)")
    p.add_argument("--extra-quantization", action="append", default=[],
                   help="also serve each extra model with vLLM's --quantization Q (e.g. fp8, on the fly)")
    p.add_argument("--skip-random", action="store_true", help="only the stories / extra-model checks")
    p.add_argument("--json", help="write every check's result here")
    a = p.parse_args()
    if a.tensor_parallel_size > 1 and a.tensor_parallel_size > torch.cuda.device_count():
        p.error(f"--tensor-parallel-size {a.tensor_parallel_size}: only {torch.cuda.device_count()} GPU(s) visible")
    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "gpus": torch.cuda.device_count(), "tp": a.tensor_parallel_size}
    print(f"torch {env['torch']}, cuda {env['cuda']} {env['gpu'] or ''} x{env['gpus']}, TP {env['tp']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-check-"))
    t0 = time.time()
    try:
        if not a.skip_random:
            random_model_checks(a, work)
        if a.stories:
            stories_checks(a, work)
        for model_dir in a.extra_model:
            extra_model_checks(a, model_dir, work)
            for q in a.extra_quantization:
                extra_model_checks(a, model_dir, work, q)
    except Exception as exc:  # a server that never came up: report it as a failure, keep the JSON
        verdict("run", False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:2000]}")
    print("ALL PASS" if not failures else f"FAILED: {failures}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "argv": sys.argv[1:], "seconds": round(time.time() - t0),
                                            "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
