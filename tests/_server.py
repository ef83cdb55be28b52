"""Real `hsx serve` subprocesses for the tests (hsx_tools.server_process), paths of the shared
fixtures, polling helpers, and the check that keeps the fast tier free of engines."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hsx_tools.server_process import MetricValues, free_port
from hsx_tools.server_process import ServerProcess as _ServerProcess

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
STORIES = FIXTURES / "models" / "stories260K"
CHAT = FIXTURES / "chat"
TEMPLATES = FIXTURES / "chat_templates"
POLL = 0.1  # seconds between polls: a tight loop would take a core from the server on a 2-core box


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def serve_command(*args: str) -> list[str]:
    """`hsx serve ARGS --port 0`: the command of a server expected to refuse ARGS at start."""
    return [sys.executable, "-m", "hsx_tools.cli", "serve", *args, "--port", "0"]


def serve_once(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`serve_command(ARGS)` run to its exit: for the settings it refuses at start-up."""
    return subprocess.run(serve_command(*args), capture_output=True, text=True, timeout=timeout, env=engine_env())


class EngineGuard:
    """Set by conftest.py: the test being set up or run, and the fixture being set up.
    Starting a server records the fixture that did it (its users must be marked
    `engine` too) and fails a test that is not marked `engine`."""

    test = None
    fixture: str | None = None
    engine_fixtures: set[str] = set()

    @classmethod
    def starting_a_server(cls) -> None:
        if cls.fixture is not None:
            cls.engine_fixtures.add(cls.fixture)
        if cls.test is not None and cls.test.get_closest_marker("engine") is None:
            raise RuntimeError(f"{cls.test.nodeid} starts `hsx serve` (a vLLM engine) but is not marked "
                               "@pytest.mark.engine: the fast tier (-m 'not engine and not slow') would start it")


@dataclass
class EngineStart:
    """One `hsx serve` started by the tests: the run's summary counts them (what CI time goes to)."""

    name: str
    by: str  # the fixture, else the test, that started it
    began: float = field(default_factory=time.monotonic)
    seconds: float | None = None  # until ready (or failed to be)

    def ready(self) -> None:
        if self.seconds is None:
            self.seconds = time.monotonic() - self.began


ENGINE_STARTS: list[EngineStart] = []


class ServerProcess(_ServerProcess):
    """`hsx serve` with the test environment and its log in `log_dir`.

    Eager (`--enforce-eager`) unless `compiled`: on the 2-core CI box torch.compile made
    every engine start ~3x slower (137 s against 47 s, measured 2026-12-01 under load),
    and the suite starts dozens. The production (compiled) path keeps its own servers:
    the correctness fixtures pass `compiled=True`."""

    def __init__(self, model: str, *args: str, log_dir: Path, env: dict[str, str] | None = None,
                 name: str = "hsx", compiled: bool = False) -> None:
        EngineGuard.starting_a_server()
        if not compiled and "--enforce-eager" not in args:
            args = (*args, "--enforce-eager")
        port = free_port()
        super().__init__(model, *args, log_path=log_dir / f"{name}-{port}.log", env=env or engine_env(), port=port)
        self.census = EngineStart(name, EngineGuard.fixture or getattr(EngineGuard.test, "nodeid", "?"))
        ENGINE_STARTS.append(self.census)

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        """Ten minutes: a CPU engine starts in ~25 s, but a 2-core box shared with other
        work was seen to take over five."""
        try:
            return super().wait_ready(timeout)
        finally:
            self.census.ready()


class Servers:
    """The servers of one configuration for a module. `shared()` is the one the tests
    reuse (started on first use, again if it died); `to_stop()` hands it to a test that
    stops it, so that such a test can run in any order: the tests after it get a fresh
    one."""

    def __init__(self, start: Callable[[], ServerProcess]) -> None:
        self._start = start
        self._current: ServerProcess | None = None
        self._all: list[ServerProcess] = []

    def shared(self) -> ServerProcess:
        if self._current is None or self._current.proc.poll() is not None:
            self._current = self._start()
            self._all.append(self._current)
        return self._current

    def to_stop(self) -> ServerProcess:
        server, self._current = self.shared(), None
        return server

    def stop_all(self) -> None:
        for s in self._all:
            s.stop()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `check` every POLL seconds until it holds; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(POLL)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """`wait_until` for async checks (the event loop keeps serving the test's requests)."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        await asyncio.sleep(POLL)


async def sigterm_once_all_admitted(client, server, prompts, headers: dict[str, str] | None = None):
    """The drain tests' run: POST every prompt, SIGTERM once the server has admitted them all
    (hsx_queued_tokens), wait for the drain to start, then ask /ready and try one more request.
    Returns (that /ready answer, that request's answer, the in-flight requests' answers).
    The engine core is frozen (SIGSTOP) until then, so none of them can finish first: seeing
    a transient state through /metrics polls misses on a loaded CI box (2026-12-02)."""
    with frozen(engine_core(server)):
        inflight = [asyncio.ensure_future(client.post(server.url + "/hidden_states", json={"input_ids": p},
                                                      headers=headers))
                    for p in prompts]

        async def all_admitted() -> bool:
            return (await metrics_async(client, server.url)).get("hsx_queued_tokens") == sum(map(len, prompts))

        async def draining() -> bool:
            return (await client.get(server.url + "/ready")).status_code == 503

        await eventually(all_admitted, 30, f"the {len(prompts)} requests admitted")
        server.signal(signal.SIGTERM)
        await eventually(draining, 10, "SIGTERM started the drain")  # as soon as the signal is handled
        ready = await client.get(server.url + "/ready")
        new = await client.post(server.url + "/hidden_states", json={"input_ids": [1, 2, 3]})
    return ready, new, await asyncio.gather(*inflight)


@contextmanager
def frozen(*procs: "psutil.Process") -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block, continued (SIGCONT) however it ends:
    with the engine frozen no step finishes, so a test can set up "requests in flight"
    with certainty instead of polling for a state a loaded box passes between two polls."""
    for p in procs:
        p.suspend()
    try:
        yield
    finally:
        for p in procs:
            p.resume()


def engine_core(server) -> "psutil.Process":
    """The vLLM engine core process of a one-engine `hsx serve` (to kill or freeze it)."""
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    core = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert len(core) == 1, f"one EngineCore process expected among {[(c.pid, c.name()) for c in children]}"
    return core[0]


async def engine_dead_or_gone(client, url: str, timeout: float) -> None:
    """Poll /health until it answers 503 (the engine died) or the server has exited."""
    import httpx

    async def dead_or_gone() -> bool:
        try:
            return (await client.get(url + "/health")).status_code == 503
        except httpx.HTTPError:
            return True  # already exited

    await eventually(dead_or_gone, timeout, "/health reported the dead engine")


async def metrics_async(client, url: str, headers: dict[str, str] | None = None) -> MetricValues:
    """/metrics through the test's own httpx.AsyncClient."""
    r = await client.get(url + "/metrics", headers=headers or {})
    r.raise_for_status()
    return MetricValues(r.text)
