"""Chat prompts for the chat-templated protocols (chat completions and Anthropic messages):
OpenAI-shaped messages and tools -> images loaded, template rendered, token ids.

Both protocols hand over OpenAI-shaped message dicts (the Anthropic adapter converts its
blocks first, server/frontend/anthropic.py), so images, templates and the prefix hint
work one way. Images: user messages' image parts are fetched, decoded and preprocessed in
the same worker-thread hop as the template (server/images.py); each becomes its image-pad
tokens in the prompt and an ImageInput for the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from deltaserve.engine.types import ImageInput
from deltaserve.server.frontend.messages import ImageRef, PromptError, image_refs
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.images import load_images, processor_config
from deltaserve.server.pipeline import OutputSpec
from deltaserve.server.routes_common import ServerState
from deltaserve.server.settings import ImageSettings


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat prompt ready for the engine."""

    ids: list[int]
    starts_in_reasoning: bool  # the prompt ends inside an opened <think>
    history: int  # the prefix hint: tokens of the messages without the generation prompt
    images: tuple[ImageInput, ...]


async def render_prompt(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    refs: Sequence[ImageRef] | None = None,
) -> RenderedPrompt:
    """Render `messages` (OpenAI-shaped) off the event loop: images, templates and
    tokenizers are CPU work. refs: the image parts as the client named them (default:
    OpenAI image_url parts of `messages`), in prompt order."""
    settings = state.settings.images
    return await run_in_threadpool(
        _render, state.tokenizer, settings, messages, tools, template_kwargs, refs
    )


def _render(
    tokenizer: TextTokenizer,
    settings: ImageSettings,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    refs: Sequence[ImageRef] | None,
) -> RenderedPrompt:
    """Load the messages' images, then render and tokenize the prompt around them."""
    refs = image_refs(messages) if refs is None else refs
    if refs and tokenizer.image_pad_id is None:
        raise PromptError("this model does not take images", refs[0].param)
    images = load_images(refs, settings, processor_config(tokenizer.model_dir)) if refs else ()
    tokens = [image.num_tokens for image in images] if refs else None  # None: text only
    ids, starts_in_reasoning, history = tokenizer.render_chat_with_history(
        messages, tools, kwargs, tokens
    )
    return RenderedPrompt(ids, starts_in_reasoning, history, images)


def template_tools(
    tools: list[dict[str, Any]] | None, spec: OutputSpec
) -> list[dict[str, Any]] | None:
    """The tools (OpenAI function shape) the chat template gets, per the tool choice:
    "none" hides them (and output is not parsed for calls); "required" sends them all,
    "named" only the named one (and output_constraint forces the call by grammar)."""
    if not tools or spec.tool_choice == "none":
        return None
    if spec.tool_choice == "named":
        return [tool for tool in tools if tool["function"]["name"] == spec.tool_name]
    return tools
