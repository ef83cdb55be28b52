"""The server's life, in one place: start, engine watchdog, SIGTERM drain, exit codes.

    serve(settings, engine_args, listener)
      0. the public port is bound first (service/cli.py binds it before vLLM is even
         imported): a port in use is refused with exit 2 in about a second; from here on
         every process this one starts dies with it (hsx/lifeline.py), even on SIGKILL;
      1. PrefillEngine.prepare(): arena, notice channel, vLLM config; every check that can
         refuse runs here, before the port is served (exit 2 with the reason);
      2. uvicorn serves the app at once (/health 200, /ready 503 "loading") while the
         lifespan starts vLLM in the background, loads the tokenizer and the final norm,
         runs the one-request self-test and opens the arena socket; then /ready is 200;
      3. the watchdog checks the engine every 0.5 s; a dead engine fails every request in
         flight and stops the server with exit 1 (so the orchestrator restarts it), as a
         failed start does;
      4. SIGTERM / SIGINT: the drain. /ready and new requests answer 503 at once; requests
         in flight (tokenizing, queued or prefilling) and live leases get up to
         --shutdown-timeout; what is still in flight then ends at once: requests and
         generations are answered 503 (cut_off), chunked lease streams end with a 503
         record and leases end (HiddenStatesService.cut_off: a client that stopped
         reading or releasing held the drain 5 s past the timeout);
         then the server stops and exits 0, the tokenizer processes and the engine with
         it. The process is gone within --shutdown-timeout + STOP_MARGIN seconds of the
         signal: a teardown still running then (an engine that no longer answers) is cut
         short, the engine's processes killed. A second SIGINT stops at once.
      5. the lifespan's end: the arena socket closes, live leases end, vLLM shuts down and
         the arena goes.

Exit codes: 0 drained or stopped, 1 the engine died or failed to start, 2 refused at start.
(vLLM keeps `serve_http` and its watchdog together for the same reason: one owner.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import uvicorn
from fastapi import FastAPI

from hsx.exit_codes import ExitCode
from hsx import lifeline
from hsx_service.http.app import create_app
from hsx_service.http.state import AppState
from hsx_service.http.connections import protocol_for
from hsx_service.engine.prefill import PrefillEngine
from hsx_service.engine import vllm_compat
from hsx_service.core.errors import StartupError
from hsx_service.http.http_workers import HttpWorkers, Listener, resolve_count
from hsx_service.engine.lease import ArenaSocket
from hsx_service.core.metrics import sample_loop_lag
from hsx_service.engine.norm import load_final_norm
from hsx_service.http.routes_generation import Generator
from hsx_service.serving import HiddenStatesService
from hsx_service.settings import ServiceSettings
from hsx_service.tokenize_pool import TokenizerPool

log = logging.getLogger("hsx")

WATCH_INTERVAL = 0.5
DRAIN_POLL = 0.05
CUT_OFF_GRACE = 2.0  # after --shutdown-timeout: seconds for the cut-off requests' 503s and open bodies
# The process is gone this many seconds after --shutdown-timeout, at the latest (the
# manifests' grace periods cover the sum: tests/tools/test_stop_budget.py).
STOP_MARGIN = 10.0
FORCE_RESERVE = 1.5  # of STOP_MARGIN: for killing the engine's processes and exiting


def serve(settings: ServiceSettings, engine_args: Any, listener: Listener | None = None) -> int:
    """`hsx serve` after parsing: returns the exit code of a refusal at start; once it
    has served, the process exits here. `listener`: the public port, bound before
    parsing (service/cli.py); bound here otherwise."""
    lifeline.mark_owner()  # every process started from here on dies with this one
    try:  # first: a port in use is refused before any arena or engine exists
        sock = (listener.socket_for(settings.host, settings.port) if listener is not None
                else Listener(settings.host, settings.port).sock)
    except StartupError as exc:
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    prefill = PrefillEngine(settings, engine_args)
    try:
        prefill.prepare()
    except StartupError as exc:
        prefill.shutdown()
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    state = AppState(settings=settings, prefill=prefill)
    try:
        count = resolve_count(settings.http_workers, vllm_compat.is_cpu_backend())
        workers = HttpWorkers(count, settings, sock) if count else None
    except StartupError as exc:
        prefill.shutdown()
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    if workers is not None:
        state.http_workers = count
        state.worker_token = workers.token
        state.metrics.http_workers.set_function(lambda: workers.alive)
    code = Lifecycle(state, workers, sock).run()
    if state.startup_error:  # the cause as the last line, not a hundred lines above
        print(f"hsx serve: error: {state.startup_error}", file=sys.stderr)
    # The lifespan has stopped everything; the interpreter's own teardown of vLLM and
    # torch took seconds more, past the stop margin (--shutdown-timeout + STOP_MARGIN).
    _exit_now(code)


def start_failure(exc: BaseException) -> str:
    """One line: every distinct message down the exception chain, and where vLLM CPU
    failed for memory, what to set."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        text = f"{type(seen).__name__}: {seen}".splitlines()[0] if str(seen) else type(seen).__name__
        if text not in parts:
            parts.append(text)
        seen = seen.__cause__ or seen.__context__
    line = "engine start failed: " + " <- ".join(parts)
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ and any(w in line.lower() for w in ("memory", "kv cache")):
        line += (f" (VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB: "
                 "set a smaller one, or --max-model-len)")
    return line


