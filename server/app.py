"""The FastAPI app factory: wires an EngineClient, a tokenizer and Settings into routes.

`create_app` takes the engine as an argument (no globals, no model loading here), so
tests pass a fake engine and the CLI passes the real AsyncEngine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from deltaserve.engine.api import EngineClient
from deltaserve.server import (
    routes_chat,
    routes_completions,
    routes_messages,
    routes_models,
    routes_responses,
    routes_status,
)
from deltaserve.server.errors import APIError, install_error_handlers
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.metrics import ServerMetrics, StatusCounterMiddleware
from deltaserve.server.response_store import ResponseStore
from deltaserve.server.routes_common import ServerState
from deltaserve.server.settings import Settings

logger = logging.getLogger(__name__)


def require_api_key(request: Request) -> None:
    """401 unless the request carries the api_key (when one is set), as OpenAI clients
    send it (`Authorization: Bearer <key>`) or as Anthropic's do (`x-api-key: <key>`)."""
    if not _has_api_key(request, allow_basic=False):
        raise APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>` "
            "or `x-api-key: <key>`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_api_key_browser(request: Request) -> None:
    """require_api_key for pages a person opens (/dashboard): a browser cannot add a
    Bearer header to an address it is sent to, so the key also passes as HTTP Basic's
    password (any user name), and a 401 asks for it: the browser shows a log-in box and
    then sends the key with every request of the page, its data polls included."""
    if not _has_api_key(request, allow_basic=True):
        raise APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`, or log in "
            "with any user name and the key as the password.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Basic realm="deltaserve", charset="UTF-8"'},
        )


def _has_api_key(request: Request, *, allow_basic: bool) -> bool:
    expected = request.app.state.deltaserve.settings.server.api_key
    if not expected:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    offered = [request.headers.get("x-api-key", "")]
    if scheme.lower() == "bearer":
        offered.append(token.strip())
    elif scheme.lower() == "basic" and allow_basic:
        with contextlib.suppress(binascii.Error, UnicodeDecodeError):
            user_and_key = base64.b64decode(token.strip(), validate=True).decode()
            offered.append(user_and_key.partition(":")[2])
    # compare_digest: the time taken must not reveal how much of the key matched.
    return any(hmac.compare_digest(key.encode(), expected.encode()) for key in offered if key)


def fingerprint(settings: Settings) -> str:
    """system_fingerprint: a short hash of what shapes generation on this server."""
    text = repr((settings.model.path, settings.engine))
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:10]


def begin_shutdown(app: FastAPI) -> None:
    """End every generation in flight now, each with a 503 "shutting down" error.

    Streams get an error event then [DONE]; waiting responses get a 503. Called when the
    HTTP server starts shutting down, so it never waits on token streams (see
    deltaserve.server.cli).
    """
    app.state.deltaserve.stopping.set()


def create_app(engine: EngineClient, tokenizer: TextTokenizer, settings: Settings) -> FastAPI:
    """Build the app around a running engine and the model's tokenizer."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sampling = asyncio.ensure_future(app.state.deltaserve.history.run(engine))
        yield
        sampling.cancel()
        # Uvicorn has stopped accepting and let in-flight requests finish (or aborted
        # them at its graceful-shutdown timeout); now stop the engine thread.
        logger.info("shutting down the engine")
        engine.shutdown()

    # FastAPIOffline: FastAPI whose /docs and /redoc load Swagger UI and ReDoc from files
    # the fastapi-offline package ships, not from a CDN (servers often run offline).
    app = FastAPIOffline(title="deltaserve", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    app.state.deltaserve = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        settings=settings,
        metrics=metrics,
        model_name=settings.model.name,
        fingerprint=fingerprint(settings),
        responses=ResponseStore.from_settings(settings.responses),
    )
    install_error_handlers(app)

    # /v1 and /dashboard need the key; /health, /metrics and /docs stay open (probes,
    # scrapers, and an API description that holds no data).
    v1 = APIRouter(dependencies=[Depends(require_api_key)])
    for module in (routes_chat, routes_completions, routes_messages, routes_responses):
        v1.include_router(module.router)
    v1.include_router(routes_models.models_router)
    app.include_router(v1)
    app.include_router(routes_models.probes_router)
    app.include_router(routes_status.router, dependencies=[Depends(require_api_key_browser)])

    if settings.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.server.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],  # SDKs add their own x-* headers
        )
    # Outermost, so it also counts responses made by error handlers and CORS.
    app.add_middleware(StatusCounterMiddleware, metrics=metrics)
    return app
