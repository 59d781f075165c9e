"""OpenAI chat messages -> the plain dicts a Hugging Face chat template expects.

The server hands us OpenAI-shaped dicts; templates want simpler ones: text-only content
as one string, a "developer" turn as "system", and tool-call arguments as a mapping
(OpenAI sends them as a JSON string). A user message with image_url parts keeps its parts,
as `{"type": "image"}` and `{"type": "text", "text": ...}` items (the template writes an
image's placeholder tokens for the first). Bad input raises PromptError, an HTTP 400
naming the offending field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.types import InvalidRequestError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class PromptError(InvalidRequestError):
    """The messages (or tools) cannot be turned into a prompt; `param` names the field."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class ImageRef:
    """One image_url part of a request: its URL and where it was (for a 400's param)."""

    url: str
    param: str  # "messages[1].content[0].image_url"


def normalize_messages(
    messages: list[dict[str, Any]], allow_images: bool = False
) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and convert them for the chat template.

    allow_images: keep user messages' image parts as template items; without it an image
    part is refused (a caller that does not load images)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    return [
        _normalize_message(message, f"messages[{i}]", allow_images)
        for i, message in enumerate(messages)
    ]


def image_refs(messages: list[dict[str, Any]]) -> list[ImageRef]:
    """The image_url parts of `messages`, in prompt order. Only user messages may carry
    images; a part without a URL is refused."""
    refs = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not _is_image(part):
                continue
            where = f"messages[{i}].content[{j}]"
            _check_image_role(message.get("role"), where)
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise PromptError("an image_url part needs image_url.url", f"{where}.image_url")
            refs.append(ImageRef(url, f"{where}.image_url"))
    return refs


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


def _normalize_message(message: dict[str, Any], where: str, allow_images: bool) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise PromptError("each message must be an object", where)
    role = message.get("role")
    if role not in ROLES:
        raise PromptError(f"unsupported role {role!r}", f"{where}.role")
    # Chat templates know "system"; "developer" is OpenAI's newer name for it.
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _content(message.get("content"), role, f"{where}.content", allow_images)
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


def _content(content: Any, role: str, where: str, allow_images: bool) -> str | list[dict]:
    """Template content: one string, or for a user message with images its items."""
    if not (allow_images and isinstance(content, list) and any(map(_is_image, content))):
        return content_text(content, where)
    items: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if _is_image(part):
            _check_image_role(role, f"{where}[{j}]")
            items.append({"type": "image"})
        else:
            items.append({"type": "text", "text": _part_text(part, f"{where}[{j}]")})
    return items


def content_text(content: Any, where: str) -> str:
    """A message's content as one string; only text parts are supported."""
    if content is None:
        return ""  # an assistant turn that only calls tools
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError("content must be a string or a list of content parts", where)
    # Joined without a separator, as Qwen3.5's template renders a list of text parts.
    return "".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    field = {"text": "text", "refusal": "refusal"}.get(kind or "")
    if field is None or not isinstance(part.get(field), str):
        raise PromptError(f"content part type {kind!r} is not supported here", where)
    return part[field]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _check_image_role(role: Any, where: str) -> None:
    if role != "user":
        raise PromptError(f"only user messages may carry images, not a {role} message", where)


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
