"""The FastAPI app: routes and the state they read (the server's life is lifecycle.py's).

The engine is built before the app (lifecycle.py validates the settings first, then
the lifespan starts vLLM in the background), so the port answers at once:
/health is 200 while loading, /ready 503 until the engine serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hsx import __version__ as hsx_version
from hsx.wire import LEASE_MEDIA_TYPE, MEDIA_TYPE, TensorSpec, encode_header
from hsx_service.admission import DRAIN_RETRY_AFTER, AdmissionGate
from hsx_service.docs import attach_offline_docs, offline_docs_app_kwargs
from hsx_service.engine import Extractor
from hsx_service.generation import router as generation_router
from hsx_service.errors import Draining, LeaseGone, NotAvailable, NotReady, install_error_handlers
from hsx_service.guard import GuardMiddleware
from hsx_service.auth import key_matches
from hsx_service.lease import EXCHANGE_HEADER, SENT_HEADER, SESSION_HEADER, ArenaSocket, SendReport, key_may_lease
from hsx_service.metrics import Metrics
from hsx_service.norm import FinalNorm
from hsx_service.protocol import ErrorResponse, HiddenStatesRequest, ProbeStatus, TokenizeResponse
from hsx_service.response import choose_coding
from hsx_service.serving import HiddenStatesService
from hsx_service.settings import ServiceSettings
from hsx_service.tokenize_pool import TokenizerPool

log = logging.getLogger("hsx.app")

ERRORS = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    422: {"model": ErrorResponse, "description": "the body does not match the schema"},
    500: {"model": ErrorResponse, "description": "engine failure (details in the server log)"},
    501: {"model": ErrorResponse, "description": "not available for this model"},
    503: {"model": ErrorResponse, "description": "loading, full or draining; retry after Retry-After seconds"},
}


@dataclass
class ServerState:
    """Everything the routes read, kept on app.state.hsx; lifecycle.py fills it in."""

    settings: ServiceSettings
    extractor: Extractor
    metrics: Metrics = field(default_factory=Metrics)
    gate: AdmissionGate = field(init=False)  # made from the settings
    service: HiddenStatesService | None = None  # set once the engine serves
    final_norm: FinalNorm | None = None
    final_norm_error: str | None = None
    startup_error: str | None = None
    arena_socket: ArenaSocket | None = None  # when same-host leases are on (or HTTP workers run)
    # With --http-workers: the workers' shared secret (they present it as their API key: leases of
    # their own, reports on release). None when this process serves HTTP itself.
    front_token: str | None = None
    http_workers: int = 0
    # An HTTP worker's requests in progress by their exchange id, so that it can abort one whose
    # client left (DELETE /exchanges/{id}) without dropping the connection (and a lease with it).
    exchanges: dict[str, asyncio.Future] = field(default_factory=dict)
    tokenizer_pool: TokenizerPool | None = None  # once the engine has started
    # Set when the drain's --shutdown-timeout is over: requests still being prepared or
    # prefilled are answered 503 (never a closed connection or a bare 500).
    cut_off: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate = AdmissionGate(self.settings.max_inflight, self.settings.max_queued_tokens, self.metrics)


def state(request: Request) -> ServerState:
    return request.app.state.hsx


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(st: ServerState, lifespan: Lifespan | None = None) -> FastAPI:
    app = FastAPI(
        title="hsx",
        version=hsx_version,
        description="Hidden states of a vLLM-served model for every token of a prompt or chat, for EAGLE-3 training.",
        lifespan=lifespan,
        **offline_docs_app_kwargs(),
    )
    attach_offline_docs(app)
    app.state.hsx = st
    install_error_handlers(app, st.metrics)
    app.add_middleware(GuardMiddleware, settings=st.settings, gate=st.gate, metrics=st.metrics,
                       internal_key=st.front_token)

    app.include_router(generation_router())  # POST /v1/chat/completions (generation.py)

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
        if s.service is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        if s.gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
        if s.extractor.dead:
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics(request: Request):
        return Response(generate_latest(state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
            "shm_lease": None if s.arena_socket is None or not _may_lease(s, request) else {
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
        st = _serving(request)
        service = st.service
        lease, session, front = _lease_terms(st, request)
        coding = choose_coding(request.headers.get("accept"), request.headers.get("accept-encoding"), service.facts.dtype)
        work = asyncio.ensure_future(service.run(body, request.state.request_id, request.state.ticket, coding, lease,
                                                 session, front))
        exchange = request.headers.get(EXCHANGE_HEADER) if front else None
        if exchange:
            st.exchanges[exchange] = work
        gone = asyncio.ensure_future(_client_gone(request))
        cut_off = asyncio.ensure_future(st.cut_off.wait())
        try:
            await asyncio.wait({work, gone, cut_off}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            cut_off.cancel()
            if exchange:
                st.exchanges.pop(exchange, None)
        if work.cancelled():  # aborted by the HTTP worker whose client left
            service.metrics.requests.labels("disconnected").inc()
            return Response(status_code=499)
        if not work.done():
            # Cancelling aborts the engine request (or stops its tokenizer process) and frees its memory.
            work.cancel()
            if st.cut_off.is_set():
                service.metrics.requests.labels("cut_off").inc()
                raise Draining("the server shut down before this request finished (--shutdown-timeout); "
                               "send it to another server", retry_after=DRAIN_RETRY_AFTER, reason="cut_off")
            service.metrics.requests.labels("disconnected").inc()
            return Response(status_code=499)
        reply = work.result()
        return _ReleasingStream(reply.stream, reply.close, media_type=reply.headers.pop("Content-Type"),
                                headers=reply.headers)

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
        return await _serving(request).service.tokenize(body, request.state.request_id)

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
        report = SendReport.parse(request.headers.get(SENT_HEADER)) if _is_front(s, request) else None
        if not s.service.release_lease(lease_id, report):
            raise LeaseGone(f"lease {lease_id[:64]!r} is unknown or expired; its states may be overwritten, redo the request")
        return Response(status_code=204)

    @app.delete("/exchanges/{exchange}", include_in_schema=False, status_code=204, response_class=Response)
    async def abort_exchange(exchange: str, request: Request):
        """An HTTP worker's client left: abort that request if it is still being prepared or
        prefilled (the worker still reads its answer, and releases a lease in it)."""
        s = state(request)
        if not _is_front(s, request):
            raise NotAvailable("not found")
        work = s.exchanges.get(exchange)
        if work is not None:
            work.cancel()
        return Response(status_code=204)

    return app


class _ReleasingStream(StreamingResponse):
    """Runs the reply's `close` once however the response ends, after the stream is
    closed (so nothing reads the arena range any more). This is the one place: a client
    that leaves before the body starts leaves the generator unstarted, so a `finally`
    inside the stream would never run."""

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


def _key(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _lease_terms(st: ServerState, request: Request) -> tuple[bool, str | None, bool]:
    """Whether this request may get a lease, the lease session it belongs to, and whether
    it is an HTTP worker's (fronts.py). Only keys marked for leases get one, and only
    inside a live session of the arena socket: a request without one (left out, closed or
    made up) gets an HTTP body (the Accept header lists it too), so every lease ends with
    its client's connection and none can pin the arena until --lease-timeout. The
    session's caps are checked once the states' size is known (Leases.may_lease)."""
    if st.service.leases is None or LEASE_MEDIA_TYPE not in request.headers.get("accept", ""):
        return False, None, False
    if not _may_lease(st, request):
        return False, None, False
    session = request.headers.get(SESSION_HEADER)
    if session is None or st.arena_socket is None or session not in st.arena_socket.sessions:
        return False, None, False
    return True, session, _is_front(st, request)


def _is_front(st: ServerState, request: Request) -> bool:
    return st.front_token is not None and key_matches((_key(request) or "").encode(), [st.front_token.encode()])


def _may_lease(st: ServerState, request: Request) -> bool:
    if _is_front(st, request):
        return True
    s = st.settings
    if not s.shm_lease:  # the lease table may exist for HTTP workers alone
        return False
    return key_may_lease((_key(request) or "").encode(), [k.encode() for k in s.accepted_keys],
                         [k.encode() for k in s.lease_api_key])


def _serving(request: Request) -> ServerState:
    s = state(request)
    if s.service is None:
        raise NotReady("the engine is still loading; retry shortly", retry_after=5, reason="loading")
    return s
