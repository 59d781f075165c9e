"""GET /dashboard: the live status page, and GET /dashboard/data: the one JSON snapshot
it polls (server/status.py). create_app puts both behind the API key.

The page is three files shipped in the package (server/static/: HTML, CSS, plain JS that
draws its charts as inline SVG), served from memory: no CDN, nothing to fetch.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from deltaserve.server.routes_common import server_state
from deltaserve.server.status import status_snapshot

router = APIRouter()

_STATIC = resources.files("deltaserve.server") / "static"
_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_NO_STORE = {"Cache-Control": "no-store"}


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The status page (its data comes from /dashboard/data)."""
    return HTMLResponse((_STATIC / "dashboard.html").read_text(), headers=_NO_STORE)


@router.get("/dashboard/data")
async def dashboard_data(request: Request) -> JSONResponse:
    """Rows running and queued, memory against the budget, the prefix cache, throughput
    and TTFT over the last minutes, the latest requests, the platform and settings."""
    return JSONResponse(status_snapshot(server_state(request), time.time()), headers=_NO_STORE)


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    """The page's script and style sheet."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        return Response(status_code=404)
    return Response((_STATIC / name).read_text(), media_type=media_type)
