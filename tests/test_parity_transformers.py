"""Our Qwen3.5 forward and greedy decode against transformers' reference implementation.

transformers reads the HF-layout checkpoint (vision tower and all) into
Qwen3_5(Moe)ForConditionalGeneration in float32 on CPU. Without the fla / causal-conv1d
kernels it runs its pure-PyTorch fallbacks: torch_chunk_gated_delta_rule (64-token
chunks) for every prefill and torch_recurrent_gated_delta_rule for cached decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
import pytest
from parity_utils import full_logits, greedy_ours, long_ids, prompt_ids, rel_error

from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.chat_format import ENDOFTEXT_ID
from deltaserve.models.testing import cached_checkpoint

# Relative logit error bound, max|ours - ref| / max|ref| (the brief's 1e-4 target).
# Measured on this CPU: 6.2e-6 .. 8.6e-6 dense, 6.4e-6 .. 6.6e-6 MoE, 1.0e-5 tied (its
# louder residual writers give abs errors up to 1.3e-3 on logits up to ~140): float32
# summation order, and two chunked DeltaNets with different blockings. 1e-4 leaves a
# ~10x margin over the worst case and still catches any real bug, which moves logits by
# O(1) (>= 1e-2 relative; a rotary position off by one token already gives ~4e-2).
REL_TOL = 1e-4
LONG_PROMPT = 300  # > 4 chunks of 64: both chunked DeltaNets carry state across chunks
GREEDY_TOKENS = 32

Pair = tuple[LoadedModel, object]  # (ours, transformers PreTrainedModel)


@pytest.fixture(scope="module")
def models() -> Iterator[Callable[[str], Pair]]:
    """name -> (our model, transformers float32 model), each loaded once per module."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
    )

    cache: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in cache:
            path = cached_checkpoint(name)
            moe = "moe" in name
            cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
            reference = cls.from_pretrained(path, dtype=torch.float32).eval()
            # The checkpoint's generation_config samples (top_k 20, top_p 0.95) and stops
            # on EOS; generate() fills unset fields from it, so replace it: greedy, no EOS.
            reference.generation_config = GenerationConfig(
                do_sample=False, eos_token_id=None, pad_token_id=ENDOFTEXT_ID
            )
            cache[name] = (load_model(str(path)), reference)
        return cache[name]

    yield get
    cache.clear()


def _reference_logits(reference: object, ids: list[int]) -> mx.array:
    import torch

    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids])).logits[0]
    return mx.array(logits.float().numpy())


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "tiny-moe"])
def test_teacher_forced_logits_match_transformers(models: Callable[[str], Pair], name: str) -> None:
    """Logits at every position of a ~40-token prompt equal transformers' within REL_TOL."""
    ours, reference = models(name)
    ids = prompt_ids()
    expected = _reference_logits(reference, ids)
    got = full_logits(ours, ids)
    assert rel_error(got, expected) <= REL_TOL
    assert mx.array_equal(got.argmax(-1), expected.argmax(-1)).item()


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_long_prompt_logits_match_transformers(models: Callable[[str], Pair], name: str) -> None:
    """A 300-token prompt (5 DeltaNet chunks on both sides) matches at every position."""
    ours, reference = models(name)
    ids = long_ids(LONG_PROMPT)
    expected = _reference_logits(reference, ids)
    got = full_logits(ours, ids)
    assert rel_error(got, expected) <= REL_TOL
    # Per 64-token block too (relative to that block's scale), naming a drifting chunk.
    for start in range(0, LONG_PROMPT, 64):
        block = slice(start, start + 64)
        assert rel_error(got[block], expected[block]) <= REL_TOL, f"chunk at {start}"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_greedy_continuation_matches_transformers(models: Callable[[str], Pair], name: str) -> None:
    """32 greedy tokens from our engine equal transformers' generate(do_sample=False)."""
    import torch

    ours, reference = models(name)
    ids = prompt_ids()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS)
    expected = out[0, len(ids) :].tolist()
    assert len(expected) == GREEDY_TOKENS  # no EOS stop: the greedy run is full length
    assert greedy_ours(ours, ids, GREEDY_TOKENS) == expected
