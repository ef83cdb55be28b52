"""What the attack-36 scripts share: the fixtures, `hsx` as users run it (a subprocess of the
CLI), and one `hsx serve` at a time, stopped however the script ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"
STORIES = FIXTURES / "models" / "stories260K"
TEMPLATES = FIXTURES / "chat_templates"
CHAT = FIXTURES / "chat"
LOGS = Path(os.environ.get("ATTACK36_LOGS", "/tmp/attack36-logs"))


def env(**extra: str) -> dict[str, str]:
    """The shell a user runs hsx in, with a 1 GiB KV cache: the box is shared with others."""
    e = dict(os.environ)
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    e.update(extra)
    return e


def hsx(*args: str, timeout: float = 900, check: bool = False, **extra_env: str) -> subprocess.CompletedProcess:
    """`hsx ARGS`, its output captured (the scripts record what a user would read)."""
    return subprocess.run([sys.executable, "-m", "hsx_tools.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, check=check, env=env(**extra_env))


def serve(*args: str, name: str, model: Path | str = STORIES):
    """`hsx serve MODEL ARGS` on a free loopback port, ready. Eager: on this box a compiled
    start takes minutes, and no item measures the model's speed."""
    from hsx_tools.server_process import ServerProcess

    LOGS.mkdir(parents=True, exist_ok=True)
    if "--enforce-eager" not in args:
        args = (*args, "--enforce-eager")
    server = ServerProcess(str(model), *args, log_path=LOGS / f"{name}.log", env=env())
    return server.wait_ready(600)


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)
