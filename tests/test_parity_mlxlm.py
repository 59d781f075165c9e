"""Our Qwen3.5 forward and greedy decode against mlx-lm's, on every test checkpoint layout.

mlx-lm is an independent implementation (its own loader, norm handling, MoE, DeltaNet
kernel). It is run in float32 (`set_dtype`): bf16 would add ~1e-2 noise of its own, and
its MoE GatherMM is float32-only on CPU. Quantized checkpoints stay quantized in mlx-lm
(float32 scales), while ours dequantizes them at load: same values, different matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from parity_utils import full_logits, greedy_ours, prompt_ids, rel_error

from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

# Relative logit error bound, max|ours - ref| / max|ref|. Measured 2.4e-6 .. 5.6e-6 on
# this CPU (logits up to ~140, abs errors 3e-4 .. 7e-4: float32 accumulation order over
# 8 layers and a 248k-row head; the worst is tiny-tied). 5e-5 leaves a ~10x margin; a real
# bug (norm shift, rotary layout, conv tap, expert routing) moves logits by O(1), i.e.
# >= 1e-2 relative (a rotary position off by one token already gives ~4e-2).
REL_TOL = 5e-5
GREEDY_TOKENS = 32

Pair = tuple[LoadedModel, nn.Module]


@pytest.fixture(scope="module")
def models() -> Iterator[Callable[[str], Pair]]:
    """name -> (our model, mlx-lm float32 model), each loaded once per module."""
    from mlx_lm.utils import load_model as mlxlm_load  # test-only dependency

    cache: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in cache:
            path = cached_checkpoint(name)
            reference, _ = mlxlm_load(Path(path))
            reference.set_dtype(mx.float32)
            cache[name] = (load_model(str(path)), reference)
        return cache[name]

    yield get
    cache.clear()


def _reference_logits(reference: nn.Module, ids: list[int]) -> mx.array:
    logits = reference(mx.array([ids]))[0].astype(mx.float32)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize(
    "name",
    ["tiny", "tiny-tied", "tiny-moe", "tiny-mlx-4bit", "tiny-mlx-8bit", "tiny-moe-mlx-4bit"],
)
def test_teacher_forced_logits_match_mlxlm(models: Callable[[str], Pair], name: str) -> None:
    """Logits at every prompt position equal mlx-lm's within REL_TOL, per checkpoint layout."""
    ours, reference = models(name)
    ids = prompt_ids()
    expected = _reference_logits(reference, ids)
    got = full_logits(ours, ids)
    assert rel_error(got, expected) <= REL_TOL
    assert mx.array_equal(got.argmax(-1), expected.argmax(-1)).item()


def test_per_expert_layout_matches_mlxlm_fused(models: Callable[[str], Pair]) -> None:
    """Our load of the per-expert MoE layout equals mlx-lm on the fused layout (same weights).

    mlx-lm 0.32.2 cannot read per-expert Qwen3.5 checkpoints (it reports the 192
    `mlp.experts.{e}.*` tensors as unknown), so its reference is tiny-moe: the writer draws
    every expert tensor from its own (seed, name) stream, so both layouts hold identical values.
    """
    _, reference = models("tiny-moe")
    ours = load_model(str(cached_checkpoint("tiny-moe-per-expert")))
    ids = prompt_ids()
    assert rel_error(full_logits(ours, ids), _reference_logits(reference, ids)) <= REL_TOL


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-mlx-4bit"])
def test_greedy_continuation_matches_mlxlm(models: Callable[[str], Pair], name: str) -> None:
    """32 greedy tokens from our engine equal mlx-lm's generate_step token for token."""
    from mlx_lm.generate import generate_step

    ours, reference = models(name)
    ids = prompt_ids()
    # generate_step never stops on EOS (like ignore_eos); sampler=None is argmax.
    steps = generate_step(mx.array(ids), reference, max_tokens=GREEDY_TOKENS)
    expected = [int(token) for token, _ in steps]
    assert len(expected) == GREEDY_TOKENS
    assert greedy_ours(ours, ids, GREEDY_TOKENS) == expected
