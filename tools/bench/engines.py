"""Modes (a) plain prefill and (b) vLLM's file connector, each in a child process
(`python -m hsx_tools.bench --worker CONFIG`) so its engine and accelerator memory are gone
before the next mode starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hsx.sizes import fmt_bytes
from hsx_tools.bench.common import child_env, log, make_prompts, versions
from hsx_tools.bench.memory import TreeSampler
from hsx_tools.server_process import own, stop_process_group


def engine_kwargs(model: str, flags: list[str]) -> dict[str, Any]:
    """vLLM's own parser turns the engine flags into `LLM(**kwargs)` (only those that
    differ from the defaults), so the same strings drive `hsx serve` and `vllm.LLM`."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from hsx_service.engine.vllm_compat import flexible_parser

    parser = EngineArgs.add_cli_args(flexible_parser()())
    base = vars(parser.parse_args(["--model", model]))
    given = vars(parser.parse_args(["--model", model, *flags]))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in given.items() if k in fields and base.get(k) != v}
    kw["model"] = model
    kw["enable_prefix_caching"] = False
    return kw


def with_vllm_file_path(kw: dict[str, Any], layers: list[int], states_dir: str) -> dict[str, Any]:
    """`kw` for vLLM's own path: `extract_hidden_states` and its stock file connector writing
    one safetensors file per request into `states_dir` (on CPU, where that connector needs
    CUDA, hsx bench's synchronous twin of it). Mode (b), check_bitequal.py and the draft-quality
    reference all run this one configuration."""
    from vllm.platforms import current_platform

    kw["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": states_dir},
    }
    if current_platform.is_cpu():
        kv["kv_connector"] = "CpuHiddenStatesConnector"
        kv["kv_connector_module_path"] = "hsx_tools.bench_cpu_connector"
    kw["kv_transfer_config"] = kv
    return kw


def worker_main(config_path: str) -> int:
    """Child process of modes (a) and (b); writes its figures to config['result']."""
    cfg = json.loads(Path(config_path).read_text())
    mode, layers = cfg["mode"], cfg["layers"]
    prompts = make_prompts(cfg["prompts"], cfg["prompt_len"], cfg["vocab"], cfg["seed"])
    warm = make_prompts(cfg["warmup"], cfg["prompt_len"], cfg["vocab"], cfg["seed"] + 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_kwargs(cfg["model"], cfg["engine_flags"])
    states_dir = None
    on_cpu = False
    if mode == "b":
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
        states_dir = cfg["states_dir"]
        with_vllm_file_path(kw, layers, states_dir)
    log(f"({mode}) starting vLLM: {json.dumps({k: v for k, v in kw.items()}, default=str)}")
    t = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t
    log(f"({mode}) engine up in {start_s:.1f}s")
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def read_back(outs: list[Any], check: bool) -> tuple[int, int]:
        return _read_back(outs, check, layers, cfg["hidden"])

    def gen(ps: list[list[int]]) -> list[Any]:
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)

    t = time.monotonic()
    outs = gen(warm)
    if mode == "b":
        read_back(outs, check=True)
    log(f"({mode}) warm-up: {len(warm)} prompts in {time.monotonic() - t:.1f}s")
    log(f"({mode}) measuring {len(prompts)} prompts x {cfg['prompt_len']} tokens ...")
    t0 = time.monotonic()
    outs = gen(prompts)
    t1 = time.monotonic()
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    result: dict[str, Any] = {"mode": mode, "engine_start_s": start_s, "tokens": tokens, "requests": len(outs),
                              "engine_s": t1 - t0, "versions": versions(), "engine_kwargs": {k: str(v) for k, v in kw.items()}}
    if mode == "b":
        log(f"({mode}) engine done in {t1 - t0:.2f}s; reading {len(outs)} files back ...")
        nbytes, file_bytes = read_back(outs, check=True)
        t2 = time.monotonic()
        result.update(
            measured_s=t2 - t0, readback_s=t2 - t1, hs_bytes=nbytes, file_bytes=file_bytes,
            engine_tokens_per_s=tokens / (t1 - t0), states_dir=states_dir,
            connector="hsx_tools.bench_cpu_connector.CpuHiddenStatesConnector (stock + synchronous copy)" if on_cpu
            else "ExampleHiddenStatesConnector",
        )
    else:
        result.update(measured_s=t1 - t0)
    result["tokens_per_s"] = tokens / result["measured_s"]
    Path(cfg["result"]).write_text(json.dumps(result))
    log(f"({mode}) {result['tokens_per_s']:,.0f} tokens/s; shutting down")
    _shutdown(llm)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the stock connector's writer threads can hold interpreter exit for minutes


def _read_back(outs: list[Any], check: bool, layers: list[int], hidden: int) -> tuple[int, int]:
    """Mode (b): each request's file read back (and checked), then removed; (state bytes, file bytes)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    nbytes = files = 0
    for o in outs:
        path = (o.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"request {o.request_id} returned no hidden_states_path")
        d = load_hidden_states(path)
        hs = d["hidden_states"]
        nbytes += hs.numel() * hs.element_size()
        files += os.path.getsize(path)
        if check:
            t_ = len(o.prompt_token_ids)
            if tuple(hs.shape) != (t_, len(layers), hidden):
                raise RuntimeError(f"{path}: hidden_states {tuple(hs.shape)}, expected {(t_, len(layers), hidden)}")
            if d["token_ids"].tolist() != list(o.prompt_token_ids):
                raise RuntimeError(f"{path}: token_ids differ from the prompt")
        cleanup_hidden_states(path)
    return nbytes, files


def _shutdown(llm: Any) -> None:
    try:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:
        pass


def run_engine_mode(mode: str, ctx: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    cfg = dict(ctx, mode=mode, result=str(workdir / f"result-{mode}.json"))
    if mode == "b":
        need = ctx["hs_bytes_total"] * 1.15 + (256 << 20)
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else workdir
        if base != shm:
            log(f"(b) /dev/shm lacks {fmt_bytes(need)} free: the states files go to {workdir}")
        cfg["states_dir"] = tempfile.mkdtemp(prefix="hsx-bench-b-", dir=str(base))
    cfg_path = workdir / f"worker-{mode}.json"
    cfg_path.write_text(json.dumps(cfg))
    Path(cfg["result"]).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "hsx_tools.bench", "--worker", str(cfg_path)], env=child_env(),
                            start_new_session=True)
    own(proc)
    sampler = TreeSampler(proc.pid).start()
    deadline, rc, got = time.monotonic() + timeout, None, None
    try:
        while rc is None and time.monotonic() < deadline:
            try:
                rc = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                if got is None and Path(cfg["result"]).exists():
                    got = time.monotonic()
                if got is not None and time.monotonic() - got > 20:  # figures are in; do not wait on teardown
                    log(f"({mode}) engine teardown slow; stopping it")
                    break
        if rc is None and got is None:
            log(f"({mode}) timed out after {timeout:.0f}s")
    finally:
        mem = sampler.stop()
        stop_process_group(proc, 5)
        if cfg.get("states_dir"):
            shutil.rmtree(cfg["states_dir"], ignore_errors=True)
    if not Path(cfg["result"]).exists():
        raise RuntimeError(f"mode ({mode}) failed (exit {rc}); see the lines above")
    res = json.loads(Path(cfg["result"]).read_text())
    res["engine_memory"] = mem
    return res

