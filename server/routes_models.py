"""GET /v1/models, and the unauthenticated probes: GET /health and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from deltaserve.server.responses import ModelCard, ModelList
from deltaserve.server.routes_common import check_model, server_state

models_router = APIRouter()
probes_router = APIRouter()


@models_router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The one served model, in OpenAI's list shape."""
    state = server_state(request)
    card = ModelCard(id=state.model_name, created=state.created)
    return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")


@models_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    """One model by id; 404 for anything but the served model."""
    state = server_state(request)
    check_model(state, model_id)
    card = ModelCard(id=state.model_name, created=state.created)
    return Response(card.model_dump_json(), media_type="application/json")


@probes_router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine thread is alive, 503 once it is not (or cannot say)."""
    try:
        is_alive = server_state(request).engine.stats().is_alive
    except Exception:
        is_alive = False
    if is_alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": "engine not running"}, 503)


@probes_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition; engine gauges are read from EngineStats right now."""
    server_metrics = server_state(request).metrics
    body = generate_latest(server_metrics.registry)
    return Response(body, media_type=server_metrics.content_type)
