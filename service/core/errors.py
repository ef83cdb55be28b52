"""Errors the service raises on purpose, free of any transport: each says what went wrong
(`type`, the answer's error type) and never how it is sent. http/errors.py alone maps
them to HTTP statuses (its STATUS table) and renders them.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """The server cannot start with these settings; the message says why."""


class ServiceError(Exception):
    """An answer the service gives on purpose. `reason` labels a refusal in
    `hsx_rejected_total` (http/errors.render counts every one it sends); `retry_after`:
    seconds after which the same request may pass."""

    type = "internal_error"

    def __init__(self, message: str, *, retry_after: float | None = None, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.reason = reason or self.type


class BadInput(ServiceError):
    type = "invalid_request"


class NoSupervisedTokens(ServiceError):
    """`require_supervised` and the (truncated) loss mask is all zero: nothing to train on."""

    type = "no_supervised_tokens"


class TooLarge(ServiceError):
    """Over a size limit: body, tokens, text or messages. A smaller request may pass."""

    type = "too_large"


class BodyTimeout(ServiceError):
    type = "body_timeout"


class HeadersTooLarge(ServiceError):
    type = "headers_too_large"


class Unauthorized(ServiceError):
    type = "unauthorized"


class UnsupportedMedia(ServiceError):
    type = "unsupported_media_type"


class LeaseGone(ServiceError):
    type = "lease_gone"


class NotFound(ServiceError):
    type = "not_found"


class ClientGone(ServiceError):
    """The client left (or its HTTP worker aborted the request) before the answer: nobody reads it."""

    type = "client_closed_request"


class Overloaded(ServiceError):  # full: reason inflight, tokens or memory
    type = "overloaded"


class Draining(ServiceError):
    type = "draining"


class NotReady(ServiceError):  # reason loading, or engine_dead
    type = "not_ready"


class EngineFailure(ServiceError):
    type = "engine_error"


class EngineTimeout(ServiceError):
    type = "timeout"


class NotAvailable(ServiceError):
    type = "not_available"