class Lifecycle:
    def __init__(self, state: AppState, workers: HttpWorkers | None = None,
                 sock: socket.socket | None = None) -> None:
        self.state = state
        self.workers = workers  # --http-workers: they serve the port, this process their Unix socket
        self.sock = sock  # the public port, bound before the engine starts (served here without workers)
        self.exit_code = ExitCode.OK
        self._server: _DrainingServer | None = None
        self._start: asyncio.Task | None = None

    def run(self) -> int:
        s = self.state.settings
        where = {"uds": self.workers.upstream} if self.workers else {"host": s.host, "port": s.port}
        config = uvicorn.Config(
            create_app(self.state, self.lifespan),
            **where,
            log_level=s.log_level.lower(),
            # The drain has already waited --shutdown-timeout: uvicorn then only closes what is left.
            timeout_graceful_shutdown=int(CUT_OFF_GRACE) + 1,
            timeout_keep_alive=30,
            # The public port's connections are bounded where it is served: here, or in the workers.
            http=protocol_for(s, self.state.metrics) if self.workers is None else "auto",
        )
        self._server = _DrainingServer(config, self)
        if self.workers is None and self.sock is not None:
            log.info("listening on %s:%d", s.host, self.sock.getsockname()[1])
        self._server.run(sockets=[self.sock] if self.workers is None and self.sock is not None else None)
        if self._start is not None and not self._start.done():
            # Stopped while vLLM was still starting: its start runs in a thread nothing can
            # cancel, which would keep the process alive; end its processes and exit now.
            log.warning("stopped while the engine was starting")
            _kill_children()
            _exit_now(self.exit_code)
        return self.exit_code

    def fail(self, reason: str) -> None:
        """Stop the server with exit 1."""
        log.error("%s", reason)
        self.exit_code = ExitCode.FAILED
        if self._server is not None:
            self._server.should_exit = True

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        st = self.state
        if self.workers is not None:
            self.workers.start()
        start = self._start = asyncio.create_task(self.start_engine(), name="hsx-engine-start")
        watch = asyncio.create_task(self.watch_engine(), name="hsx-engine-watch")
        lag = asyncio.create_task(sample_loop_lag(st.metrics), name="hsx-loop-lag")
        try:
            yield
        finally:
            lag.cancel()
            watch.cancel()
            start.cancel()
            t0 = time.monotonic()
            if self.workers is not None:  # first: they read the arena
                await asyncio.to_thread(self.workers.stop, CUT_OFF_GRACE + 3)
            if st.arena_socket is not None:
                st.arena_socket.close()
            if st.service is not None and st.service.leases is not None:
                st.service.leases.end_all()
            t1 = time.monotonic()
            if st.tokenizer_pool is not None:
                await asyncio.to_thread(st.tokenizer_pool.close)
            t2 = time.monotonic()
            st.prefill.shutdown()
            log.info("stopped: arena socket and leases %.1fs, tokenizer processes %.1fs, engine %.1fs",
                     t1 - t0, t2 - t1, time.monotonic() - t2)

    async def start_engine(self) -> None:
        st = self.state
        try:
            await st.prefill.start()
            st.metrics.kv_cache_usage.set_function(st.prefill.stats.kv_cache_usage)
            st.metrics.kv_cache_usage_peak.set_function(st.prefill.stats.kv_cache_usage_peak)
            st.metrics.watch_engine_tokens(lambda: dict(st.prefill.stats.tokens))
            f = st.prefill.facts
            template = None
            if st.settings.chat_template:
                with open(st.settings.chat_template) as fh:
                    template = fh.read()
            tokenizer = st.tokenizer_pool = TokenizerPool(
                f.tokenizer, f.tokenizer_revision, f.trust_remote_code, template,
                workers=st.settings.tokenize_workers, queue=st.settings.tokenize_queue,
                timeout=st.settings.tokenize_timeout, memory=st.settings.tokenize_memory,
                request_template_workers=st.settings.template_workers if st.settings.trust_request_chat_template else 0,
            )
            await tokenizer.ready()
            try:
                st.final_norm = await asyncio.to_thread(load_final_norm, f.model, f.revision, st.prefill.text_config)
            except Exception as exc:  # served anyway; /final_norm explains
                st.final_norm_error = str(exc)
                log.warning("final norm unavailable: %s", exc)
            service = HiddenStatesService(st.settings, st.prefill, tokenizer, st.metrics, st.gate, st.http_workers)
            await st.prefill.self_test()
            if service.leases is not None:
                arena = st.prefill.arena
                try:
                    st.arena_socket = ArenaSocket(
                        arena.ro_fd, arena.arena_id, arena.size, st.settings.accepted_keys,
                        lease_keys=st.settings.lease_api_key, on_session_end=service.leases.end_session,
                        internal_key=st.worker_token, clients=st.settings.shm_lease,
                    ).start()
                    service.leases.live_sessions = st.arena_socket.sessions
                    if st.settings.api_key and not st.settings.lease_api_key:
                        log.info("same-host leases: no key is marked for them (--lease-api-key); HTTP bodies only")
                except OSError as exc:  # e.g. no abstract sockets here: serve HTTP bodies only
                    log.warning("same-host leases off: cannot open the arena socket: %s", exc)
                    service.leases = None
            st.generator = Generator(st)  # POST /v1/chat/completions; checks --reasoning-parser
            st.service = service  # /ready is 200 from here on
            log.info("ready: %s, layers %s", f.served_model_name, f.layer_ids)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine start failed")
            st.startup_error = start_failure(exc)
            self.fail(st.startup_error)

    async def watch_engine(self) -> None:
        prefill = self.state.prefill
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if self.workers is not None:
                reason = self.workers.check()
                if reason:
                    self.fail(reason)
                    return
            if prefill.dead:
                log.error("the vLLM engine died; exiting so the orchestrator restarts this server")
                if prefill.notices is not None:
                    prefill.notices.fail_all("engine died")
                self.fail("engine died")
                return

    def arm_stop_deadline(self) -> None:
        """From the stop signal: gone within --shutdown-timeout + STOP_MARGIN, whatever
        the teardown is waiting for."""
        delay = self.state.settings.shutdown_timeout + STOP_MARGIN - FORCE_RESERVE
        timer = threading.Timer(delay, self._force_exit, args=(delay,))
        timer.daemon = True
        timer.start()

    def _force_exit(self, after: float) -> None:
        log.error("still stopping %.0fs after the signal: killing the engine's processes and exiting", after)
        _kill_children(wait=FORCE_RESERVE / 2)
        _exit_now(self.exit_code)

    async def drain(self) -> None:
        st = self.state
        log.info("draining: up to %.0fs for in-flight requests", st.settings.shutdown_timeout)
        st.gate.draining = True

        def busy() -> int:
            return st.service.busy if st.service is not None else st.gate.in_flight

        deadline = time.monotonic() + st.settings.shutdown_timeout
        while busy() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        if busy():
            log.warning("drain timeout: %d requests or leases cut off (answered 503)", busy())
            st.cut_off.set()  # requests being prepared or prefilled, generations
            if st.service is not None:  # chunked responses waiting on their client, and leases
                st.service.cut_off()
            grace = time.monotonic() + CUT_OFF_GRACE  # for the 503s to be sent
            while st.gate.in_flight > 0 and time.monotonic() < grace:
                await asyncio.sleep(DRAIN_POLL)
        if self._server is not None:
            self._server.should_exit = True


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _kill_children(wait: float = 5.0) -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=wait)


class _DrainingServer(uvicorn.Server):
    """uvicorn with hsx's signal handling: the first SIGTERM/SIGINT drains, a second
    SIGINT stops at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self._draining or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._lifecycle.arm_stop_deadline()
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._lifecycle.drain()))
