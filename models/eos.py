"""The token ids that end a generation, resolved once from a checkpoint directory.

The loader puts them in the text config (the engine stops on them) and the server receives
the same ids from the engine: one source for a fact that two readers once disagreed on.
"""

from __future__ import annotations

import json
from pathlib import Path


def resolve_eos_ids(path: Path, raw_config: dict | None = None) -> tuple[int, ...]:
    """The ids that end a generation, from the first source that names any:
    generation_config.json, then config.json (top level and text_config), then the
    tokenizer's eos_token. Published Qwen3.5 checkpoints name only <|endoftext|> in
    config.json; <|im_end|>, which ends every chat turn, is in generation_config.json.
    """
    generation = path / "generation_config.json"
    if generation.is_file():
        ids = _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
        if ids:
            return ids
    ids = _as_ids(raw_config.get("eos_token_id"))
    ids += _as_ids((raw_config.get("text_config") or {}).get("eos_token_id"))
    if ids:
        return tuple(dict.fromkeys(ids))
    return _tokenizer_eos_ids(path)


def _tokenizer_eos_ids(path: Path) -> tuple[int, ...]:
    """tokenizer_config.json's eos_token, looked up among tokenizer.json's added tokens."""
    config_file, vocab_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config_file.is_file() and vocab_file.is_file()):
        return ()
    eos = json.loads(config_file.read_text()).get("eos_token")
    content = eos.get("content") if isinstance(eos, dict) else eos
    added = json.loads(vocab_file.read_text()).get("added_tokens", [])
    return tuple(t["id"] for t in added if t.get("content") == content)


def _as_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()
