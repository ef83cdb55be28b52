"""Every process hsx starts dies with the one that started it (issue 25).

- `hsx serve` SIGKILLed (an OOM killer, a supervisor's hard kill): the vLLM engine core and
  its workers, the tokenizer processes and the HTTP workers go with it (hsx/lifeline.py);
- a tool that runs `hsx serve` itself (hsx bench, hsx demo: tools/server_process.py) takes
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

from _server import ServerProcess, engine_core, engine_env, eventually, metrics_async, wait_until
from conftest import need_vllm

GONE_WITHIN = 10.0  # seconds for every descendant to go after its server was killed
ENGINE_GONE_WITHIN = 2.0  # seconds for vLLM's engine core and workers to go, computing or not


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


# ------------------------------------------------------------------------------ the lifeline itself

LIFELINE_OWNER = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys, time
    from hsx import lifeline

    def forked_then_fork_again(queue):  # as vLLM's engine core starts its worker
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(120)
            os._exit(0)
        queue.put(grandchild)
        time.sleep(120)

    if __name__ == "__main__":
        lifeline.mark_owner()
        queue = multiprocessing.get_context("fork").SimpleQueue()
        forked = multiprocessing.get_context("fork").Process(target=forked_then_fork_again, args=(queue,))
        forked.start()
        execed = subprocess.Popen([sys.executable, "-c",  # as the HTTP workers start
                                   "from hsx import lifeline; lifeline.hold(); import time; time.sleep(120)"],
                                  start_new_session=True)
        print(forked.pid, queue.get(), execed.pid, flush=True)
        time.sleep(120)
""")


