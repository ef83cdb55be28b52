"""`--http-workers`: the engine process's side of its workers (service/http/http_workers.py) and the
server's life with them: drain on SIGTERM, workers that keep dying, `--shm-lease false`.

What a worker serves (bodies, relayed errors, hang-ups, a killed worker) is in
tests/service/http/test_http_workers.py.
"""

from __future__ import annotations

import random
import socket

import httpx
import psutil
import pytest

from _server import ServerProcess, metrics_async, sigterm_once_all_admitted
from conftest import need_vllm
from hsx.wire import LEASE_MEDIA_TYPE, decode
from hsx_service.http import http_workers
from hsx_service.settings import ServiceSettings


class _Exited:
    """A worker process that has exited (the Popen surface HttpWorkers reads)."""

    def __init__(self, code: int = 1) -> None:
        self.returncode = code
        self.stdin = None

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def _pool(monkeypatch, count: int = 2) -> tuple[http_workers.HttpWorkers, list[int]]:
    spawned: list[int] = []
    pool = http_workers.HttpWorkers(count, ServiceSettings(host="127.0.0.1", port=0))

    def spawn(index: int) -> None:
        spawned.append(index)
        pool.procs[index] = _Exited()
        pool.started_at[index] = http_workers.time.monotonic()

    monkeypatch.setattr(pool, "_spawn", spawn)
    return pool, spawned


def test_a_dead_worker_is_replaced_and_workers_that_keep_dying_stop_the_server(monkeypatch):
    pool, spawned = _pool(monkeypatch)
    try:
        pool.start()
        assert spawned == [0, 1]
        # Both died at once, quickly: replaced (two quick deaths so far) ...
        assert pool.check() is None
        assert spawned == [0, 1, 0, 1] and pool.restarts == 2
        # ... and the third quick death in a row is the reason to stop.
        reason = pool.check()
        assert reason is not None and "keep exiting at start" in reason
    finally:
        pool.stop(1)


def test_a_worker_dying_long_after_its_start_is_only_replaced(monkeypatch):
    pool, spawned = _pool(monkeypatch, count=1)
    try:
        pool.start()
        for _ in range(5):  # each one lived past QUICK_DEATH_S: never a reason to stop
            pool.started_at[0] -= http_workers.QUICK_DEATH_S + 1
            assert pool.check() is None
        assert pool.restarts == 5 and pool.quick_deaths == 0
    finally:
        pool.stop(1)


def test_the_port_is_bound_by_the_engine_process_and_a_busy_port_is_refused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(http_workers.StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            http_workers.HttpWorkers(2, ServiceSettings(host="127.0.0.1", port=port))


def _workers_of(server: ServerProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "hsx_service.http.http_worker" in " ".join(p.cmdline())]


@pytest.mark.engine
async def test_with_workers_sigterm_drains_every_body_then_stops_the_workers(tiny_model, log_dir):
    """In flight at SIGTERM: every body arrives whole through the workers, a new request
    gets 503 draining, the server exits 0 and no worker is left. With --shm-lease false
    the workers still take their leases, but a client is offered none."""
    need_vllm()
    server = ServerProcess(str(tiny_model), "--dtype", "float32", "--max-model-len", "1024",
                           "--max-num-batched-tokens", "16", "--shutdown-timeout", "60",
                           "--http-workers", "2", "--shm-lease", "false",
                           log_dir=log_dir, name="workers-drain").wait_ready()
    rng = random.Random(12)
    prompts = [[1] + [rng.randrange(6, 1000) for _ in range(600)] for _ in range(8)]
    try:
        workers = _workers_of(server)
        assert len(workers) == 2
        async with httpx.AsyncClient(timeout=120) as client:
            info = (await client.get(server.url + "/info")).json()
            assert info["shm_lease"] is None  # no lease for clients ...
            asked = await client.post(server.url + "/hidden_states", json={"input_ids": [1, 5, 6]},
                                      headers={"accept": LEASE_MEDIA_TYPE})
            assert asked.status_code == 200 and asked.headers["content-type"] != LEASE_MEDIA_TYPE
            assert decode(asked.content).token_ids.tolist() == [1, 5, 6]  # ... a body instead
            before = await metrics_async(client, server.url)
            assert before.get("hsx_leases_total", outcome="granted") >= 1  # the worker's own

            _, new, done = await sigterm_once_all_admitted(client, server, prompts,
                                                           headers={"accept-encoding": "identity"})
        assert new.status_code == 503 and new.json()["error"]["type"] == "draining"
        assert [r.status_code for r in done] == [200] * 8
        assert [decode(r.content).token_ids.tolist() for r in done] == prompts
        assert server.proc.wait(60) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {[p.pid for p in alive]}"
    finally:
        server.stop()
