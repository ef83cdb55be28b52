"""Liveness, readiness and the Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hsx_service.http.schema import ProbeStatus
from hsx_service.http.state import state

router = APIRouter()
PROBE = {200: {"model": ProbeStatus}, 503: {"model": ProbeStatus, "description": "not live / not ready"}}


@router.get("/health", summary="Liveness: 503 once the engine is dead", responses=PROBE)
async def health(request: Request):
    s = state(request)
    if s.startup_error or s.prefill.dead:
        return JSONResponse({"status": "dead", "error": s.startup_error or "engine died"}, status_code=503)
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: 503 while loading or draining", responses=PROBE)
async def ready(request: Request):
    s = state(request)
    if s.service is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    if s.gate.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
    if s.prefill.dead:
        return JSONResponse({"status": "dead"}, status_code=503)
    return {"status": "ready"}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
async def metrics(request: Request):
    return Response(generate_latest(state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
