"""OpenAI chat messages -> the plain dicts a Hugging Face chat template expects.

The server hands us OpenAI-shaped dicts; templates want simpler ones: text-only content
as one string, a "developer" turn as "system", and tool-call arguments as a mapping
(OpenAI sends them as a JSON string). Bad input raises PromptError, an HTTP 400 naming
the offending field.
"""

from __future__ import annotations

import json
from typing import Any

from engine.types import InvalidRequestError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class PromptError(InvalidRequestError):
    """The messages (or tools) cannot be turned into a prompt; `param` names the field."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and convert them for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    return [_normalize_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def normalize_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Check the tool list's shape; None or [] means no tools."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise PromptError("tools must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PromptError("each tool needs a function with a name", f"tools[{i}]")
    return tools


def _normalize_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise PromptError("each message must be an object", where)
    role = message.get("role")
    if role not in ROLES:
        raise PromptError(f"unsupported role {role!r}", f"{where}.role")
    # Chat templates know "system"; "developer" is OpenAI's newer name for it.
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = content_text(message.get("content"), f"{where}.content")
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return out


def content_text(content: Any, where: str) -> str:
    """A message's content as one string; only text parts are supported."""
    if content is None:
        return ""  # an assistant turn that only calls tools
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError("content must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = {"text": "text", "refusal": "refusal"}.get(kind or "")
        if field is None or not isinstance(part.get(field), str):
            raise PromptError(
                f"content part type {kind!r} is not supported (text only)", f"{where}[{j}]"
            )
        texts.append(part[field])
    # Joined without a separator, as Qwen3.5's template renders a list of text parts.
    return "".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise PromptError("tool_calls must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PromptError("a tool call needs a function with a name", f"{where}[{i}]")
        arguments = _arguments(function.get("arguments"), f"{where}[{i}].function.arguments")
        converted = {
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
        if isinstance(call.get("id"), str):
            converted["id"] = call["id"]
        out.append(converted)
    return out


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    """OpenAI's JSON-string arguments as the mapping templates iterate over."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise PromptError(f"tool call arguments are not valid JSON: {error}", where) from None
    if not isinstance(arguments, dict):
        raise PromptError("tool call arguments must be a JSON object", where)
    return arguments
