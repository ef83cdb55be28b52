"""Are hsx's states bit-equal to vLLM's own `extract_hidden_states` output? (issue 27, item 5)

The transformers reference differs from vLLM on a GPU by the kernels' arithmetic (fp32 1e-3,
bf16 1e-2). This check takes the kernels out: the same model, engine flags and prompts go
through (1) vLLM's own path, `vllm.LLM` with `extract_hidden_states` and the stock
`ExampleHiddenStatesConnector` writing safetensors files (what users run without hsx; `hsx
bench`'s mode b), and (2) `hsx serve` over HTTP. Prompts go one at a time through both, so
the batches (and the kernels' tiling) are the same; prefix caching is off in both. Any
difference, even one bit, is hsx's to explain.

    python tests/gpu/check_bitequal.py --model DIR [--model DIR ...] --dtype bfloat16 --json out.json

Each model runs in its own child process for (1) so its GPU memory is gone before (2) starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _server import ServerProcess, engine_env  # noqa: E402

from hsx.wire import decode  # noqa: E402

# The same engine settings on both paths: explicit batch limits (the offline LLM and the
# server pick different defaults), no prefix caching (vLLM's own path in hsx bench has none).
COMMON_FLAGS = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "16", "--no-enable-prefix-caching",
                "--gpu-memory-utilization", "0.3"]


def model_text_config(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def max_len(model: str) -> int:
    return min(2048, int(model_text_config(model).get("max_position_embeddings", 2048)))


EXTRA_FLAGS: list[str] = []  # --flag: more engine flags on both paths (e.g. --enforce-eager)


def flags_for(model: str, dtype: str) -> list[str]:
    return ["--dtype", dtype, "--max-model-len", str(max_len(model)), *COMMON_FLAGS, *EXTRA_FLAGS]


def prompts_for(model: str, seed: int = 7) -> list[list[int]]:
    rng, vocab, top = random.Random(seed), int(model_text_config(model).get("vocab_size", 512)), max_len(model) - 2
    return [[1] + [rng.randrange(6, vocab) for _ in range(min(n, top))] for n in (4, 37, 300, 1000, 1900)]


def vllm_own_path(model: str, dtype: str, layers: list[int], prompts: list[list[int]], out: Path) -> None:
    """Child process: vLLM's own extraction, one prompt at a time; the states to `out` (torch.save)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    from vllm.inputs import TokensPrompt

    from hsx_tools.bench.engines import engine_kwargs, with_vllm_file_path

    kw = engine_kwargs(model, flags_for(model, dtype))
    states_dir = tempfile.mkdtemp(prefix="hsx-bitequal-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with_vllm_file_path(kw, layers, states_dir)
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    got = []
    for p in prompts:
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        d = load_hidden_states(o.kv_transfer_params["hidden_states_path"])
        got.append({"hidden_states": d["hidden_states"].clone(), "token_ids": d["token_ids"].clone()})
    torch.save(got, out)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):  # os._exit below would leave the engine core orphaned
        core.shutdown()
    sys.stdout.flush()
    os._exit(0)  # the stock connector's writer threads can hold interpreter exit


def hsx_path(model: str, dtype: str, layers: list[int], prompts: list[list[int]], work: Path) -> list[dict]:
    srv = ServerProcess(model, "--layers", ",".join(map(str, layers)), *flags_for(model, dtype),
                        log_dir=work, name=Path(model).name, compiled=True, env=engine_env(VLLM_LOGGING_LEVEL="INFO"))
    try:
        srv.wait_ready(900)
        got = []
        with httpx.Client(timeout=300) as c:
            for p in prompts:
                r = c.post(srv.url + "/hidden_states", json={"input_ids": p})
                r.raise_for_status()
                d = decode(r.content)
                got.append({"hidden_states": torch.as_tensor(d.hidden_states), "token_ids": torch.as_tensor(d.token_ids)})
        return got
    finally:
        srv.stop()


def own_run(model: str, dtype: str, layers: list[int], out: Path) -> list[dict] | None:
    rc = subprocess.call([sys.executable, __file__, "--child", model, "--dtype", dtype, "--layers",
                          ",".join(map(str, layers)), "--out", str(out), *[f"--flag={f}" for f in EXTRA_FLAGS]],
                         env=engine_env(VLLM_LOGGING_LEVEL="INFO"))
    return torch.load(out) if rc == 0 and out.exists() else None


def diff_rows(prompts: list[list[int]], ref: list[dict], got: list[dict]) -> list[dict]:
    rows = []
    for p, a, b in zip(prompts, ref, got):
        ha, hb = a["hidden_states"], b["hidden_states"].to(a["hidden_states"].dtype)
        same_shape = tuple(ha.shape) == tuple(hb.shape)
        diff = (ha.float() - hb.float()).abs().max().item() if same_shape else float("nan")
        rows.append({"tokens": len(p), "shape_vllm": list(ha.shape), "shape_hsx": list(hb.shape),
                     "bit_equal": bool(same_shape and torch.equal(ha, hb)),
                     "token_ids_equal": a["token_ids"].tolist() == b["token_ids"].tolist(), "max_abs_diff": diff})
    return rows


def compare(model: str, dtype: str, work: Path, own_runs: int = 1) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    n = int(model_text_config(model)["num_hidden_layers"])
    layers = list(range(1, n + 1))  # every layer but 0 (DeepSeek's forward has no residual before layer 1)
    prompts = prompts_for(model)
    t0 = time.time()
    ref = own_run(model, dtype, layers, work / f"own-{Path(model).name}.pt")
    if ref is None:
        return {"model": model, "ok": False, "error": "vLLM's own path failed"}
    # vLLM's own path again in a fresh process: whether the kernels give the same bits from run
    # to run at all, the bar hsx can be held to.
    repeats = []
    for k in range(1, own_runs):
        again = own_run(model, dtype, layers, work / f"own-{Path(model).name}-{k}.pt")
        repeats.append(diff_rows(prompts, ref, again) if again is not None else [{"error": "own path failed"}])
    t1 = time.time()
    got = hsx_path(model, dtype, layers, prompts, work)
    rows = diff_rows(prompts, ref, got)
    ok = all(r["bit_equal"] and r["token_ids_equal"] for r in rows)
    res = {"model": model, "architecture": cfg.get("architectures"), "dtype": dtype, "layers": layers,
           "engine_flags": flags_for(model, dtype), "ok": ok,
           "own_path_s": round(t1 - t0), "hsx_path_s": round(time.time() - t1), "prompts": rows}
    if repeats:
        res["own_repeats"] = repeats
        for k, rep in enumerate(repeats, 1):
            print(f"own path run {k + 1} vs run 1: " + ", ".join(
                f"{r.get('tokens')} tok {'equal' if r.get('bit_equal') else 'max diff %.3g' % r.get('max_abs_diff', float('nan'))}"
                for r in rep), flush=True)
    print(("PASS" if ok else "FAIL") + f" {Path(model).name} {dtype}: " +
          ", ".join(f"{r['tokens']} tok {'equal' if r['bit_equal'] else 'max diff %.3g' % r['max_abs_diff']}"
                    for r in rows), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    p.add_argument("--own-runs", type=int, default=1,
                   help="run vLLM's own path this many times (fresh processes) and compare the runs with each other")
    p.add_argument("--flag", action="append", default=[], help="one more engine flag for both paths (repeatable)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--layers", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    EXTRA_FLAGS.extend(a.flag)
    if a.child:
        vllm_own_path(a.child, a.dtype, [int(x) for x in a.layers.split(",")], prompts_for(a.child), Path(a.out))
        return 0
    work = Path(tempfile.mkdtemp(prefix="hsx-bitequal-"))
    results = []
    for m in a.model:
        try:
            results.append(compare(m, a.dtype, work, a.own_runs))
        except Exception as exc:
            results.append({"model": m, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"FAIL {m}: {results[-1]['error']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                                            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                            "results": results}, indent=1))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
