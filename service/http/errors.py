"""Errors the service raises on purpose, and the one table mapping them to HTTP.

Every error answer is JSON: {"error": {"type", "message", "request_id"}}. 5xx
messages never carry internals (tracebacks go to the log only).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hsx_service.http.metrics import Metrics

log = logging.getLogger("hsx.errors")


class StartupError(RuntimeError):
    """The server cannot start with these settings; the message says why."""


class ServiceError(Exception):
    """An answer the service gives on purpose. `reason` labels a refusal (503, 408, 413,
    431) in `hsx_rejected_total` (every one sent is counted there, see `render`)."""

    status = 500
    type = "internal_error"
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, retry_after: float | None = None, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.reason = reason or self.type


class BadInput(ServiceError):
    status, type = 400, "invalid_request"


class NoSupervisedTokens(ServiceError):
    """`require_supervised` and the (truncated) loss mask is all zero: nothing to train on."""

    status, type = 422, "no_supervised_tokens"


class TooLarge(ServiceError):
    status, type = 413, "too_large"


class BodyTimeout(ServiceError):
    status, type = 408, "body_timeout"


class HeadersTooLarge(ServiceError):
    status, type = 431, "headers_too_large"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"
    headers = {"WWW-Authenticate": "Bearer"}


class UnsupportedMedia(ServiceError):
    status, type = 415, "unsupported_media_type"


class LeaseGone(ServiceError):
    status, type = 410, "lease_gone"


class Overloaded(ServiceError):  # full: reason inflight, tokens or memory
    status, type = 503, "overloaded"


class Draining(ServiceError):
    status, type = 503, "draining"


class NotReady(ServiceError):  # reason loading, or engine_dead
    status, type = 503, "not_ready"


class EngineFailure(ServiceError):
    status, type = 500, "engine_error"


class EngineTimeout(ServiceError):
    status, type = 504, "timeout"


class NotAvailable(ServiceError):
    status, type = 501, "not_available"


REFUSALS = (408, 413, 431, 503)  # answers that turn a request away for its size, pace or the load


def _json_error(status: int, type_: str, message: str, request_id: str | None, headers: dict[str, str]) -> JSONResponse:
    if request_id:
        headers = {**headers, "X-Request-Id": request_id}
    body = {"error": {"type": type_, "message": message, "request_id": request_id}}
    return JSONResponse(body, status_code=status, headers=headers)


def render(exc: ServiceError, request_id: str | None, metrics: Metrics | None) -> JSONResponse:
    """The one place a ServiceError becomes an HTTP answer (the app's handlers and the
    guard middleware both call it)."""
    headers = dict(exc.headers)
    retry = exc.retry_after
    if retry is None and exc.status == 503:
        retry = 1.0
    if retry is not None:
        headers["Retry-After"] = str(max(1, int(round(retry))))
    if exc.status in REFUSALS and metrics is not None:
        metrics.rejected.labels(exc.reason).inc()
    if exc.status >= 500:
        log.warning("%s: %s", exc.type, exc.message)
    return _json_error(exc.status, exc.type, exc.message, request_id, headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return render(exc, _request_id(request), metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors()[:10]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return _json_error(422, "invalid_request", "; ".join(parts) or "invalid request", _request_id(request), {})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status_code, "http_error")
        return _json_error(exc.status_code, kind, str(exc.detail), _request_id(request), {})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return _json_error(500, "internal_error", "internal server error; see the server log", _request_id(request), {})
