"""POST /v1/responses and the stored-response routes: the OpenAI Responses adapter over
the generation pipeline.

The adapter: the request's items (after the stored context of previous_response_id, if
any) become item resources, then chat messages (server/frontend/responses_input.py), so
the prompt, images, sampling, constraint and submission are the chat route's
(server/prompts.py, server/pipeline.py); a ResponsesWriter (server/responses_writer.py)
frames the choice's pieces as output items and response.* events.

Mapping: instructions -> a system message (not carried into a continuation, as in the
spec); tool_choice auto / none / required / {"type": "function", "name"} -> chat's, the
last two forced by grammar; text.format json_schema / json_object -> chat's
response_format (same constraint path); reasoning.effort -> the template's
enable_thinking as chat's reasoning_effort (schemas.thinking_kwargs: "none" off, any
other on, absent: the model's default, which thinks) and a thinking budget
(schemas.effort_thinking_tokens: minimal 256, low 1024, medium 4096 tokens, higher
unlimited; none when max_output_tokens is no larger); max_output_tokens -> max_tokens.
usage.input_tokens is the whole prompt, input_tokens_details.cached_tokens what the
prefix cache restored. store (default true) keeps the finished response in the bounded
ResponseStore (server/response_store.py), which GET / DELETE /v1/responses/{id},
GET .../input_items and previous_response_id read; an unknown or evicted id is a 404.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from deltaserve.server.frontend.choice import ChoiceStream
from deltaserve.server.frontend.responses_input import chat_messages, chat_tools, item_resources
from deltaserve.server.pipeline import (
    OutputSpec,
    generation_request,
    output_constraint,
    serve,
    thinking_budget,
)
from deltaserve.server.prompts import render_prompt, template_tools
from deltaserve.server.responses_api import (
    CreateResponseRequest,
    DeletedResponse,
    NamedFunctionIn,
    ResponseItemList,
    ResponseOut,
)
from deltaserve.server.responses_writer import ResponsesWriter
from deltaserve.server.routes_common import (
    ServerState,
    check_model,
    json_body,
    sampling_params,
    server_state,
)
from deltaserve.server.schemas import ResponseFormat, effort_thinking_tokens, thinking_kwargs

router = APIRouter()
# Engine field names -> this endpoint's request fields, for 400 messages.
_FIELD_NAMES = {
    "prompt_ids": "input",
    "images": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "max_thinking_tokens": "reasoning.effort",
}
ResponsesBody = Annotated[CreateResponseRequest, Depends(json_body(CreateResponseRequest))]


@router.post("/v1/responses")
async def create_response(request: Request, body: ResponsesBody) -> Response:
    """OpenAI Responses, streaming (response.* events) or not."""
    arrival = time.monotonic()
    state = server_state(request)
    check_model(state, body.model)
    data = body.model_dump(exclude_none=True, by_alias=True)
    history = []
    if body.previous_response_id is not None:
        history = state.responses.get(body.previous_response_id, "previous_response_id").context()
    new_items = item_resources(data["input"])
    items = history + new_items
    where = ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(new_items))]
    spec = output_spec(body)
    tools = template_tools(chat_tools(data.get("tools")), spec)
    messages, refs = chat_messages(items, body.instructions, where)
    effort = body.reasoning.effort if body.reasoning is not None else None
    kwargs = thinking_kwargs(body.chat_template_kwargs, effort)
    prompt = await render_prompt(state, messages, tools, kwargs, refs)
    state.metrics.images.inc(len(prompt.images))
    params = sampling_params(state, body, len(prompt.ids), body.max_output_tokens, _FIELD_NAMES)
    reasoning = prompt.starts_in_reasoning
    budget = effort_thinking_tokens(effort, params.max_tokens)
    params = thinking_budget(state, params, budget, reasoning, _FIELD_NAMES)
    params = await output_constraint(state, params, spec, tools, reasoning, _FIELD_NAMES)
    response_id = "resp_" + secrets.token_hex(24)
    gen = generation_request(
        _FIELD_NAMES,
        response_id,
        prompt.ids,
        params,
        prefix_hint=prompt.history,
        images=prompt.images,
    )

    def choices() -> list[ChoiceStream]:
        parse_tools = tools is not None
        return [ChoiceStream(state.tokenizer, (), tools, prompt.starts_in_reasoning, parse_tools)]

    def on_done(final: ResponseOut) -> None:
        if body.store:
            state.responses.put(final.model_dump(mode="json"), items)

    head = _in_progress(response_id, state, body, data, params.temperature, params.top_p)
    writer = ResponsesWriter(head, body.parallel_tool_calls, _token_counter(state), on_done)
    return await serve(
        request, state, [gen], choices, writer, _FIELD_NAMES, stream=body.stream, arrival=arrival
    )


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response, as it was returned."""
    return _json(json.dumps(server_state(request).responses.get(response_id).response))


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    """Forget a stored response (a 404 when there is none)."""
    store = server_state(request).responses
    store.get(response_id)  # the 404
    store.delete(response_id)
    return _json(DeletedResponse(id=response_id).model_dump_json())


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Response:
    """The items a stored response was generated from (earlier turns included), a page
    of `limit` after the item `after`, newest first unless order is asc."""
    items = server_state(request).responses.get(response_id).items
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start : start + limit]
    listing = ResponseItemList(
        data=page,
        first_id=page[0]["id"] if page else "",
        last_id=page[-1]["id"] if page else "",
        has_more=start + limit < len(items),
    )
    return _json(listing.model_dump_json())


def output_spec(body: CreateResponseRequest) -> OutputSpec:
    """The request's tool_choice and text.format in the pipeline's terms."""
    choice: Any = body.tool_choice or "auto"
    name = None
    if isinstance(choice, NamedFunctionIn):
        choice, name = "named", choice.name
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None:
        wire: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            schema = fmt.model_dump(include={"name", "schema_", "strict"}, by_alias=True)
            wire["json_schema"] = {k: v for k, v in schema.items() if v is not None}
        response_format = ResponseFormat.model_validate(wire)
    return OutputSpec(choice, name, body.parallel_tool_calls, response_format)


def _in_progress(
    response_id: str,
    state: ServerState,
    body: CreateResponseRequest,
    data: dict[str, Any],
    temperature: float,
    top_p: float,
) -> ResponseOut:
    """The response before any output: what the request asked for, echoed."""
    tool_choice = data.get("tool_choice", "auto")
    tools = [{"parameters": None, "strict": None, **tool} for tool in data.get("tools", [])]
    return ResponseOut(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=state.model_name,
        output=[],
        parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        reasoning={"effort": None, "summary": None, **data.get("reasoning", {})},
        store=body.store,
        temperature=temperature,
        top_p=top_p,
        text={"format": data.get("text", {}).get("format", {"type": "text"})},
        tool_choice=tool_choice,
        tools=tools,
        metadata=body.metadata or {},
    )


def _token_counter(state: ServerState) -> Any:
    def count(text: str) -> int:
        return len(state.tokenizer.encode(text)) if text else 0

    return count


def _json(text: str) -> Response:
    return Response(text, media_type="application/json")
