"""The FastAPI app: routes, request-id / size / auth middleware, state accessors.

The engine is built before the app (cli.py validates the settings first, then
the lifespan starts vLLM in the background), so the port answers at once:
/health is 200 while loading, /ready 503 until the engine serves.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hsx import __version__ as hsx_version
from hsx.wire import LEASE_MEDIA_TYPE, MEDIA_TYPE, TensorSpec, encode_header
from hsx_service.errors import (
    LeaseGone,
    NotAvailable,
    NotReady,
    error_body,
    install_error_handlers,
)
from hsx_service.auth import key_matches
from hsx_service.lease import ArenaSocket
from hsx_service.metrics import Metrics
from hsx_service.protocol import ErrorResponse, HiddenStatesRequest, ProbeStatus, TokenizeResponse
from hsx_service.response import accepts_zstd
from hsx_service.settings import ServiceSettings

log = logging.getLogger("hsx.app")

PUBLIC_PATHS = ("/health", "/ready", "/metrics")
GUARDED_PATHS = ("/hidden_states", "/tokenize", "/info", "/final_norm", "/leases/")  # a trailing / guards the subtree
ERRORS = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    422: {"model": ErrorResponse, "description": "the body does not match the schema"},
    500: {"model": ErrorResponse, "description": "engine failure (details in the server log)"},
    501: {"model": ErrorResponse, "description": "not available for this model"},
    503: {"model": ErrorResponse, "description": "loading, full or draining; retry after Retry-After seconds"},
}


@dataclass
class ServerState:
    """Everything the routes read, kept on app.state.hsx."""

    settings: ServiceSettings
    extractor: Any  # hsx_service.engine.Extractor
    metrics: Metrics = field(default_factory=Metrics)
    service: Any = None  # HiddenStatesService once the engine is up
    final_norm: Any = None
    final_norm_error: str | None = None
    loading: bool = True
    startup_error: str | None = None
    on_engine_dead: Any = None  # callable, set by cli.py: exit non-zero
    on_startup_failed: Any = None
    arena_socket: Any = None  # hsx_service.lease.ArenaSocket when same-host leases are on


def state(request: Request) -> ServerState:
    return request.app.state.hsx


class GuardMiddleware:
    """Request id, API key and body-size checks, as plain ASGI (streams untouched)."""

    def __init__(self, app, settings: ServiceSettings):
        self.app = app
        self.keys = [k.encode() for k in settings.api_key]
        self.max_body = settings.max_body_bytes
        # Requests past this many at once are refused before their body is read, so a
        # flood of large bodies cannot grow memory (the service's own bounds come after).
        self.max_active = settings.max_inflight
        self.active = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        rid = rid[:128]
        scope.setdefault("state", {})["request_id"] = rid
        path = scope["path"]

        async def reply(status: int, type_: str, message: str, extra: dict | None = None):
            resp = JSONResponse(error_body(status, type_, message, rid), status_code=status,
                                headers={"X-Request-Id": rid, **(extra or {})})
            await resp(scope, receive, send)

        if self.keys and any(path == p or (p.endswith("/") and path.startswith(p)) for p in GUARDED_PATHS):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not key_matches(token.strip().encode(), self.keys):
                return await reply(401, "unauthorized", "missing or invalid API key (Authorization: Bearer KEY)",
                                   {"WWW-Authenticate": "Bearer"})
        if path in ("/hidden_states", "/tokenize") and scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return await reply(415, "unsupported_media_type",
                                   f"send the request as Content-Type: application/json (got {ctype or 'none'!r})")
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                return await reply(413, "too_large",
                                   f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")
            if self.active >= self.max_active:
                return await reply(503, "overloaded",
                                   f"{self.active} requests in progress (limit {self.max_active}); retry shortly",
                                   {"Retry-After": "1"})
            receive = self._limited(receive)
            self.active += 1
            try:
                return await self.app(scope, receive, self._with_id(send, rid))
            finally:
                self.active -= 1
        await self.app(scope, receive, self._with_id(send, rid))

    @staticmethod
    def _with_id(send, rid):
        async def send_with_id(message):
            if message["type"] == "http.response.start":
                hdrs = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in hdrs):
                    hdrs.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": hdrs}
            await send(message)

        return send_with_id

    def _limited(self, receive):
        seen = 0
        limit = self.max_body

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # An HTTPException, since FastAPI turns other errors while reading the body into 400.
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        return wrapped


def create_app(st: ServerState) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_start_engine(st), name="hsx-engine-start")
        watch = asyncio.create_task(_watch_engine(st), name="hsx-engine-watch")
        try:
            yield
        finally:
            watch.cancel()
            task.cancel()
            if st.arena_socket is not None:
                st.arena_socket.close()
            if st.service is not None and st.service.leases is not None:
                st.service.leases.end_all()
            st.extractor.shutdown()

    app = FastAPI(
        title="hsx",
        version=hsx_version,
        description="Hidden states of a vLLM-served model for every token of a prompt or chat, for EAGLE-3 training.",
        lifespan=lifespan,
    )
    app.state.hsx = st
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, settings=st.settings)

    probe = {200: {"model": ProbeStatus}, 503: {"model": ProbeStatus, "description": "not live / not ready"}}

    @app.get("/health", summary="Liveness: 503 once the engine is dead", responses=probe)
    async def health(request: Request):
        s = state(request)
        if s.startup_error or s.extractor.dead:
            return JSONResponse({"status": "dead", "error": s.startup_error or "engine died"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: 503 while loading or draining", responses=probe)
    async def ready(request: Request):
        s = state(request)
        if s.service is None or s.loading:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        if s.service.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
        if s.extractor.dead:
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics(request: Request):
        s = state(request)
        if s.service is not None:
            s.service._gauges()
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/info", summary="Model, layers, hidden size, dtype, limits, versions", responses=ERRORS)
    async def info(request: Request):
        s = _serving(request)
        f = s.extractor.facts
        norm = s.final_norm
        return {
            "model": f.served_model_name,
            "model_path": f.model,
            "model_revision": f.revision,
            "architecture": f.architecture,
            "layer_ids": f.layer_ids,
            "num_hidden_layers": f.num_hidden_layers,
            "hidden_size": f.hidden_size,
            "dtype": f.dtype,
            "max_model_len": f.max_model_len,
            "max_tokens_per_request": s.service.max_tokens,
            "vocab_size": f.vocab_size,
            "last_layer_pre_norm": True,
            "final_norm": None if norm is None else {"eps": norm.eps, "style": norm.style, "tensor": norm.tensor_name},
            "chat_template_sha256": s.service.tokenizer.template_sha256,
            "vllm_version": f.vllm_version,
            "hsx_version": hsx_version,
            "shm_lease": None if s.arena_socket is None else {
                "socket": s.arena_socket.address,
                "arena_id": s.extractor.arena.arena_id,
                "boot_id": s.arena_socket.boot_id,
                "lease_timeout": s.settings.lease_timeout,
            },
        }

    @app.get(
        "/final_norm",
        summary="The final norm's weight (float32), epsilon and style, as safetensors",
        response_class=Response,
        responses={200: {"content": {MEDIA_TYPE: {}}}, **ERRORS},
    )
    async def final_norm(request: Request):
        s = _serving(request)
        norm = s.final_norm
        if norm is None:
            raise NotAvailable(f"the final norm could not be read from the checkpoint: {s.final_norm_error}")
        data = norm.weight.astype("float32").tobytes()
        header = encode_header(
            [TensorSpec("weight", "F32", (len(norm.weight),))],
            {"eps": repr(norm.eps), "style": norm.style, "tensor": norm.tensor_name},
        )
        return Response(header + data, media_type=MEDIA_TYPE)

    @app.post(
        "/hidden_states",
        summary="Prefill one input and return its hidden states as a safetensors body",
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {MEDIA_TYPE: {}, LEASE_MEDIA_TYPE: {}},
                "description": "safetensors: hidden_states [T, L, H], token_ids, loss_mask; with "
                f"Accept: {LEASE_MEDIA_TYPE} (same host, see /info shm_lease) the states stay in shared "
                "memory and the metadata's 'lease' says where; release it with DELETE /leases/{id}",
            },
            **ERRORS,
            400: {"model": ErrorResponse, "description": "bad input"},
            413: {"model": ErrorResponse, "description": "body or token count over the limit"},
            415: {"model": ErrorResponse, "description": "body is not application/json"},
            504: {"model": ErrorResponse, "description": "the engine did not finish in time"},
        },
    )
    async def hidden_states(body: HiddenStatesRequest, request: Request):
        s = _serving(request)
        rid = request.state.request_id
        lease = s.service.leases is not None and LEASE_MEDIA_TYPE in request.headers.get("accept", "")
        work = asyncio.ensure_future(
            s.service.run(body, rid, accepts_zstd(request.headers.get("accept-encoding")), lease)
        )
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            # The caller left: cancelling aborts the engine request and frees its memory.
            work.cancel()
            s.metrics.requests.labels("disconnected").inc()
            return Response(status_code=499)
        headers, stream, close = work.result()
        return _ReleasingStream(stream, close, media_type=headers.pop("Content-Type"), headers=headers)

    @app.post(
        "/tokenize",
        summary="Token ids and loss mask of an input, as /hidden_states would prefill them, without the engine",
        response_model=TokenizeResponse,
        responses={
            **ERRORS,
            400: {"model": ErrorResponse, "description": "bad input"},
            413: {"model": ErrorResponse, "description": "body or token count over the limit"},
            415: {"model": ErrorResponse, "description": "body is not application/json"},
        },
    )
    async def tokenize(body: HiddenStatesRequest, request: Request):
        s = _serving(request)
        return await s.service.tokenize(body, request.state.request_id)

    @app.delete(
        "/leases/{lease_id}",
        summary="Release a same-host lease once its states are read",
        status_code=204,
        response_class=Response,
        responses={
            204: {"description": "released: the bytes read under this lease were valid"},
            410: {"model": ErrorResponse, "description": "unknown or expired: the range may have been reused, redo the request"},
            **ERRORS,
        },
    )
    async def release_lease(lease_id: str, request: Request):
        s = _serving(request)
        if not s.service.release_lease(lease_id):
            raise LeaseGone(f"lease {lease_id[:64]!r} is unknown or expired; its states may be overwritten, redo the request")
        return Response(status_code=204)

    return app


class _ReleasingStream(StreamingResponse):
    """Frees the request's arena range however the response ends: a client that leaves
    before the body starts leaves the generator unstarted, and its `finally` never runs."""

    def __init__(self, stream, close, **kwargs):
        super().__init__(stream, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a started stream waits for its in-flight chunk
            self._close()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _serving(request: Request) -> ServerState:
    s = state(request)
    if s.service is None:
        raise NotReady("the engine is still loading; retry shortly", retry_after=5)
    return s


async def _start_engine(st: ServerState) -> None:
    from hsx_service.norm import load_final_norm
    from hsx_service.serving import HiddenStatesService
    from hsx_service.tokenize import Tokenizer

    try:
        await st.extractor.start()
        f = st.extractor.facts
        template = None
        if st.settings.chat_template:
            with open(st.settings.chat_template) as fh:
                template = fh.read()
        tokenizer = await asyncio.to_thread(Tokenizer, f.tokenizer, f.tokenizer_revision, f.trust_remote_code, template)
        try:
            st.final_norm = await asyncio.to_thread(
                load_final_norm, f.model, f.revision, st.extractor.text_config
            )
        except Exception as exc:  # served anyway; /final_norm explains
            st.final_norm_error = str(exc)
            log.warning("final norm unavailable: %s", exc)
        st.service = HiddenStatesService(st.settings, st.extractor, tokenizer, st.metrics)
        await st.extractor.self_test()
        if st.service.leases is not None:
            arena = st.extractor.arena
            try:
                st.arena_socket = ArenaSocket(arena.ro_fd, arena.arena_id, arena.size, st.settings.api_key).start()
            except OSError as exc:  # e.g. no abstract sockets here: serve HTTP bodies only
                log.warning("same-host leases off: cannot open the arena socket: %s", exc)
                st.service.leases = None
        st.loading = False
        log.info("ready: %s, layers %s", f.served_model_name, f.layer_ids)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("engine start failed")
        st.startup_error = f"engine start failed: {exc}"
        if st.on_startup_failed:
            st.on_startup_failed(st.startup_error)


async def _watch_engine(st: ServerState) -> None:
    while True:
        await asyncio.sleep(0.5)
        if st.extractor.dead:
            log.error("the vLLM engine died; exiting so the orchestrator restarts this server")
            if st.extractor.notices is not None:
                st.extractor.notices.fail_all("engine died")
            if st.on_engine_dead:
                st.on_engine_dead()
            return
