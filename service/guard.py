"""The guard in front of every route, as plain ASGI middleware (streams untouched).

Per request: a request id (echoed, or made), the API key on every path but the public
ones, and for the POST routes with a JSON body (`BODY_ROUTES`: /hidden_states, /tokenize)
the content type, the body size and the admission gate's door (before the body is read). Refusals are the ServiceErrors of errors.py,
rendered by errors.render like every other error answer.

Public without a key: the probes (an orchestrator has no key) and the API's own
description (/docs, /openapi.json, as vLLM keeps them: they hold no data). Everything
else, a route added later included, needs the key.
"""

from __future__ import annotations

import uuid

from starlette.exceptions import HTTPException as StarletteHTTPException

from hsx_service.admission import AdmissionGate
from hsx_service.auth import key_matches
from hsx_service.errors import ServiceError, TooLarge, Unauthorized, UnsupportedMedia, render
from hsx_service.metrics import Metrics
from hsx_service.settings import ServiceSettings

PROBE_PATHS = ("/health", "/ready", "/metrics")
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
PUBLIC_PATHS = PROBE_PATHS + DOC_PATHS
MAX_REQUEST_ID = 128
BODY_ROUTES = ("/hidden_states", "/tokenize")  # POST, a JSON body, through the gate's door


class GuardMiddleware:
    def __init__(self, app, settings: ServiceSettings, gate: AdmissionGate, metrics: Metrics):
        self.app = app
        self.keys = [k.encode() for k in settings.api_key]
        self.max_body = settings.max_body_bytes
        self.gate = gate
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = (headers.get("x-request-id") or uuid.uuid4().hex)[:MAX_REQUEST_ID]
        scope.setdefault("state", {})["request_id"] = rid
        ticket = None
        try:
            if self.keys and scope["path"] not in PUBLIC_PATHS:
                self._authorize(headers)
            if scope["path"] in BODY_ROUTES and scope["method"] == "POST":
                self._check_body(headers)
                ticket = self.gate.enter()
        except ServiceError as exc:
            return await render(exc, rid, self.metrics)(scope, receive, send)
        send = _with_request_id(send, rid)
        if ticket is None:
            return await self.app(scope, receive, send)
        scope["state"]["ticket"] = ticket
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            ticket.release()

    def _authorize(self, headers: dict[str, str]) -> None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip().encode(), self.keys):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer KEY)")

    def _check_body(self, headers: dict[str, str]) -> None:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMedia(f"send the request as Content-Type: application/json (got {ctype or 'none'!r})")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise TooLarge(f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")

    def _limited(self, receive):
        """The size limit again while reading, for bodies without a Content-Length."""
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


def _with_request_id(send, rid: str):
    async def send_with_id(message):
        if message["type"] == "http.response.start":
            hdrs = list(message.get("headers", []))
            if not any(k.lower() == b"x-request-id" for k, _ in hdrs):
                hdrs.append((b"x-request-id", rid.encode("latin-1")))
            message = {**message, "headers": hdrs}
        await send(message)

    return send_with_id
