"""Anthropic Messages input -> the OpenAI-shaped dicts the chat prompt path takes.

One prompt path serves both protocols (server/prompts.py), so Anthropic's blocks become
what an OpenAI client would have sent for the same conversation:

- `system` (a string or text blocks) -> a leading system message;
- user text / image blocks -> a user message with text and image_url parts (a base64
  source becomes a data: URL, a url source its URL); the ImageRefs keep Anthropic's
  field path (messages[i].content[j].source) for a 400's message;
- tool_result blocks -> "tool" messages (the template writes them as tool responses);
- assistant text -> content, thinking -> reasoning_content (redacted thinking is dropped:
  it cannot be read back), tool_use -> tool_calls with the input as arguments;
- tools (name, description, input_schema) -> function tools.

Input is the JSON-decoded request (dicts), already shape-checked by server/messages_api.
"""

from __future__ import annotations

from typing import Any

from deltaserve.server.frontend.messages import ImageRef, PromptError


def system_message(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The system prompt as a leading message ([] when there is none)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b["text"] for b in system)
    return [{"role": "system", "content": text}]


def to_openai_messages(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Anthropic messages as OpenAI chat messages, and their images in prompt order."""
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif message["role"] == "user":
            out += _user_turn(content, f"messages[{i}]", refs)
        else:
            out.append(_assistant_turn(content, f"messages[{i}]"))
    return out, refs


def to_openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Anthropic tool definitions as OpenAI function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool.get("description") or "",
                "parameters": tool["input_schema"],
            },
        }
        for tool in tools or []
    ]


def _user_turn(blocks: list[dict[str, Any]], where: str, refs: list[ImageRef]) -> list[dict]:
    """Tool results become tool messages; text and images between them user messages."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind, here = block["type"], f"{where}.content[{j}]"
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, here))
        elif kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            url = _image_url(block["source"])
            refs.append(ImageRef(url, f"{here}.source"))
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise PromptError(f"a user message cannot carry a {kind!r} block", here)
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "thinking":
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            function = {"name": block["name"], "arguments": block["input"]}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind != "redacted_thinking":
            message = f"an assistant message cannot carry a {kind!r} block"
            raise PromptError(message, f"{where}.content[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        if any(part["type"] != "text" for part in content):
            raise PromptError("images in tool results are not supported", f"{where}.content")
        content = "".join(part["text"] for part in content)
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _image_url(source: dict[str, Any]) -> str:
    """A base64 source as a data: URL (server/images.py decodes those), or the URL."""
    if source["type"] == "base64":
        return f"data:{source['media_type']};base64,{source['data']}"
    return source["url"]
