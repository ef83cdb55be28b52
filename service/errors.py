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

from hsx_service.arena import ArenaTooSmall

log = logging.getLogger("hsx.errors")


class StartupError(RuntimeError):
    """The server cannot start with these settings; the message says why."""


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class BadInput(ServiceError):
    status, type = 400, "invalid_request"


class Unprocessable(ServiceError):
    status, type = 422, "invalid_request"


class TooLarge(ServiceError):
    status, type = 413, "too_large"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"


class UnsupportedMedia(ServiceError):
    status, type = 415, "unsupported_media_type"


class LeaseGone(ServiceError):
    status, type = 410, "lease_gone"


class Overloaded(ServiceError):
    status, type = 503, "overloaded"


class Draining(ServiceError):
    status, type = 503, "draining"


class NotReady(ServiceError):
    status, type = 503, "not_ready"


class EngineFailure(ServiceError):
    status, type = 500, "engine_error"


class EngineTimeout(ServiceError):
    status, type = 504, "timeout"


class NotAvailable(ServiceError):
    status, type = 501, "not_available"


def error_body(status: int, type_: str, message: str, request_id: str | None) -> dict:
    return {"error": {"type": type_, "message": message, "request_id": request_id}}


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def error_response(request: Request, status: int, type_: str, message: str, retry_after: float | None = None):
    headers = {}
    rid = _request_id(request)
    if rid:
        headers["X-Request-Id"] = rid
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(retry_after))))
    return JSONResponse(error_body(status, type_, message, rid), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        retry = exc.retry_after
        if retry is None and exc.status == 503:
            retry = 1.0
        if exc.status >= 500:
            log.warning("%s: %s", exc.type, exc.message)
        return error_response(request, exc.status, exc.type, exc.message, retry)

    @app.exception_handler(ArenaTooSmall)
    async def _too_small(request: Request, exc: ArenaTooSmall):
        return error_response(request, 413, "too_large", str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors()[:10]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return error_response(request, 422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status_code, "http_error")
        return error_response(request, exc.status_code, kind, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(request, 500, "internal_error", "internal server error; see the server log")
