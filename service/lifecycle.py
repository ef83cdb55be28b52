"""The server's life, in one place: start, engine watchdog, SIGTERM drain, exit codes.

    serve(settings, engine_args)
      1. Extractor.prepare(): arena, notice channel, vLLM config; every check that can
         refuse runs here, before the port opens (exit 2 with the reason);
      2. uvicorn serves the app at once (/health 200, /ready 503 "loading") while the
         lifespan starts vLLM in the background, loads the tokenizer and the final norm,
         runs the one-request self-test and opens the arena socket; then /ready is 200;
      3. the watchdog checks the engine every 0.5 s; a dead engine fails every request in
         flight and stops the server with exit 1 (so the orchestrator restarts it), as a
         failed start does;
      4. SIGTERM / SIGINT: the drain. /ready and new requests answer 503 at once; requests
         in flight and live leases get up to --shutdown-timeout; then the server stops and
         exits 0. A second SIGINT stops at once.
      5. the lifespan's end: the arena socket closes, live leases end, vLLM shuts down and
         the arena goes.

Exit codes: 0 drained or stopped, 1 the engine died or failed to start, 2 refused at start.
(vLLM keeps `serve_http` and its watchdog together for the same reason: one owner.)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from hsx_service.app import ServerState, create_app
from hsx_service.engine import Extractor
from hsx_service.errors import StartupError
from hsx_service.lease import ArenaSocket
from hsx_service.norm import load_final_norm
from hsx_service.serving import HiddenStatesService
from hsx_service.settings import ServiceSettings
from hsx_service.tokenize import Tokenizer

log = logging.getLogger("hsx")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
WATCH_INTERVAL = 0.5
DRAIN_POLL = 0.05


def serve(settings: ServiceSettings, engine_args: Any) -> int:
    """`hsx serve` after parsing: returns the exit code."""
    extractor = Extractor(settings, engine_args)
    try:
        extractor.prepare()
    except StartupError as exc:
        extractor.shutdown()
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return Lifecycle(ServerState(settings=settings, extractor=extractor)).run()


class Lifecycle:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.exit_code = EXIT_OK
        self._server: _DrainingServer | None = None

    def run(self) -> int:
        s = self.state.settings
        config = uvicorn.Config(
            create_app(self.state, self.lifespan),
            host=s.host,
            port=s.port,
            log_level=s.log_level.lower(),
            timeout_graceful_shutdown=max(1, int(s.shutdown_timeout)),
            timeout_keep_alive=30,
        )
        self._server = _DrainingServer(config, self)
        self._server.run()
        return self.exit_code

    def fail(self, reason: str) -> None:
        """Stop the server with exit 1."""
        log.error("%s", reason)
        self.exit_code = EXIT_FAILED
        if self._server is not None:
            self._server.should_exit = True

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        st = self.state
        start = asyncio.create_task(self.start_engine(), name="hsx-engine-start")
        watch = asyncio.create_task(self.watch_engine(), name="hsx-engine-watch")
        try:
            yield
        finally:
            watch.cancel()
            start.cancel()
            if st.arena_socket is not None:
                st.arena_socket.close()
            if st.service is not None and st.service.leases is not None:
                st.service.leases.end_all()
            st.extractor.shutdown()

    async def start_engine(self) -> None:
        st = self.state
        try:
            await st.extractor.start()
            st.metrics.kv_cache_usage.set_function(st.extractor.stats.kv_cache_usage)
            f = st.extractor.facts
            template = None
            if st.settings.chat_template:
                with open(st.settings.chat_template) as fh:
                    template = fh.read()
            tokenizer = await asyncio.to_thread(Tokenizer, f.tokenizer, f.tokenizer_revision, f.trust_remote_code,
                                                template)
            try:
                st.final_norm = await asyncio.to_thread(load_final_norm, f.model, f.revision, st.extractor.text_config)
            except Exception as exc:  # served anyway; /final_norm explains
                st.final_norm_error = str(exc)
                log.warning("final norm unavailable: %s", exc)
            service = HiddenStatesService(st.settings, st.extractor, tokenizer, st.metrics, st.gate)
            await st.extractor.self_test()
            if service.leases is not None:
                arena = st.extractor.arena
                try:
                    st.arena_socket = ArenaSocket(arena.ro_fd, arena.arena_id, arena.size, st.settings.api_key).start()
                except OSError as exc:  # e.g. no abstract sockets here: serve HTTP bodies only
                    log.warning("same-host leases off: cannot open the arena socket: %s", exc)
                    service.leases = None
            st.service = service  # /ready is 200 from here on
            log.info("ready: %s, layers %s", f.served_model_name, f.layer_ids)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine start failed")
            st.startup_error = f"engine start failed: {exc}"
            self.fail(st.startup_error)

    async def watch_engine(self) -> None:
        extractor = self.state.extractor
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if extractor.dead:
                log.error("the vLLM engine died; exiting so the orchestrator restarts this server")
                if extractor.notices is not None:
                    extractor.notices.fail_all("engine died")
                self.fail("engine died")
                return

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
            log.warning("drain timeout: %d requests or leases cut off", busy())
        if self._server is not None:
            self._server.should_exit = True


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
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._lifecycle.drain()))
