"""The FastAPI app factory: wires an EngineClient, a tokenizer and Settings into routes.

`create_app` takes the engine as an argument (no globals, no model loading here), so
tests pass a fake engine and the CLI passes the real AsyncEngine.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from engine.api import EngineClient
from server import routes_chat, routes_completions, routes_messages, routes_models
from server.errors import APIError, install_error_handlers
from server.frontend.tokenizer import TextTokenizer
from server.metrics import ServerMetrics, StatusCounterMiddleware
from server.routes_common import ServerState
from server.settings import Settings

logger = logging.getLogger(__name__)


def require_api_key(request: Request) -> None:
    """401 unless the request carries the api_key (when one is set), as OpenAI clients
    send it (`Authorization: Bearer <key>`) or as Anthropic's do (`x-api-key: <key>`)."""
    expected = request.app.state.deltaserve.settings.server.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    offered = [key for key in (bearer, request.headers.get("x-api-key", "")) if key]
    # compare_digest: the time taken must not reveal how much of the key matched.
    if not any(hmac.compare_digest(key.encode(), expected.encode()) for key in offered):
        raise APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>` "
            "or `x-api-key: <key>`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def fingerprint(settings: Settings) -> str:
    """system_fingerprint: a short hash of what shapes generation on this server."""
    text = repr((settings.model.path, settings.engine))
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:10]


def begin_shutdown(app: FastAPI) -> None:
    """End every generation in flight now, each with a 503 "shutting down" error.

    Streams get an error event then [DONE]; waiting responses get a 503. Called when the
    HTTP server starts shutting down, so it never waits on token streams (see server.cli).
    """
    app.state.deltaserve.stopping.set()


def create_app(engine: EngineClient, tokenizer: TextTokenizer, settings: Settings) -> FastAPI:
    """Build the app around a running engine and the model's tokenizer."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Uvicorn has stopped accepting and let in-flight requests finish (or aborted
        # them at its graceful-shutdown timeout); now stop the engine thread.
        logger.info("shutting down the engine")
        engine.shutdown()

    app = FastAPI(title="deltaserve", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    app.state.deltaserve = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        settings=settings,
        metrics=metrics,
        model_name=settings.model.name,
        fingerprint=fingerprint(settings),
    )
    install_error_handlers(app)

    # /v1 needs the key; /health and /metrics stay open for probes and scrapers.
    v1 = APIRouter(dependencies=[Depends(require_api_key)])
    for module in (routes_chat, routes_completions, routes_messages):
        v1.include_router(module.router)
    v1.include_router(routes_models.models_router)
    app.include_router(v1)
    app.include_router(routes_models.probes_router)

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
