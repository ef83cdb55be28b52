"""The one place the service's errors (core/errors.py) become HTTP answers: the STATUS
table and `render`.

Every error answer is JSON: {"error": {"type", "message", "request_id"}}. 5xx
messages never carry internals (tracebacks go to the log only).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hsx_service.core.errors import (BadInput, BodyTimeout, ClientGone, Draining, EngineFailure, EngineTimeout,
                                    HeadersTooLarge, LeaseGone, NoSupervisedTokens, NotAvailable, NotFound, NotReady,
                                    Overloaded, ServiceError, TooLarge, Unauthorized, UnsupportedMedia)
from hsx_service.core.metrics import Metrics

log = logging.getLogger("hsx.errors")


# The one map from a domain error (core/errors.py) to its HTTP status; a subclass takes
# its nearest listed base's.
STATUS: dict[type[ServiceError], int] = {
    ServiceError: 500,
    BadInput: 400,
    Unauthorized: 401,
    NotFound: 404,
    ClientGone: 499,  # nginx's "client closed request": counted, never read
    LeaseGone: 410,
    BodyTimeout: 408,
    TooLarge: 413,
    UnsupportedMedia: 415,
    NoSupervisedTokens: 422,
    HeadersTooLarge: 431,
    EngineFailure: 500,
    NotAvailable: 501,
    Overloaded: 503,
    Draining: 503,
    NotReady: 503,
    EngineTimeout: 504,
}
# Headers an answer must carry for its status (RFC 6750: a 401 names the scheme).
CHALLENGE: dict[type[ServiceError], dict[str, str]] = {Unauthorized: {"WWW-Authenticate": "Bearer"}}


def status_of(exc: ServiceError) -> int:
    return next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)


REFUSALS = (408, 413, 431, 503)  # answers that turn a request away for its size, pace or the load


def _json_error(status: int, type_: str, message: str, request_id: str | None, headers: dict[str, str]) -> JSONResponse:
    if request_id:
        headers = {**headers, "X-Request-Id": request_id}
    body = {"error": {"type": type_, "message": message, "request_id": request_id}}
    return JSONResponse(body, status_code=status, headers=headers)


def render(exc: ServiceError, request_id: str | None, metrics: Metrics | None) -> JSONResponse:
    """The one place a ServiceError becomes an HTTP answer (the app's handlers and the
    guard middleware both call it)."""
    status = status_of(exc)
    headers = dict(next((h for cls, h in CHALLENGE.items() if isinstance(exc, cls)), {}))
    retry = exc.retry_after
    if retry is None and status == 503:
        retry = 1.0
    if retry is not None:
        headers["Retry-After"] = str(max(1, int(round(retry))))
    if status in REFUSALS and metrics is not None:
        metrics.rejected.labels(exc.reason).inc()
    if status >= 500:
        log.warning("%s: %s", exc.type, exc.message)
    return _json_error(status, exc.type, exc.message, request_id, headers)


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
