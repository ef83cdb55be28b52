"""Start a real `hsx serve` subprocess on a free port and wait until it is ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
STORIES = FIXTURES / "models" / "stories260K"
CHAT = FIXTURES / "chat"
TEMPLATES = FIXTURES / "chat_templates"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def metric(server: "ServerProcess", name: str, auth: dict[str, str] | None = None) -> float:
    """One sample of the server's /metrics, e.g. metric(s, "hsx_arena_used_bytes")."""
    text = httpx.get(server.url + "/metrics", headers=auth or {}).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


class ServerProcess:
    def __init__(self, model: str, *args: str, log_dir: Path, env: dict[str, str] | None = None, name: str = "hsx"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        cmd = [sys.executable, "-m", "hsx.cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.cmd = cmd
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env or engine_env(),
                                     start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hsx serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"hsx serve not ready after {timeout}s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # vLLM's engine processes live in the server's session: make sure none is left.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode


async def wait_health_dead(server: ServerProcess, timeout: float) -> int | None:
    """Poll /health until it answers 503 (returned) or the server is gone (None)."""
    import asyncio

    deadline = time.monotonic() + timeout
    health = None
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                health = (await client.get(server.url + "/health")).status_code
            except httpx.HTTPError:
                return None  # already exited
            if health == 503:
                return health
            await asyncio.sleep(0.1)
    return health
