"""Responses API input -> item resources (what is stored and listed) -> the OpenAI chat
messages the one prompt path takes (server/prompts.py).

Two steps, so a stored conversation and a new request convert one way:

1. `item_resources`: the request's items (already shape-checked by server/responses_api)
   as the spec's item resources, each with an id: a string input is one user message,
   text content becomes input_text (output_text for assistant messages), function calls
   and their outputs keep their call_id. These are what GET .../input_items lists and
   what previous_response_id continues from (with the earlier response's output items).
2. `chat_messages`: item resources as chat messages, as a chat client would have sent
   the same conversation: `instructions` -> a leading system message; user / system /
   developer messages -> those roles (input_image -> an image_url part); a run of
   assistant-side items (reasoning, assistant message, function_call) -> one assistant
   message with reasoning_content, content and tool_calls; function_call_output -> a
   "tool" message.

Function tools (flat in Responses) become chat's nested function tools.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from deltaserve.server.frontend.messages import ImageRef, PromptError

ASSISTANT_SIDE = ("reasoning", "function_call")  # and assistant messages
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def new_item_id(kind: str) -> str:
    """An id for a new item of type `kind` (msg_…, fc_…, rs_…)."""
    return f"{_ID_PREFIXES[kind]}_{secrets.token_hex(12)}"


def item_resources(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as item resources with ids (see the module docstring)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    return [_resource(item) for item in items]


def _resource(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out: dict[str, Any] = {"id": item.get("id") or new_item_id(kind), "type": kind}
    if kind == "message":
        is_assistant = item["role"] == "assistant"
        content = item["content"]
        if isinstance(content, str):
            content = [{"type": "output_text" if is_assistant else "input_text", "text": content}]
        if is_assistant:
            content = [_output_part(part) for part in content]
        out.update(role=item["role"], content=content)
    elif kind == "function_call":
        out.update(call_id=item["call_id"], name=item["name"], arguments=item["arguments"])
    elif kind == "function_call_output":
        out.update(call_id=item["call_id"], output=item["output"])
    else:  # reasoning
        out.update(summary=item.get("summary", []), content=item.get("content", []))
    return {**out, "status": "completed"}


def _output_part(part: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's part as output content (input_text is taken as text)."""
    if part["type"] == "refusal":
        return part
    if part["type"] not in ("output_text", "input_text"):
        raise PromptError(f"an assistant message cannot carry {part['type']!r}", "input")
    return {"type": "output_text", "text": part["text"], "annotations": [], "logprobs": []}


def chat_messages(
    items: list[dict[str, Any]], instructions: str | None, where: list[str]
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Item resources as chat messages, and their images in prompt order.

    where: each item's place in the request, for a 400's param ("input[2]", or
    "previous_response_id" for items it brought)."""
    out: list[dict[str, Any]] = [] if instructions is None else [_system(instructions)]
    refs: list[ImageRef] = []
    assistant: dict[str, Any] | None = None  # the open assistant turn
    for item, here in zip(items, where, strict=True):
        kind = item["type"]
        if kind in ASSISTANT_SIDE or (kind == "message" and item["role"] == "assistant"):
            if assistant is None or (assistant.get("tool_calls") and kind != "function_call"):
                assistant = {"role": "assistant", "content": ""}
                out.append(assistant)
            _add_to_turn(assistant, item, here)
            continue
        assistant = None
        if kind == "function_call_output":
            out.append(_tool_result(item, here))
        else:
            out.append(_message(item, here, refs))
    return out, refs


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses function tools (flat) as chat's function tools."""
    return [
        {
            "type": "function",
            "function": {
                key: tool[key]
                for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None
            },
        }
        for tool in tools or []
    ]


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def _message(item: dict[str, Any], where: str, refs: list[ImageRef]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(item["content"]):
        if part["type"] == "input_image":
            here = f"{where}.content[{j}].image_url"
            refs.append(ImageRef(part["image_url"], here))
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif part["type"] == "input_text":
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part["type"]
            raise PromptError(f"a {item['role']} message cannot carry {kind!r}", where)
    if all(part["type"] == "text" for part in parts):  # text only: one string
        return {"role": item["role"], "content": "".join(p["text"] for p in parts)}
    return {"role": item["role"], "content": parts}


def _add_to_turn(turn: dict[str, Any], item: dict[str, Any], where: str) -> None:
    kind = item["type"]
    if kind == "reasoning":
        text = "".join(part["text"] for part in item["content"] or item["summary"])
        turn["reasoning_content"] = turn.get("reasoning_content", "") + text
    elif kind == "function_call":
        arguments = _arguments(item["arguments"], f"{where}.arguments")
        function = {"name": item["name"], "arguments": arguments}
        call = {"id": item["call_id"], "type": "function", "function": function}
        turn.setdefault("tool_calls", []).append(call)
    else:
        text = "".join(part.get("text", part.get("refusal", "")) for part in item["content"])
        turn["content"] += text


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text) if text else {}
    except ValueError as error:
        raise PromptError(f"arguments are not valid JSON: {error}", where) from None
    if not isinstance(arguments, dict):
        raise PromptError("arguments must be a JSON object", where)
    return arguments


def _tool_result(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item["output"]
    if not isinstance(output, str):
        output = "".join(part["text"] for part in output)
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
