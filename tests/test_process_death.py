"""Every process hsx starts dies with the one that started it (issue 25).

- `hsx serve` SIGKILLed (an OOM killer, a supervisor's hard kill): the vLLM engine core and
  its workers, the tokenizer processes and the HTTP workers go with it (hsx/lifeline.py);
- a tool that runs `hsx serve` itself (hsx bench, hsx demo: hsx/server_process.py) takes
  its server down when it is stopped (SIGTERM forwarded) or killed (the lifeline);
- SIGTERM with requests in flight: the server is gone within --shutdown-timeout plus
  lifecycle.STOP_MARGIN, even with an engine that no longer answers;
- a port in use is refused (exit 2, one line) before any engine starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import pytest

from _server import ServerProcess, engine_core, engine_env, eventually, frozen, metrics_async, wait_until
from conftest import need_vllm

GONE_WITHIN = 10.0  # seconds for every descendant to go after its server was killed


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has ended: only its exit status waits for a reaper)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


# ------------------------------------------------------------------------------ SIGKILL of hsx serve

@pytest.mark.engine
async def test_sigkill_of_serve_takes_every_descendant(tiny_model, log_dir):
    """The engine core, the tokenizer processes and the HTTP workers were left running
    with parent 1 after `kill -9` of `hsx serve` (for minutes, holding memory / the GPU)."""
    need_vllm()
    server = ServerProcess(str(tiny_model), "--dtype", "float32", "--max-model-len", "256",
                           "--http-workers", "2", "--tokenize-workers", "2",
                           log_dir=log_dir, name="sigkill").wait_ready()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(server.url + "/hidden_states", json={"prompt": "hello"})  # tokenizer processes busy
            assert r.status_code == 200, r.text
        descendants = psutil.Process(server.proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) + " " + p.name() for p in descendants)
        assert "EngineCore" in names and names.count("hsx_service.front") == 2, _describe(descendants)
        assert len(descendants) >= 5, _describe(descendants)  # engine core, 2 workers, tokenizer pool
        server.proc.kill()
        server.proc.wait(10)
        deadline = time.monotonic() + GONE_WITHIN
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(descendants)
        assert not left, f"{len(left)} of {len(descendants)} left running: {_describe(left)}"
    finally:
        for p in _alive(psutil.Process(server.proc.pid).children(recursive=True) if server.proc.poll() is None else []):
            p.kill()
        server.stop()


# ------------------------------------------------------------------------------ a tool that owns a server

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hsx.server_process import ServerProcess

    server = ServerProcess(sys.argv[1], log_path=Path(sys.argv[2]))  # as hsx bench and hsx demo start theirs
    print(server.proc.pid, flush=True)
    try:
        time.sleep(600)
    finally:
        server.stop(30)
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_tool_stopped_or_killed_takes_its_server_with_it(sig, tiny_model, tmp_path):
    """`hsx bench` SIGTERMed left its `hsx serve` running with parent 1. Killed while the
    server is still starting (so no engine is needed): the server goes too."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tiny_model), str(tmp_path / "serve.log")],
                             stdout=subprocess.PIPE, text=True, env=engine_env())
    server = None
    try:
        server = psutil.Process(int(owner.stdout.readline()))
        time.sleep(1.0)  # the server's interpreter is up (it imports vLLM for many seconds more)
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        owner.send_signal(sig)
        code = owner.wait(30)
        wait_until(lambda: not _alive([server]), GONE_WITHIN, f"the server gone after {sig.name} of its owner")
        assert code == (128 + sig if sig == signal.SIGTERM else -sig), code  # SIGTERM: exited through its finally
    finally:
        owner.kill()
        if server is not None and _alive([server]):
            os.killpg(server.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ a busy port

def test_a_port_in_use_is_refused_in_seconds_before_any_engine(tmp_path):
    """uvicorn found the port taken only after the engine had started, and the server
    exited 37 s later with status 3 and a FileNotFoundError. Now: exit 2, one line
    naming the port, before vLLM is even imported (so the model is never looked at)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "hsx.cli", "serve", str(tmp_path / "model"),
                            "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, env=engine_env())
        took = time.monotonic() - t0
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines
    assert took < 15, took  # an interpreter and hsx's settings; vLLM alone takes longer to import
