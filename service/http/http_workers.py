"""The HTTP workers of the engine process (`--http-workers`): start, watch, stop.

The engine process binds the public port itself (so a port in use is refused at start,
exit 2: Listener) and hands the listening socket to each worker (http_worker.py), which serve it side
by side; it listens only on a Unix socket in a private directory for them. A worker
that dies is replaced (its worker leases end with its arena session); workers that
keep dying right after their start stop the server (exit 1: the orchestrator sees it).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from hsx.host import usable_cores
from hsx_service.body.compress import default_threads
from hsx_service.core.errors import StartupError
from hsx_service.settings import ServiceSettings

log = logging.getLogger("hsx.http_workers")

MAX_AUTO = 8
QUICK_DEATH_S = 10.0  # a worker that exits this soon after its start counts towards giving up
QUICK_DEATHS = 3


def resolve_count(setting: int | None, cpu_backend: bool, cores: int | None = None) -> int:
    """--http-workers, or its default: none on vLLM's CPU backend (the engine computes on
    the same cores), else a quarter of the cores, 2 to 8 (measured on an H200 host with 16
    cores: bench/README.md)."""
    if setting is not None:
        return setting
    if cpu_backend:
        return 0
    cores = cores or usable_cores()
    return max(2, min(MAX_AUTO, cores // 4))


def bind_public(host: str, port: int) -> socket.socket:
    """The public listening socket, inheritable by the workers. Raises StartupError."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


class Listener:
    """The public port, bound as `hsx serve` starts (service/cli.py: before vLLM is even
    imported), so a port in use is refused in a second with exit 2, not after the
    engine's start; the server then serves this very socket."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock = bind_public(host, port)

    def socket_for(self, host: str, port: int) -> socket.socket:
        """The socket for the address the settings name (bound again should they differ)."""
        if (host, port) != (self.host, self.port):
            self.sock.close()
            self.host, self.port, self.sock = host, port, bind_public(host, port)
        return self.sock


class HttpWorkers:
    def __init__(self, count: int, settings: ServiceSettings, sock: socket.socket | None = None) -> None:
        self.count = count
        self.settings = settings
        self.token = secrets.token_urlsafe(32)  # the workers' key on the engine process (app.py)
        self.sock = sock if sock is not None else bind_public(settings.host, settings.port)
        self.dir = tempfile.mkdtemp(prefix="hsx-engine-")  # 0700: only this user reaches the socket
        self.upstream = os.path.join(self.dir, "engine.sock")
        # The compression threads of the whole server, shared out (--compress-threads is per worker).
        self.threads = settings.compress_threads or max(1, default_threads() // count)
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.started_at = [0.0] * count
        self.restarts = 0
        self.quick_deaths = 0
        self.stopping = False

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def alive(self) -> int:
        return sum(1 for p in self.procs if p is not None and p.poll() is None)

    def _spawn(self, index: int) -> None:
        config = {"fd": self.sock.fileno(), "upstream": self.upstream, "token": self.token, "index": index,
                  "threads": self.threads, "settings": self.settings.model_dump(mode="json")}
        env = {**os.environ, "HSX_HTTP_WORKER": json.dumps(config)}
        self.procs[index] = subprocess.Popen([sys.executable, "-m", "hsx_service.http.http_worker"], stdin=subprocess.PIPE,
                                             pass_fds=(self.sock.fileno(),), env=env)
        self.started_at[index] = time.monotonic()

    def start(self) -> None:
        for i in range(self.count):
            self._spawn(i)
        log.info("%d HTTP workers on %s:%d (%d compression threads each); the engine process on unix:%s",
                 self.count, self.settings.host, self.port, self.threads, self.upstream)

    def check(self) -> str | None:
        """Replace dead workers; returns a reason to stop the server when they keep dying."""
        if self.stopping:
            return None
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            quick = time.monotonic() - self.started_at[i] < QUICK_DEATH_S
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            if self.quick_deaths >= QUICK_DEATHS:
                return f"HTTP workers keep exiting at start (last: worker {i}, status {proc.returncode}); see the log above"
            log.warning("HTTP worker %d exited with status %s; starting another", i, proc.returncode)
            self.restarts += 1
            self._spawn(i)
        return None

    def stop(self, timeout: float) -> None:
        """Close each worker's standard input (it stops serving, finishes what it sends),
        wait up to `timeout` s, then kill what is left."""
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("HTTP worker %d did not stop in time; killed", proc.pid)
                proc.kill()
                proc.wait(5)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)
