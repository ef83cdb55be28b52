"""The states: POST /hidden_states, the release of a same-host lease, and an HTTP worker's
abort of a request whose client left."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from hsx.protocol.lease import EXCHANGE_HEADER, SENT_HEADER, SESSION_HEADER, SendReport
from hsx.wire import LEASE_MEDIA_TYPE, MEDIA_TYPE
from hsx_service.body.negotiate import accepts_media, choose_coding
from hsx_service.engine.lease import LeaseTerms
from hsx_service.core.admission import DRAIN_RETRY_AFTER
from hsx_service.http.disconnect import race_client
from hsx_service.core.errors import ClientGone, Draining, LeaseGone, NotFound
from hsx_service.core.schema import HiddenStatesRequest
from hsx_service.http.schema import ErrorResponse
from hsx_service.http.state import BAD_INPUT, ERRORS, AppState, request_key, serving, state

router = APIRouter()


@router.post(
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
        **BAD_INPUT,
        504: {"model": ErrorResponse, "description": "the engine did not finish in time"},
    },
)
async def hidden_states(body: HiddenStatesRequest, request: Request):
    st = serving(request)
    service = st.service
    terms = lease_terms(st, request)
    coding = choose_coding(request.headers.get("accept"), request.headers.get("accept-encoding"), service.facts.dtype)
    work = asyncio.ensure_future(service.run(body, request.state.request_id, request.state.ticket, coding,
                                             terms.granted, terms.session, terms.http_worker))
    exchange = request.headers.get(EXCHANGE_HEADER) if terms.http_worker else None
    if exchange:
        st.exchanges[exchange] = work
    try:
        (await race_client(work, request.receive, st.cut_off.wait())).cancel()
    finally:
        if exchange:
            st.exchanges.pop(exchange, None)
    if work.cancelled():  # aborted by the HTTP worker whose client left
        service.metrics.requests.labels("disconnected").inc()
        raise ClientGone("the request was aborted: its client left")
    if not work.done():
        # Cancelling aborts the engine request (or stops its tokenizer process) and frees its memory.
        work.cancel()
        if st.cut_off.is_set():
            service.metrics.requests.labels("cut_off").inc()
            raise Draining("the server shut down before this request finished (--shutdown-timeout); "
                           "send it to another server", retry_after=DRAIN_RETRY_AFTER, reason="cut_off")
        service.metrics.requests.labels("disconnected").inc()
        raise ClientGone("the client left before the answer")
    reply = work.result()
    return _ReleasingStream(reply.stream, reply.close, media_type=reply.headers.pop("Content-Type"),
                            headers=reply.headers)


@router.delete(
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
    s = serving(request)
    from_worker = s.lease_policy.from_http_worker(request_key(request))
    report = SendReport.parse(request.headers.get(SENT_HEADER)) if from_worker else None
    if not s.service.release_lease(lease_id, report):
        raise LeaseGone(f"lease {lease_id[:64]!r} is unknown or expired; its states may be overwritten, redo the request")
    return Response(status_code=204)


@router.delete("/exchanges/{exchange}", include_in_schema=False, status_code=204, response_class=Response)
async def abort_exchange(exchange: str, request: Request):
    """An HTTP worker's client left: abort that request if it is still being prepared or
    prefilled (the worker still reads its answer, and releases a lease in it)."""
    s = state(request)
    if not s.lease_policy.from_http_worker(request_key(request)):
        raise NotFound("not found")
    work = s.exchanges.get(exchange)
    if work is not None:
        work.cancel()
    return Response(status_code=204)


def lease_terms(st: AppState, request: Request) -> LeaseTerms:
    """This request's lease terms (engine.lease.LeasePolicy decides)."""
    live = st.arena_socket.sessions if st.arena_socket is not None else ()
    return st.lease_policy.terms(request_key(request), accepts_media(request.headers.get("accept"), LEASE_MEDIA_TYPE),
                                 request.headers.get(SESSION_HEADER), st.service.leases, live)


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
