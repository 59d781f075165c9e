"""Where prefill chunks of a prompt with images end, and what the scheduler reserves.

Pure policy: PromptMedia.cut decides which images' tower passes a chunk pays for (in
prefill-token equivalents) and where the chunk then ends; the scheduler holds the tower's
memory from admission until the prompt's prefill ends.
"""

from __future__ import annotations

import numpy as np

from engine.cache.budget import MemoryBudget, StateCosts
from engine.config import EngineConfig
from engine.media import MIN_TOKENS_WITH_IMAGE, PromptMedia
from engine.scheduler import Scheduler
from engine.types import GenerationRequest, ImageInput, SamplingParams


def _media(spans: list[tuple[int, int]], costs: list[int], length: int = 200) -> PromptMedia:
    images = tuple(
        ImageInput(np.zeros((4 * (b - a), 8), np.float32), (1, 2, 2 * (b - a)), b - a, str(i))
        for i, (a, b) in enumerate(spans)
    )
    return PromptMedia(
        images=images,
        spans=tuple(spans),
        positions=np.zeros((3, length), np.int32),
        rope_delta=-5,
        key_ids=tuple(range(length)),
        vision_tokens=tuple(costs),
        vision_bytes=1000,
    )


def test_a_chunk_that_can_pay_takes_the_image_and_its_tokens() -> None:
    media = _media([(10, 30)], [50])
    assert media.cut(0, 0, 64, 200) == (64, (0,))


def test_a_chunk_that_cannot_pay_stops_before_the_image() -> None:
    media = _media([(10, 30)], [500])
    assert media.cut(0, 0, 64, 100) == (10, ())


def test_a_chunk_starting_at_an_unpaid_image_pays_whatever_the_budget() -> None:
    """The prompt must advance: the tower runs, with a minimum of tokens after it."""
    media = _media([(10, 30)], [500])
    assert media.cut(0, 10, 74, 100) == (10 + MIN_TOKENS_WITH_IMAGE, (0,))
    assert media.cut(0, 10, 74, 540) == (50, (0,))  # the budget past the tower's cost


def test_paid_images_are_not_charged_again_and_later_ones_wait() -> None:
    media = _media([(10, 30), (40, 60)], [30, 100])
    assert media.cut(1, 20, 84, 90) == (40, ())  # inside image 0 (paid); image 1 too dear
    assert media.cut(0, 0, 84, 120) == (40, (0,))
    assert media.first_needed(30) == 1 and media.first_needed(29) == 0


def _scheduler(budget_bytes: int) -> Scheduler:
    budget = MemoryBudget(budget_bytes, StateCosts(kv_bytes_per_token=10, ssm_bytes_per_row=100))
    config = EngineConfig(max_num_batched_tokens=64, max_prefill_chunk=64, prefix_cache=False)
    return Scheduler(config, budget, max_context=4096)


def test_the_tower_memory_is_held_until_the_prefill_ends() -> None:
    media = _media([(10, 30)], [5], length=40)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    scheduler = _scheduler(100_000)
    scheduler.add(GenerationRequest("r", tuple(range(40)), params), frozenset(), media)
    row = 100 + 10 * 44
    out = scheduler.schedule()
    assert out.prefill[0].vision == (0,) and out.prefill[0].vision_tokens == 5
    assert scheduler.budget.reserved == row + 1000
    scheduler.update(out, [7], [None])
    out = scheduler.schedule()  # the row joins the decode batch: its prefill has ended
    assert scheduler.budget.reserved == row
    assert out.decode_positions == (40 - 5,)  # sequence index + rope delta
