"""Shared helpers of the parity tests (vs mlx-lm, vs transformers) and the incremental
forward tests: real-text prompts, our model's forward and greedy decode, error metrics."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import SamplingParams
from deltaserve.models.build import LoadedModel
from deltaserve.models.state import ForwardGroup, text_positions
from deltaserve.models.testing import cached_checkpoint

# Plain English with digits, punctuation and a little code: ~40 tokens of the real
# Qwen3.5 tokenizer, so the embedding rows read are the ones real prompts read.
PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Einstein published four "
    "papers that changed physics: the photoelectric effect, Brownian motion and more. "
    "Who was he, and why?"
)
# Varied paragraphs for prompts of a few hundred tokens (several 64-token DeltaNet chunks).
LONG_TEXT = (
    "Gated DeltaNet layers keep a fixed-size recurrent state per head instead of a growing "
    "key-value cache, so their memory does not depend on the length of the conversation. "
    "Every fourth layer of Qwen3.5 is still full attention with rotary position embeddings, "
    "which lets the model look back precisely at any earlier token when it needs to.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n"
    "    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "Le renard brun rapide saute par-dessus le chien paresseux. Der schnelle braune Fuchs "
    "springt über den faulen Hund. 敏捷的棕色狐狸跳过了懒狗。\n\n"
    "Measured on 2024-03-14 at 09:26:53 UTC: 3.14159 radians, 2.71828 nepers, 1.41421 "
    "metres; the total came to $1,234.56 (plus 7.5% tax), i.e. $1,327.15 overall. "
    "Questions? Write to support@example.com or call +1 (555) 010-9999 before Friday. "
    "A long time ago, in a galaxy far, far away, a small ship carried secret plans across "
    "the stars while its pilot hummed an old song about rivers, mountains and the sea. "
    "Meanwhile, the committee reviewed seventeen proposals, rejected eleven, deferred "
    "four and approved the remaining two with minor amendments to their budgets."
)


@functools.cache
def _tokenizer():  # noqa: ANN202  (tokenizers.Tokenizer)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(cached_checkpoint("tiny") / "tokenizer.json"))


def encode(text: str) -> list[int]:
    """Token ids of `text` under the real Qwen3.5 tokenizer (no special tokens)."""
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def prompt_ids() -> list[int]:
    """The ~40-token teacher-forcing / greedy prompt."""
    return encode(PROMPT_TEXT)


def long_ids(length: int) -> list[int]:
    """The first `length` tokens of LONG_TEXT (+ PROMPT_TEXT) as one prompt."""
    ids = encode(LONG_TEXT + "\n\n" + PROMPT_TEXT)
    assert len(ids) >= length, f"LONG_TEXT has only {len(ids)} tokens"
    return ids[:length]


def forward(
    loaded: LoadedModel,
    state: BatchState,
    rows: Sequence[Sequence[int]],
    offsets: Sequence[int],
    left_pad: tuple[int, ...] | None = None,
) -> mx.array:
    """One forward of equal-length `rows` (already left-padded) through `state`.

    offsets[b] is row b's position of column 0 (negative by the padding for padded rows,
    so its first real token sits at its true position). Returns float32 logits [B, L, V].
    """
    tokens = mx.array([list(r) for r in rows], dtype=mx.int32)
    positions = text_positions(list(offsets), tokens.shape[1])
    group = ForwardGroup(tokens, positions, state.layers, left_pad)
    (hidden,) = loaded.model([group])
    logits = loaded.model.logits(hidden)
    mx.eval(logits)
    return logits


def full_logits(loaded: LoadedModel, ids: Sequence[int]) -> mx.array:
    """Teacher-forced logits [L, V] of one prompt, in one forward from a fresh state."""
    return forward(loaded, BatchState.empty(loaded.config), [ids], [0])[0]


def rel_error(ours: mx.array, ref: mx.array) -> float:
    """max |ours - ref| / max |ref|: worst absolute logit error in units of the logit scale."""
    ours, ref = ours.astype(mx.float32), ref.astype(mx.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()


def greedy_ours(loaded: LoadedModel, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy continuation through the real engine (scheduler, runner, sampler)."""
    engine = LLMEngine(loaded, EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (completion,) = engine.generate([list(prompt)], params)
    return list(completion.token_ids)
