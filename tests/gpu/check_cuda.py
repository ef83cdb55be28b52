"""The service's correctness check on a CUDA machine (run by hand on the lent H200).

Same checks as tests/test_service_correctness.py, against a real `hsx serve` with torch.compile
and CUDA graphs on (vLLM's defaults): a random bf16 Llama (concurrent mixed lengths, a
prompt longer than --max-num-batched-tokens, shared prefixes with prefix caching) and the
trained stories260K with real chats through a real template. The reference is transformers
in fp32 on the same GPU. Prints one line per check and PASS/FAIL; exit 1 on any failure.

    python tests/gpu/check_cuda.py --stories DIR --chats FILE --template FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
failures: list[str] = []


def report(name: str, errs: list[float], tol: float, extra: str = "") -> None:
    worst = max(errs) if errs else float("nan")
    ok = bool(errs) and worst < tol
    if not ok:
        failures.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}: worst per-layer rel err {worst:.2e} (tol {tol:g}) {extra}", flush=True)


async def fetch_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=600, headers={"Accept-Encoding": "zstd"}) as c:
        return await asyncio.gather(*[c.post(url + "/hidden_states", json=b) for b in bodies])


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


def random_model_checks(work: Path, log_dir: Path) -> None:
    from hsx.tiny_model import make_tiny_llama

    model = make_tiny_llama(work / "rand-llama", num_layers=8, hidden_size=1024, intermediate_size=2816,
                            num_heads=8, num_kv_heads=4, vocab_size=32000, max_position_embeddings=4096,
                            dtype="bfloat16")
    t0 = time.time()
    srv = ServerProcess(str(model), "--dtype", "bfloat16", "--max-model-len", "4096", "--enable-prefix-caching",
                        "--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.4",
                        log_dir=log_dir, name="rand", env=engine_env())
    try:
        srv.wait_ready(900)
        info = httpx.get(srv.url + "/info").json()
        print(f"random Llama ready in {time.time() - t0:.0f}s: vLLM {info['vllm_version']}, layers {info['layer_ids']}",
              flush=True)
        rng = random.Random(0)
        mixed = [{"input_ids": [1] + [rng.randrange(6, 32000) for _ in range(rng.choice([3, 31, 200, 700, 1500, 3000]))]}
                 for _ in range(48)]
        t1 = time.time()
        rs = asyncio.run(fetch_all(srv.url, mixed))
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
        ok = d.layer_ids == sorted([info["layer_ids"][0], info["layer_ids"][-1]])
        print(f"{'PASS' if ok else 'FAIL'} layer subset comes back ascending: {d.layer_ids}", flush=True)
        if not ok:
            failures.append("subset")
        m = httpx.get(srv.url + "/metrics").text
        print("  " + " ".join(line for line in m.splitlines() if line.startswith(("hsx_compression_ratio",
                                                                                 "hsx_tokens_total"))), flush=True)
    finally:
        print(f"  server exit code {srv.stop()}", flush=True)
        if failures:
            print(srv.log_tail(40))


def stories_checks(stories: str, chats: str, template: str, log_dir: Path) -> None:
    t0 = time.time()
    srv = ServerProcess(stories, "--dtype", "bfloat16", "--layers", "0,1,2,3,4,5", "--enable-prefix-caching",
                        "--max-num-batched-tokens", "256", "--chat-template", template,
                        "--gpu-memory-utilization", "0.3", log_dir=log_dir, name="stories", env=engine_env())
    try:
        srv.wait_ready(900)
        print(f"stories260K ready in {time.time() - t0:.0f}s", flush=True)
        threads = [json.loads(line)["messages"] for line in open(chats)][:40]
        bodies = [{"messages": m, "max_length": 511, "truncation": "right"} for m in threads]
        rs = asyncio.run(fetch_all(srv.url, bodies))
        masks = [int(decode(r.content).loss_mask.sum()) for r in rs if r.status_code == 200]
        check(stories, rs, bodies, BF16_TOL, f"stories260K bf16: 40 OpenAssistant chats via llama3 template "
              f"(supervised tokens per chat: min {min(masks) if masks else 0})")
    finally:
        print(f"  server exit code {srv.stop()}", flush=True)
        if failures:
            print(srv.log_tail(40))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stories")
    p.add_argument("--chats")
    p.add_argument("--template")
    a = p.parse_args()
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()} "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-check-"))
    random_model_checks(work, work)
    if a.stories:
        stories_checks(a.stories, a.chats, a.template, work)
    print("ALL PASS" if not failures else f"FAILED: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