def test_a_lifeline_takes_forked_grandchildren_and_execed_children(tmp_path):
    """Without vLLM: a forked child, its own forked child (it watches the owner, not its
    parent) and an exec'd child that holds the lifeline all go when the owner is SIGKILLed."""
    script = tmp_path / "owner.py"
    script.write_text(LIFELINE_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        children = [psutil.Process(int(pid)) for pid in owner.stdout.readline().split()]
        assert len(children) == 3
        time.sleep(0.5)  # the exec'd one is past its import of hsx
        owner.kill()
        owner.wait(10)
        wait_until(lambda: not _alive(children), 5, f"{_describe(_alive(children))} gone with their owner")
    finally:
        for p in _alive(children):
            p.kill()


GIL_HOLDING_OWNER = textwrap.dedent("""
    import multiprocessing, os, re, sys, threading, time
    from hsx import lifeline

    def computes_holding_the_gil():  # as vLLM's worker in a long C call: no thread of it runs Python
        re.match(r"(a|aa)+$", "a" * 64 + "b")  # exponential, never returns
        os._exit(0)

    def engine_core(queue):  # forks its worker from its main thread, then waits on sockets
        worker = multiprocessing.get_context("fork").Process(target=computes_holding_the_gil)
        worker.start()
        queue.put(worker.pid)
        time.sleep(120)

    if __name__ == "__main__":
        lifeline.mark_owner()
        queue = multiprocessing.get_context("fork").SimpleQueue()
        core = multiprocessing.get_context("fork").Process(target=engine_core, args=(queue,))
        # as hsx serve starts vLLM: from a worker thread, which rules out the kernel's signal for it
        starter = threading.Thread(target=core.start)
        starter.start()
        starter.join()
        print(core.pid, queue.get(), flush=True)
        time.sleep(120)
""")


def test_a_child_computing_with_the_gil_held_dies_with_its_owner_within_2_s(tmp_path):
    """Issue 36.6: after `kill -9` of hsx serve, vLLM's worker computed for 10-15 s more
    (its lifeline watcher is a Python thread, which cannot run while a C call holds the
    GIL). A worker forked from the engine core's main thread now has the kernel's
    parent-death signal: it goes the moment the engine core does."""
    script = tmp_path / "owner.py"
    script.write_text(GIL_HOLDING_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        children = [psutil.Process(int(pid)) for pid in owner.stdout.readline().split()]
        worker = children[1]
        wait_until(lambda: worker.cpu_times().user > 0.3, 10, "the worker computing")
        owner.kill()
        owner.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: not _alive(children), 10, f"{_describe(_alive(children))} gone with their owner")
        assert time.monotonic() - t0 < 2.0, f"gone {time.monotonic() - t0:.1f} s after the owner"
    finally:
        for p in _alive(children):
            p.kill()


SPAWNED_FROM_HSX = {  # how multiprocessing's spawn imports the parent's main module in a child
    "python -m hsx_tools.cli": "runpy.run_module('hsx_tools.cli', run_name='__mp_main__', alter_sys=True)",
    "the hsx console script": "runpy.run_path(sys.argv[1], run_name='__mp_main__')",
}


@pytest.mark.parametrize("main", SPAWNED_FROM_HSX)
def test_a_process_spawned_from_hsx_dies_with_its_owner(main, tmp_path):
    """vLLM's data-parallel coordinator is spawned from `hsx serve` and loads no vLLM plugin:
    it outlived a SIGKILLed server. A spawned child imports the parent's main module
    (tools/cli.py), which holds the lifeline there."""
    script = tmp_path / "hsx"
    script.write_text("import sys\nfrom hsx_tools.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    from hsx import lifeline

    env = {**os.environ, lifeline.ENV: lifeline.token(owner.pid)}
    child = subprocess.Popen([sys.executable, "-c", f"import runpy, sys, time; {SPAWNED_FROM_HSX[main]}; "
                              "print('in', flush=True); time.sleep(120)", str(script)],
                             env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in"
        owner.kill()
        owner.wait(10)
        assert child.wait(5) == -signal.SIGKILL
    finally:
        for p in (owner, child):
            p.kill()


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
            assert "EngineCore" in names and names.count("hsx_service.http.http_worker") == 2, _describe(descendants)
            assert len(descendants) >= 5, _describe(descendants)  # engine core, 2 workers, tokenizer pool
            engine = [p for p in descendants if "VLLM" in p.name() or "EngineCore" in p.name()]
            # killed while the engine computes (issue 36.6: its worker went on for 10-15 s)
            busy = [asyncio.ensure_future(client.post(server.url + "/hidden_states",
                                                      json={"input_ids": [1] + [7 + i] * 250}))
                    for i in range(8)]
            await asyncio.sleep(0.5)
            server.proc.kill()
            t0 = time.monotonic()
            await asyncio.gather(*busy, return_exceptions=True)
        server.proc.wait(10)
        while _alive(engine) and time.monotonic() - t0 < ENGINE_GONE_WITHIN:
            time.sleep(0.05)
        left = _alive(engine)
        assert not left, f"engine processes running {ENGINE_GONE_WITHIN:.0f} s after the kill: {_describe(left)}"
        deadline = t0 + GONE_WITHIN
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(descendants)
        assert not left, f"{len(left)} of {len(descendants)} left running: {_describe(left)}"
    finally:
        for p in _alive(psutil.Process(server.proc.pid).children(recursive=True) if server.proc.poll() is None else []):
            p.kill()
        server.stop()


# ------------------------------------------------------------------------------ SIGTERM: a bounded stop

@pytest.mark.engine
async def test_sigterm_with_a_wedged_engine_is_gone_within_timeout_plus_margin(tiny_model, log_dir):
    """SIGTERM with requests in flight took 39 s at --shutdown-timeout 30 (the teardown
    after the drain had no bound). Here the engine core is frozen from before the
    requests to the end (an engine that no longer answers, the worst case): the requests
    are cut off at the timeout, the teardown cannot finish, and the process must still be
    gone within --shutdown-timeout + STOP_MARGIN, leaving no process behind."""
    from hsx_service.lifecycle import STOP_MARGIN

    need_vllm()
    timeout = 2  # an int: vLLM 0.32 defines --shutdown-timeout itself, as an int
    server = ServerProcess(str(tiny_model), "--dtype", "float32", "--max-model-len", "1024",
                           "--shutdown-timeout", str(timeout), log_dir=log_dir, name="stop-budget").wait_ready()
    prompts = [[1] + [7 + i] * 300 for i in range(4)]
    core = engine_core(server)
    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            core.suspend()
            inflight = [asyncio.ensure_future(client.post(server.url + "/hidden_states", json={"input_ids": p}))
                        for p in prompts]

            async def all_admitted() -> bool:
                return (await metrics_async(client, server.url)).get("hsx_queued_tokens") == sum(map(len, prompts))

            await eventually(all_admitted, 30, "the requests admitted")
            t0 = time.monotonic()
            server.signal(signal.SIGTERM)
            code = await asyncio.to_thread(server.proc.wait, timeout + STOP_MARGIN + 60)
            took = time.monotonic() - t0
            answers = await asyncio.gather(*inflight, return_exceptions=True)
        assert took <= timeout + STOP_MARGIN, f"gone {took:.1f} s after SIGTERM (limit {timeout + STOP_MARGIN:.0f})"
        assert code == 0, code
        assert all(isinstance(a, httpx.HTTPError) or a.status_code == 503 for a in answers), answers
        wait_until(lambda: not _alive(descendants), 5, "every process of the server gone")
    finally:
        try:
            core.resume()
        except psutil.NoSuchProcess:
            pass
        server.stop()


FOREVER_TEARDOWN = textwrap.dedent("""
    import subprocess, sys, time, types
    from hsx_service import lifecycle

    lifecycle.STOP_MARGIN, lifecycle.FORCE_RESERVE = 1.0, 0.5
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands for vLLM's
    state = types.SimpleNamespace(settings=types.SimpleNamespace(shutdown_timeout=0.5))
    lifecycle.Lifecycle(state).arm_stop_deadline()  # as the stop signal does
    print(engine.pid, flush=True)
    time.sleep(120)  # a teardown that never ends
""")


@pytest.mark.slow  # imports the server (fastapi, uvicorn) in a child: ~3 s
def test_a_teardown_that_never_ends_is_cut_short_at_the_stop_margin():
    """The deadline's own path (the engine test above stops within it by itself): at
    --shutdown-timeout + STOP_MARGIN the process exits with its code, its children killed."""
    proc = subprocess.Popen([sys.executable, "-c", FOREVER_TEARDOWN], stdout=subprocess.PIPE, text=True)
    try:
        engine = psutil.Process(int(proc.stdout.readline()))
        t0 = time.monotonic()
        code = proc.wait(60)
        took = time.monotonic() - t0
        assert code == 0 and took < 0.5 + 1.0 + 1.0, (code, took)
        wait_until(lambda: not _alive([engine]), 5, "the engine's stand-in killed")
    finally:
        proc.kill()


# ------------------------------------------------------------------------------ a tool that owns a server

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hsx_tools.server_process import ServerProcess

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
        # The model directory does not exist: a refusal that names the port, not the model,
        # came before anything looked at the model (no timing: the box's load decides that).
        r = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "serve", str(tmp_path / "model"),
                            "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, env=engine_env())
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines
