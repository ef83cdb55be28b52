"""Typed errors of the hsx client, one class per way a request can fail.

Every error carries what a person (or a retry loop) needs to act on it: the HTTP
status (None when no response came back), the server's error `type` and `message`,
the request id (echoed by the server or the one the client sent) and the server URL.

    HsxError
    +-- BadRequestError         400 / 422   the input is wrong: fix it, do not retry
    +-- AuthenticationError     401 / 403   missing or wrong API key
    +-- PayloadTooLargeError    413         body or token count over the server's limit
    +-- ServerBusyError         429 / 503   full or draining: retry after `retry_after`
    +-- ServerError             5xx         engine failure: retry elsewhere, bounded
    +-- ResponseValidationError 200 with a body that is not one sample (truncated, malformed):
    |                           retried; neither a server error (no 5xx budget, no breaker) nor a lost connection
    +-- ConnectionFailedError   no response (refused, reset, DNS)
    |   +-- RequestTimeoutError the server did not answer within the timeout
    |   +-- ServersUnreachableError  no server ever answered (wrong URL/port): raised at once
    +-- RetriesExhaustedError   gave up; `.last_error` is the final attempt's error
    +-- LeaseExpiredError       410 on a lease release: the states read may be stale, redo
"""

from __future__ import annotations

import json
from typing import Any


class HsxError(Exception):
    """Base class. `retryable` says whether another attempt may succeed."""

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,  # noqa: A002 - mirrors the server's JSON field
        request_id: str | None = None,
        server: str | None = None,
    ) -> None:
        self.message = message
        self.status = status
        self.type = type
        self.request_id = request_id
        self.server = server
        super().__init__(message)

    def __str__(self) -> str:
        parts = []
        if self.status is not None:
            parts.append(str(self.status))
        if self.type:
            parts.append(self.type)
        head = " ".join(parts)
        tail = []
        if self.server:
            tail.append(f"server={self.server}")
        if self.request_id:
            tail.append(f"request_id={self.request_id}")
        s = f"{head}: {self.message}" if head else self.message
        return f"{s} ({', '.join(tail)})" if tail else s


class BadRequestError(HsxError):
    """400/422: the request is invalid (bad JSON, unknown layer, over max_model_len...)."""


class AuthenticationError(HsxError):
    """401/403: the API key is missing or wrong."""


class PayloadTooLargeError(HsxError):
    """413: the body or the token count is over the server's limit."""


class ServerBusyError(HsxError):
    """429/503: the server is full or draining; `retry_after` is its hint in seconds."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServerError(HsxError):
    """5xx other than 503: the engine failed on this request."""

    retryable = True


class ResponseValidationError(HsxError, ValueError):
    """The server answered 200 but its body is not what the protocol says (truncated,
    malformed, an unknown coding). Retried like a lost answer (the next may be whole); it
    sets the server aside for its cooldown, but counts neither toward `max_server_errors`
    (no engine failed) nor as a connection failure (the server did answer). A ValueError
    too: a malformed value, as hsx.wire's WireFormatError it stands for."""

    retryable = True

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("type", "bad_response")
        super().__init__(message, **kw)


class ConnectionFailedError(HsxError):
    """No response: connection refused or reset, DNS."""

    retryable = True


class RequestTimeoutError(ConnectionFailedError):
    """The server did not answer within the client's timeout."""


class ServersUnreachableError(ConnectionFailedError):
    """No server of the client has ever answered, and every one refused or timed out the
    connection: a wrong URL or port, or nothing started yet. Not retried (a retry storm
    against a typo only hides it for minutes); servers that answered once are retried."""

    retryable = False


class LeaseExpiredError(HsxError):
    """A same-host lease ended before its release: the bytes read under it may have
    been overwritten. Redo the request."""


class RetriesExhaustedError(HsxError):
    """Every attempt failed with a retryable error; `last_error` is the last one."""

    def __init__(self, message: str, *, last_error: HsxError, attempts: int) -> None:
        super().__init__(
            message,
            status=last_error.status,
            type=last_error.type,
            request_id=last_error.request_id,
            server=last_error.server,
        )
        self.last_error = last_error
        self.attempts = attempts


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    # HTTP-date form.
    try:
        import email.utils
        import time

        dt = email.utils.parsedate_to_datetime(value)
        return max(0.0, dt.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def error_from_response(
    status: int,
    content: bytes,
    headers: Any,
    *,
    server: str | None = None,
    request_id: str | None = None,
) -> HsxError:
    """Build the typed error for a non-2xx response.

    Reads the server's `{"error": {"type", "message", "request_id"}}` body; falls back
    to the raw text (a proxy's HTML page, FastAPI's own `{"detail": ...}`).
    """
    etype: str | None = None
    message: str | None = None
    rid = headers.get("x-request-id") if headers is not None else None
    try:
        data = json.loads(content) if content else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            etype = err.get("type")
            message = err.get("message")
            rid = err.get("request_id") or rid
        elif "detail" in data:
            message = json.dumps(data["detail"]) if not isinstance(data["detail"], str) else data["detail"]
    if message is None:
        text = content[:500].decode("utf-8", "replace").strip() if content else ""
        message = text or f"HTTP {status}"
    kw: dict[str, Any] = dict(status=status, type=etype, request_id=rid or request_id, server=server)
    if status in (400, 422):
        return BadRequestError(message, **kw)
    if status in (401, 403):
        return AuthenticationError(message, **kw)
    if status == 413:
        return PayloadTooLargeError(message, **kw)
    if status in (408, 429, 503):
        ra = _parse_retry_after(headers.get("retry-after") if headers is not None else None)
        return ServerBusyError(message, retry_after=ra, **kw)
    if status >= 500:
        return ServerError(message, **kw)
    return HsxError(message, **kw)
