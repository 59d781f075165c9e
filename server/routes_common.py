"""What every route shares before generation starts: the server state, the model check,
body parsing, engine field names -> request fields, SamplingParams from a request (with
the context check), and running a non-streaming response until the client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel, ValidationError

from deltaserve.engine.api import EngineClient
from deltaserve.engine.types import InvalidRequestError, SamplingParams
from deltaserve.server.errors import APIError, as_api_error, error_response, validation_error
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.request_log import RequestLog
from deltaserve.server.response_store import ResponseStore
from deltaserve.server.schemas import SamplingFields
from deltaserve.server.settings import Settings
from deltaserve.server.status_history import StatusHistory

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# The engine names fields by its own names (GenerationRequest / SamplingParams); each
# protocol maps them to what its clients sent, so a 400 names a field of the request.
FieldNames = Mapping[str, str]


@dataclass(frozen=True)
class ServerState:
    """Everything a route needs; built once by create_app, stored on app.state."""

    engine: EngineClient
    tokenizer: TextTokenizer
    settings: Settings
    metrics: ServerMetrics
    model_name: str
    fingerprint: str  # system_fingerprint: changes when the engine config does
    responses: ResponseStore  # stored /v1/responses (previous_response_id, GET)
    created: int = field(default_factory=lambda: int(time.time()))
    # Set once shutdown begins (deltaserve.server.app.begin_shutdown): every generation ends with a
    # 503 at its next read instead of holding the shutdown up.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    requests: RequestLog = field(default_factory=RequestLog)  # finished requests' records
    history: StatusHistory = field(default_factory=StatusHistory)  # for the status page


def server_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request`."""
    return request.app.state.deltaserve


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` is the served model (or omitted)."""
    if model is not None and model != state.model_name:
        message = f"The model `{model}` does not exist. This server serves `{state.model_name}`."
        raise APIError(404, message, param="model", code="model_not_found")


def new_id(prefix: str) -> str:
    """An OpenAI-style object id such as chatcmpl-<hex>."""
    return f"{prefix}-{secrets.token_hex(12)}"


def field_name(names: FieldNames, param: str | None) -> str | None:
    """The request field for the engine's `param` (itself when unmapped)."""
    return None if param is None else names.get(param, param)


def request_error(exc: InvalidRequestError, names: FieldNames) -> APIError:
    """An engine refusal as a 400 that names the request's field."""
    return APIError(400, str(exc), field_name(names, exc.param))


def sampling_params(
    state: ServerState,
    body: SamplingFields,
    num_prompt: int,
    max_new: int | None,
    names: FieldNames,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplingParams:
    """Build SamplingParams from a request, after checking it fits the context.

    Unset fields take the configured defaults; an unset max_tokens also shrinks to the
    room the prompt leaves. Ranges are checked by SamplingParams itself (→ 400, its
    param renamed through `names`, e.g. top_logprobs → logprobs for /v1/completions).
    """
    max_context = state.engine.max_context
    room = max_context - num_prompt
    if room < 1:
        message = f"The prompt is {num_prompt} tokens; this model's context is {max_context}."
        raise APIError(400, message, field_name(names, "prompt_ids"), "context_length_exceeded")
    max_tokens = field_name(names, "max_tokens")
    if max_new is not None and max_new > room:
        message = (
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {num_prompt + max_new} tokens ({num_prompt} in the prompt, "
            f"{max_new} in the completion). Please reduce the prompt or {max_tokens}."
        )
        raise APIError(400, message, max_tokens, "context_length_exceeded")
    logit_bias = body.logit_bias_ids()
    if any(token >= state.tokenizer.vocab_size for token in logit_bias):
        raise APIError(400, "logit_bias names a token id outside the vocabulary", "logit_bias")
    defaults = state.settings.sampling

    def pick(value: T | None, default: T) -> T:
        return default if value is None else value

    try:
        return SamplingParams(
            temperature=pick(body.temperature, defaults.temperature),
            top_p=pick(body.top_p, defaults.top_p),
            top_k=pick(body.top_k, defaults.top_k),
            min_p=pick(body.min_p, 0.0),
            repetition_penalty=pick(body.repetition_penalty, 1.0),
            presence_penalty=pick(body.presence_penalty, 0.0),
            frequency_penalty=pick(body.frequency_penalty, 0.0),
            logit_bias=logit_bias,
            seed=body.seed,
            max_tokens=min(defaults.max_tokens, room) if max_new is None else max_new,
            ignore_eos=body.ignore_eos,
            speculative=body.speculative,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except InvalidRequestError as exc:
        raise request_error(exc, names) from None


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency parsing the body as `model`; bad JSON or fields → our 400.

    Parsed here rather than by FastAPI so that auth (a router dependency) runs first and
    no error ever takes FastAPI's 422 shape.
    """

    async def parse(request: Request) -> M:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    return parse


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`; if the client goes away first, cancel it (its finally aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; never sent
    try:
        return task.result()
    except Exception as exc:
        return error_response(as_api_error(exc), request)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
