"""/docs without the internet: Swagger UI from assets installed with vLLM.

FastAPI's default /docs page loads Swagger UI's script and style from a CDN, so it is
blank on an air-gapped host. vLLM's wheel (Apache-2.0, a dependency of the server
anyway) ships the two files for its own `--enable-offline-docs`; hsx serves them from
there under /docs/ (public, like /docs). Where a vLLM build lacks them, /docs keeps
FastAPI's CDN page.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse

ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
ASSET_PATHS = tuple(f"/docs/{name}" for name in ASSETS)


def asset_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / "entrypoints" / "serve" / "instrumentator" / "static"
    return static if all((static / name).is_file() for name in ASSETS) else None


def offline_docs_app_kwargs() -> dict:
    """FastAPI(...) arguments: its own /docs off where hsx serves the offline one."""
    return {"docs_url": None, "redoc_url": None} if asset_dir() is not None else {}


def attach_offline_docs(app: FastAPI) -> bool:
    static = asset_dir()
    if static is None:
        return False

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url,
            swagger_js_url=ASSET_PATHS[0], swagger_css_url=ASSET_PATHS[1],
        )

    @app.get(app.swagger_ui_oauth2_redirect_url, include_in_schema=False)
    async def swagger_ui_redirect():
        return get_swagger_ui_oauth2_redirect_html()

    for name, media in ASSETS.items():
        path = static / name

        async def asset(path: Path = path, media: str = media):
            return FileResponse(path, media_type=media)

        app.add_api_route(f"/docs/{name}", asset, methods=["GET"], include_in_schema=False)
    return True
