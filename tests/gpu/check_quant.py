"""Quantized checkpoints through `hsx serve` on CUDA (run by hand on the lent H200; issue 27).

For each family (the tiny Llama, and the tiny DeepSeek-V3 where hsx_tools.tiny_model has that
family) x each case:
  - `fp8-block`: DeepSeek-V3's block-FP8 format (`hsx quantize-tiny-model --scheme fp8-block`);
  - `w4a16`: compressed-tensors pack-quantized int4, group 128 (Kimi-K2's format): on Hopper
    vLLM prefers Machete for the dense layers, Marlin MoE for the experts;
  - `w4a16-marlin`: the same checkpoint with Machete disabled (VLLM_DISABLED_KERNELS), so the
    dense layers run Marlin, the kernel Kimi-K2 users name;
  - `fp8-online`: the bf16 checkpoint with `--quantization fp8` (`fp8_per_tensor` on vLLM
    releases that renamed it): vLLM quantizes the weights itself at load,
every layer id of hsx's states is compared with transformers in fp32 on the checkpoint's
dequantized twin (the weights exactly as they dequantize, so the difference is the quantized
kernels' arithmetic: bf16 activations, and for FP8 the dynamic FP8 activations), and, for
information, with the unquantized bf16 source (the whole effect of quantizing). fp8-online
has no twin (vLLM picks the scales), so its reference is the source, with a looser tolerance.
docs/quantization.md gives the reasoning behind each tolerance.

All servers start at once (each a small slice of the GPU), so the engines' starts overlap;
each case runs in its own try/except, so one that fails records its error and the others
still run. The transformers reference runs on the CPU in fp32: these models are tiny, and
that keeps it exact fp32 (no TF32) and off the GPU the engines share.

    python tests/gpu/check_quant.py --json $OUT/check-quant.json [--families llama,deepseek_v3]
        [--cases fp8-block,w4a16,w4a16-marlin,fp8-online] [--eager]
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
import traceback
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _reference import per_layer_rel_err, reference_states  # noqa: E402
from _server import ServerProcess, engine_env  # noqa: E402
from check_cuda import fetch_all  # noqa: E402

from hsx_tools.tiny_quant import make_source, quantize_checkpoint  # noqa: E402
from hsx.wire import decode  # noqa: E402

CASES = ("fp8-block", "w4a16", "w4a16-marlin", "fp8-online")
SCHEME = {"fp8-block": "fp8-block", "w4a16": "w4a16", "w4a16-marlin": "w4a16"}  # fp8-online: none
CASE_ENV = {"w4a16-marlin": {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}}
# Worst per-layer relative error allowed against the reference (docs/quantization.md).
TOL = {"w4a16": 3e-2, "w4a16-marlin": 3e-2, "fp8-block": 1e-1, "fp8-online": 2e-1}
NUM_LAYERS = 4
KERNEL_LINE = re.compile(r"(Using \S+|Selected \S+|Quantizing \d+ layers|Marlin|Machete|DeepGemm|DeepGEMM|CUTLASS|"
                         r"Cutlass|BlockScaled|block-scaled)")
NOT_KERNELS = re.compile(r"Initializing a V1|max model len|auxiliary layers|CPU core number")


def families(wanted: list[str]) -> list[str]:
    from hsx_tools.tiny_model import FAMILIES

    missing = [f for f in wanted if f not in FAMILIES]
    if missing:
        print(f"this hsx's make-tiny-model has no family {missing}: skipped", flush=True)
    return [f for f in wanted if f in FAMILIES]


def online_fp8_method() -> str:
    """vLLM 0.26 quantizes a bf16 checkpoint with `--quantization fp8`; later releases refuse
    that ("no longer supports online quantization") and call it fp8_per_tensor."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"


