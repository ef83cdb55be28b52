"""The guard in front of every route, as plain ASGI middleware (streams untouched).

Per request: the header count and size (431), a request id (echoed, or made), the API
key on every path but the public ones, and for the POST routes with a JSON body
(`BODY_ROUTES`: /hidden_states, /tokenize) the content type, the body (read whole within
--body-timeout, 408 beyond; at most --max-receiving being read at once) and then the
admission gate's door: a client still sending holds no admission place; the ticket names the
client (its key, else its address) for its fair share of the tokenizer processes. Every answer is
counted in `hsx_http_responses_total{code}`. Refusals are the ServiceErrors of core/errors.py,
rendered by errors.render like every other error answer.

Public without a key: the probes (an orchestrator has no key) and the API's own
description (/docs, /openapi.json, as vLLM keeps them: they hold no data). Everything
else, a route added later included, needs the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid

from hsx_service.core.admission import AdmissionGate
from hsx_service.core.keys import key_matches
from hsx_service.http.auth import bearer_token
from hsx_service.http.connections import PROBE_ONLY
from hsx_service.http.docs import ASSET_PATHS
from hsx_service.core.errors import (BodyTimeout, HeadersTooLarge, Overloaded, ServiceError, TooLarge, Unauthorized,
                                    UnsupportedMedia)
from hsx_service.http.errors import render
from hsx_service.core.metrics import Metrics
from hsx_service.settings import ServiceSettings

PROBE_PATHS = ("/health", "/ready", "/metrics")
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", *ASSET_PATHS)
PUBLIC_PATHS = PROBE_PATHS + DOC_PATHS
MAX_REQUEST_ID = 128
RECEIVING_GRACE = 1.0  # seconds a body gets to arrive when --max-receiving slow senders hold every place
BODY_ROUTES = ("/hidden_states", "/tokenize", "/v1/chat/completions")  # POST, a JSON body, through the gate's door


class GuardMiddleware:
    def __init__(self, app, settings: ServiceSettings, gate: AdmissionGate, metrics: Metrics,
                 internal_key: str | None = None):
        self.app = app
        self.keys = [k.encode() for k in settings.accepted_keys]
        if self.keys and internal_key:  # the HTTP workers' own requests (http_workers.py); no keys: no auth at all
            self.keys.append(internal_key.encode())
        self.max_body = settings.max_body_bytes
        self.body_timeout = settings.body_timeout
        self.max_receiving = settings.max_receiving
        self.max_header_bytes = settings.max_header_bytes
        self.max_headers = settings.max_headers
        self.gate = gate
        self.metrics = metrics
        self.receiving = 0  # requests whose body is still arriving (not yet at the gate)
        metrics.receiving.set_function(lambda: self.receiving)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope["headers"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        rid = (headers.get("x-request-id") or uuid.uuid4().hex)[:MAX_REQUEST_ID]
        scope.setdefault("state", {})["request_id"] = rid
        send = _counted(_with_request_id(send, rid), self.metrics)
        ticket = None
        try:
            self._check_headers(raw)
            if scope["state"].get(PROBE_ONLY) and scope["path"] not in PROBE_PATHS:
                raise Overloaded("too many open connections (--max-connections); this one is kept for the probes, "
                                 "retry shortly", reason="connections")
            if self.keys and scope["path"] not in PUBLIC_PATHS:
                self._authorize(headers)
            if scope["path"] in BODY_ROUTES and scope["method"] == "POST":
                self._check_body(headers)
                body = await self._read_body(receive)
                if body is None:  # the client left while sending
                    return
                ticket = self.gate.enter(self._client(scope, headers))  # only requests whose body has arrived
                receive = _replay(body, receive)
        except ServiceError as exc:
            return await render(exc, rid, self.metrics)(scope, receive, send)
        if ticket is None:
            return await self.app(scope, receive, send)
        scope["state"]["ticket"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.release()

    def _check_headers(self, raw) -> None:
        size = sum(len(k) + len(v) + 4 for k, v in raw)
        if len(raw) > self.max_headers or size > self.max_header_bytes:
            raise HeadersTooLarge(f"{len(raw)} headers of {size} bytes; this server takes at most "
                                  f"{self.max_headers} headers of {self.max_header_bytes} bytes")

    def _authorize(self, headers: dict[str, str]) -> None:
        token = bearer_token(headers.get("authorization"))
        if token is None or not key_matches(token.encode(), self.keys):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer KEY)")

    def _client(self, scope, headers: dict[str, str]) -> str:
        """Who sends this request, for a fair share of the tokenizer processes: its API key where
        the server has keys (checked by now; hashed, so no key is kept in the clear), else its
        address (a client choosing names of its own could take many shares)."""
        if self.keys:
            token = bearer_token(headers.get("authorization")) or ""
            return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
        peer = scope.get("client")
        return "peer:" + (peer[0] if peer else "")

    def _check_body(self, headers: dict[str, str]) -> None:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMedia(f"send the request as Content-Type: application/json (got {ctype or 'none'!r})")
        coding = headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            # Never decoded here: a compressed body would only be parsed as broken JSON, and
            # decoding it would let a small body grow past --max-body-bytes.
            raise UnsupportedMedia(f"request bodies are read as sent; this server takes no Content-Encoding "
                                   f"(got {coding[:64]!r}): send the JSON uncompressed")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise TooLarge(f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")

    async def _read_body(self, receive) -> bytes | None:
        """The whole body within --body-timeout, at most --max-receiving at once: a slow
        or silent sender holds a receiving place for a bounded time and never an
        admission place. None when the client disconnected."""
        chunks: list[bytes] = []
        if self.receiving >= self.max_receiving:
            # Full of slow senders: a body that is already here (or nearly) still gets in,
            # so they cannot lock out clients whose bodies have arrived.
            try:
                return await asyncio.wait_for(self._read_chunks(receive, chunks), RECEIVING_GRACE)
            except asyncio.TimeoutError:
                raise Overloaded(f"{self.receiving} requests are still sending their bodies (limit "
                                 f"{self.max_receiving}) and this one's did not arrive within "
                                 f"{RECEIVING_GRACE:g}s; retry shortly", reason="receiving") from None
        self.receiving += 1
        try:
            return await asyncio.wait_for(self._read_chunks(receive, chunks), self.body_timeout)
        except asyncio.TimeoutError:
            got = sum(map(len, chunks))
            raise BodyTimeout(f"the request body did not arrive within {self.body_timeout:g}s (got {got} bytes); "
                              "the server's --body-timeout") from None
        finally:
            self.receiving -= 1

    async def _read_chunks(self, receive, chunks: list[bytes]) -> bytes | None:
        seen = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:  # bodies without a Content-Length
                raise TooLarge(f"request body exceeds the limit of {self.max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """The app's receive: the body read by the guard, then the connection's own
    messages (so a disconnect is still seen)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _counted(send, metrics: Metrics):
    async def counting_send(message):
        if message["type"] == "http.response.start":
            metrics.responses.labels(str(message["status"])).inc()
        await send(message)

    return counting_send


def _with_request_id(send, rid: str):
    async def send_with_id(message):
        if message["type"] == "http.response.start":
            hdrs = list(message.get("headers", []))
            if not any(k.lower() == b"x-request-id" for k, _ in hdrs):
                hdrs.append((b"x-request-id", rid.encode("latin-1")))
            message = {**message, "headers": hdrs}
        await send(message)

    return send_with_id
