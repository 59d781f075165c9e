"""The text side of the server: prompts in, OpenAI-shaped output pieces out. No MLX here.

Map of the package (one concept per module):

- tokenizer:    TextTokenizer — encode/decode, EOS ids, chat template rendering
                (render_chat -> prompt ids + "prompt ends inside <think>").
- messages:     OpenAI messages/tools -> template dicts; PromptError (HTTP 400).
- detokenizer:  IncrementalDetokenizer — token ids -> text deltas, never half a character.
- stops:        StopStringMatcher — cut text at the first stop string, never leak it.
- reasoning:    ReasoningParser — split `<think>` reasoning from content.
- tools:        ToolCallParser / parse_tool_calls — Qwen3.5 XML tool calls -> JSON args.
- tool_schema:  parameter types from tool JSON schemas; typing of generated values.
- pieces:       Text / ToolCallStart / ToolCallArgs, and the one rule merging them.
- choice:       ChoiceStream — the whole pipeline for one choice of a request.
- anthropic:    Anthropic Messages (system, blocks, tools) -> the OpenAI-shaped dicts above.

Data flow for one choice: engine RequestOutput.token_ids -> detokenizer -> stop strings
-> reasoning split -> tool-call parsing (content only) -> ChoiceDelta (ordered pieces).
"""

from deltaserve.server.frontend.choice import (
    ChoiceDelta,
    ChoiceResult,
    ChoiceStream,
    LogprobEntry,
    ToolCallChunk,
    TopLogprob,
)
from deltaserve.server.frontend.detokenizer import IncrementalDetokenizer
from deltaserve.server.frontend.messages import PromptError
from deltaserve.server.frontend.pieces import Piece, Text, merge_pieces
from deltaserve.server.frontend.reasoning import Delta, ReasoningParser
from deltaserve.server.frontend.stops import StopStringMatcher
from deltaserve.server.frontend.tokenizer import TextTokenizer
from deltaserve.server.frontend.tools import (
    ToolCall,
    ToolCallArgs,
    ToolCallParser,
    ToolCallStart,
    ToolDelta,
    parse_tool_calls,
)

__all__ = [
    "ChoiceDelta",
    "ChoiceResult",
    "ChoiceStream",
    "Delta",
    "IncrementalDetokenizer",
    "LogprobEntry",
    "Piece",
    "PromptError",
    "ReasoningParser",
    "StopStringMatcher",
    "Text",
    "TextTokenizer",
    "ToolCall",
    "ToolCallArgs",
    "ToolCallChunk",
    "ToolCallParser",
    "ToolCallStart",
    "ToolDelta",
    "TopLogprob",
    "merge_pieces",
    "parse_tool_calls",
]
