"""The FastAPI app: the guard, the error answers and the per-feature routers (probes,
model facts, states, generation, the OpenAI model list) over the state they read
(state.py; the server's life is lifecycle.py's).

The engine is built before the app (lifecycle.py validates the settings first, then
the lifespan starts vLLM in the background), so the port answers at once:
/health is 200 while loading, /ready 503 until the engine serves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI

from hsx import __version__ as hsx_version
from hsx_service.http import routes_generation, routes_model, routes_openai_models, routes_probes, routes_states
from hsx_service.http.docs import attach_offline_docs, offline_docs_app_kwargs
from hsx_service.http.errors import install_error_handlers
from hsx_service.http.guard import GuardMiddleware
from hsx_service.http.state import AppState

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(st: AppState, lifespan: Lifespan | None = None) -> FastAPI:
    app = FastAPI(
        title="hsx",
        version=hsx_version,
        description="Hidden states of a vLLM-served model for every token of a prompt or chat, for EAGLE-3 training.",
        lifespan=lifespan,
        **offline_docs_app_kwargs(),
    )
    attach_offline_docs(app)
    app.state.hsx = st
    install_error_handlers(app, st.metrics)
    app.add_middleware(GuardMiddleware, settings=st.settings, gate=st.gate, metrics=st.metrics,
                       internal_key=st.worker_token)
    for router in (routes_probes.router, routes_model.router, routes_states.router, routes_generation.router(),
                   routes_openai_models.router):
        app.include_router(router)
    return app
