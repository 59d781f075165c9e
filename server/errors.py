"""Errors: one exception type for the routes, handlers for everything else, two shapes.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; Anthropic's
(/v1/messages…) answer `{"type": "error", "error": {"type", "message"}}`, chosen by the
request's path in `error_response`, so auth and body-parsing failures take the right
shape too. Input problems are 400 (never FastAPI's 422), engine refusals keep their
meaning (InvalidRequestError → 400 with its param, QueueFullError → 429 + Retry-After,
EngineStoppedError → 503),
and anything unexpected is a 500 that is logged while the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.engine.api import EngineStoppedError, QueueFullError
from deltaserve.engine.types import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
ANTHROPIC_PATH = "/v1/messages"  # this path and those below it answer in Anthropic's shape
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error to send as-is: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The `{"error": {...}}` body (also what an SSE error event carries)."""
        return error_body(self.status, self.message, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's `{"type": "error", "error": {...}}` body; it has no `param` field,
        so the message names the field instead."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        message = self.message
        if self.param and not message.startswith(self.param):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object for `status`."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def as_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc))
    if isinstance(exc, QueueFullError):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": retry})
    if isinstance(exc, ValidationError | RequestValidationError):
        return validation_error(exc.errors())
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error; the request was not completed")


def validation_error(errors: Any) -> APIError:
    """A 400 for pydantic errors: the first error's message, its location as `param`."""
    errors = list(errors) or [{"msg": "invalid request", "loc": (), "type": ""}]
    # A union reports one error per member; the most telling is the one where the type
    # matched but the value did not (e.g. an image part in a list of content parts).
    first = min(errors, key=lambda e: (str(e.get("type", "")).endswith("_type"), -len(e["loc"])))
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error')}")
    # FastAPI prefixes "body"; unions add their member's type ("str", "list[...]",
    # "ChatMessage", "function-after[...]") to the location: keep only real field names.
    loc = [str(part) for part in first.get("loc", ()) if _is_field_name(part)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param)


def _is_field_name(part: Any) -> bool:
    text = str(part)
    noise = text in ("body", "str", "int", "float", "bool", "dict", "list") or "[" in text
    return not noise and not text[:1].isupper()


def is_anthropic(request: Request) -> bool:
    """Whether `request` is for an Anthropic route (its errors take Anthropic's shape)."""
    path = request.url.path
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_response(err: APIError, request: Request | None = None) -> JSONResponse:
    """Render an APIError as a JSONResponse in the shape of `request`'s protocol."""
    body = err.anthropic_body() if request is not None and is_anthropic(request) else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(as_api_error(exc), request)


async def _handle_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Starlette's own 404 (unknown path) / 405 (wrong method), in our shape.
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    return error_response(APIError(exc.status_code, message, headers=headers), request)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""
    for exc_type in (
        APIError,
        InvalidRequestError,
        QueueFullError,
        RequestValidationError,
        ValidationError,
        Exception,
    ):
        app.add_exception_handler(exc_type, _handle)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
