"""What every route reads: `AppState` (on app.state.hsx; lifecycle.py fills it in), the
lookups a route starts with, and the error answers the routes document."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from hsx_service.engine.lease import ArenaSocket, LeasePolicy
from hsx_service.engine.norm import CheckpointNorm
from hsx_service.engine.prefill import PrefillEngine
from hsx_service.core.admission import AdmissionGate
from hsx_service.http.auth import bearer_token
from hsx_service.core.errors import NotReady
from hsx_service.core.metrics import Metrics
from hsx_service.http.schema import ErrorResponse
from hsx_service.serving import HiddenStatesService
from hsx_service.settings import ServiceSettings
from hsx_service.tokenize_pool import TokenizerPool

ERRORS = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    422: {"model": ErrorResponse, "description": "the body does not match the schema"},
    500: {"model": ErrorResponse, "description": "engine failure (details in the server log)"},
    501: {"model": ErrorResponse, "description": "not available for this model"},
    503: {"model": ErrorResponse, "description": "loading, full or draining; retry after Retry-After seconds"},
}
BAD_INPUT = {
    400: {"model": ErrorResponse, "description": "bad input"},
    413: {"model": ErrorResponse, "description": "body or token count over the limit"},
    415: {"model": ErrorResponse, "description": "body is not application/json"},
}


@dataclass
class AppState:
    """Everything the routes read, kept on app.state.hsx; lifecycle.py fills it in."""

    settings: ServiceSettings
    prefill: PrefillEngine
    metrics: Metrics = field(default_factory=Metrics)
    gate: AdmissionGate = field(init=False)  # made from the settings
    service: HiddenStatesService | None = None  # set once the engine serves
    final_norm: CheckpointNorm | None = None
    final_norm_error: str | None = None
    startup_error: str | None = None
    arena_socket: ArenaSocket | None = None  # when same-host leases are on (or HTTP workers run)
    # With --http-workers: the workers' shared secret (they present it as their API key: leases of
    # their own, reports on release). None when this process serves HTTP itself.
    worker_token: str | None = None
    http_workers: int = 0
    # An HTTP worker's requests in progress by their exchange id, so that it can abort one whose
    # client left (DELETE /exchanges/{id}) without dropping the connection (and a lease with it).
    exchanges: dict[str, asyncio.Future] = field(default_factory=dict)
    tokenizer_pool: TokenizerPool | None = None  # once the engine has started
    generator: Any = None  # routes_generation.Generator, once the engine serves (POST /v1/chat/completions)
    # Set when the drain's --shutdown-timeout is over: requests still being prepared or
    # prefilled are answered 503 (never a closed connection or a bare 500).
    cut_off: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate = AdmissionGate(self.settings.max_inflight, self.settings.max_queued_tokens, self.metrics)

    @property
    def lease_policy(self) -> LeasePolicy:
        s = self.settings
        return LeasePolicy(s.shm_lease, s.accepted_keys, s.lease_api_key, self.worker_token)


def state(request: Request) -> AppState:
    return request.app.state.hsx


def serving(request: Request) -> AppState:
    """The state of a server whose engine serves; 503 while it loads."""
    s = state(request)
    if s.service is None:
        raise NotReady("the engine is still loading; retry shortly", retry_after=5, reason="loading")
    return s


def request_key(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization"))