def memory_flags(slice_: float) -> list[str]:
    """A fixed KV cache where this vLLM takes one: engines profiling at the same time on one
    GPU would otherwise count each other's allocations against their own budget."""
    from vllm.engine.arg_utils import EngineArgs

    if not torch.cuda.is_available():  # a CPU smoke run: VLLM_CPU_KVCACHE_SPACE sizes the cache
        return []
    flags = ["--gpu-memory-utilization", str(slice_)]
    if "kv_cache_memory_bytes" in getattr(EngineArgs, "__dataclass_fields__", {}):
        flags += ["--kv-cache-memory-bytes", str(2 << 30)]
    return flags


def prepare(family: str, cases: list[str], work: Path, record: dict) -> list[dict]:
    """The source (bf16), its quantized copies and their twins: one entry per case to serve."""
    src = make_source(work / f"{family}-bf16", family, num_layers=NUM_LAYERS, dtype="bfloat16")
    out, made = [], {}
    for case in cases:
        name = f"{family}/{case}"
        try:
            if case == "fp8-online":
                out.append(dict(name=name, case=case, serve=src, ref=src, src=src,
                                flags=["--quantization", online_fp8_method()]))
                continue
            scheme = SCHEME[case]
            if scheme not in made:
                made[scheme] = quantize_checkpoint(src, work / f"{family}-{scheme}", scheme)
                print(f"{family}/{scheme}: {made[scheme][2]}", flush=True)
            dst, twin, summary = made[scheme]
            out.append(dict(name=name, case=case, serve=dst, ref=twin, src=src, flags=[], summary=summary))
        except Exception as exc:
            record[name] = {"ok": False, "error": f"quantize: {type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()[-3000:]}
            print(f"FAIL {name}: quantize: {exc}", flush=True)
    return out


def prompts(vocab: int) -> list[dict]:
    rng = random.Random(27)
    return [{"input_ids": [1] + [rng.randrange(6, vocab) for _ in range(n)]} for n in (5, 40, 130, 300, 700, 60)]


def kernel_lines(log: Path) -> list[str]:
    seen = []
    for line in log.read_text(errors="replace").splitlines():
        # vLLM's own INFO / WARNING lines only (not traceback frames that mention fp8.py).
        if re.search(r"\b(INFO|WARNING)\b", line) and KERNEL_LINE.search(line) and not NOT_KERNELS.search(line):
            text = re.sub(r"^.*?\] ", "", line).strip()[:300]
            if text not in seen:
                seen.append(text)
    return seen[:12]


def causes(log: Path) -> list[str]:
    """The log's error lines (exception messages, vLLM's kernel refusals), last five distinct."""
    seen: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        if "See root cause above" in line or "stack trace for root cause" in line:
            continue  # vLLM's wrappers around the cause
        if re.search(r"(\w+(Error|Exception): |requires |not supported|No \w+ backend)", line):
            text = re.sub(r"^.*?\] ", "", line).strip()[:400]
            if text in seen:
                seen.remove(text)
            seen.append(text)
    return seen[-5:]


def check_case(c: dict, srv: ServerProcess, deadline: float) -> dict:
    t0 = time.time()
    srv.wait_ready(max(30.0, deadline - time.monotonic()))
    info = httpx.get(srv.url + "/info").json()
    ready_s = time.time() - t0
    bodies = prompts(int(info.get("vocab_size") or 1000))
    rs = asyncio.run(fetch_all(srv.url, bodies))
    vs_ref: dict[int, float] = {}
    vs_src: dict[int, float] = {}
    for b, r in zip(bodies, rs):
        if r.status_code != 200:
            raise RuntimeError(f"/hidden_states {r.status_code}: {r.text[:300]}")
        d = decode(r.content)
        ids = d.token_ids.tolist()
        if ids != b["input_ids"]:
            raise RuntimeError("the response's token ids differ from the request's")
        for target, ref_dir in ((vs_ref, c["ref"]), (vs_src, c["src"])):
            if target is vs_src and c["src"] == c["ref"]:
                break
            errs = per_layer_rel_err(d.hidden_states.cpu(), reference_states(str(ref_dir), ids, d.layer_ids))
            for lid, e in zip(d.layer_ids, errs):
                target[lid] = max(target.get(lid, 0.0), e)
    if c["src"] == c["ref"]:
        vs_src = vs_ref
    worst = max(vs_ref.values())
    tol = TOL[c["case"]]
    return {"ok": worst < tol, "tol": tol, "worst": worst,
            "reference": "unquantized bf16 source" if c["ref"] == c["src"] else "dequantized twin (fp32)",
            "vs_reference": {str(k): float(f"{v:.3e}") for k, v in sorted(vs_ref.items())},
            "vs_unquantized": {str(k): float(f"{v:.3e}") for k, v in sorted(vs_src.items())},
            "requests": len(bodies), "ready_after_s": round(ready_s), "vllm": info.get("vllm_version"),
            "serve_flags": c["flags"], "summary": c.get("summary")}


def layer_ids(name: str) -> str:
    """Every layer id; from 1 on DeepSeek, whose forward in vLLM has no residual before layer 1
    (hsx serve refuses id 0 there)."""
    first = 1 if name.startswith("deepseek") else 0
    return ",".join(map(str, range(first, NUM_LAYERS + 1)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="llama,deepseek_v3")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--eager", action="store_true", help="--enforce-eager (the default is vLLM's compiled path)")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds for all the engines to start")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}: {CASES}")
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, the servers will say more
        env["vllm"] = f"import failed: {exc}"
    print(json.dumps(env), flush=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-quant-check-"))
    t_start = time.time()
    record: dict[str, dict] = {}
    todo: list[dict] = []
    for family in families([f for f in a.families.split(",") if f]):
        try:
            todo += prepare(family, cases, work, record)
        except Exception as exc:
            record[f"{family}/*"] = {"ok": False, "error": f"make source: {type(exc).__name__}: {exc}",
                                     "trace": traceback.format_exc()[-3000:]}
            print(f"FAIL {family}: {exc}", flush=True)
    servers: dict[str, ServerProcess] = {}
    share = round(min(0.12, 0.8 / max(1, len(todo))), 3)
    for c in todo:
        try:
            servers[c["name"]] = ServerProcess(
                str(c["serve"]), "--dtype", "bfloat16", "--layers", layer_ids(c["name"]), "--max-model-len", "1024",
                "--max-num-batched-tokens", "256", *memory_flags(share), *c["flags"],
                log_dir=work, name=c["name"].replace("/", "-"), compiled=not a.eager,
                env=engine_env(VLLM_LOGGING_LEVEL="INFO", **CASE_ENV.get(c["case"], {})))
        except Exception as exc:
            record[c["name"]] = {"ok": False, "error": f"start: {type(exc).__name__}: {exc}"}
    deadline = time.monotonic() + a.start_timeout
    for c in todo:
        srv = servers.get(c["name"])
        if srv is None:
            continue
        try:
            record[c["name"]] = check_case(c, srv, deadline)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            record[c["name"]] = {"ok": False, "error": f"{type(exc).__name__}: {first[:500]}"}
        finally:
            srv.stop()
            record[c["name"]]["kernels"] = kernel_lines(srv.log_path)
            if not record[c["name"]]["ok"]:
                record[c["name"]]["causes"] = causes(srv.log_path)
        r = record[c["name"]]
        if r["ok"]:
            print(f"PASS {c['name']}: worst {r['worst']:.2e} (tol {r['tol']:g}) vs {r['reference']}; per layer "
                  f"{r['vs_reference']}; vs unquantized {r['vs_unquantized']}", flush=True)
        else:
            print(f"FAIL {c['name']}: {r.get('error') or r}", flush=True)
            for line in r.get("causes", []):
                print(f"    cause: {line}", flush=True)
        for line in r["kernels"]:
            print(f"    {line}", flush=True)
    failed = [n for n, r in record.items() if not r["ok"]]
    print("ALL PASS" if not failed else f"FAILED: {failed}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "argv": sys.argv[1:], "seconds": round(time.time() - t_start),
                                            "date": time.strftime("%Y-%m-%d"), "cases": record}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
