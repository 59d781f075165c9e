"""Where prefill chunks of a prompt with images end, and what the scheduler reserves.

Pure policy: PromptMedia.plan decides which tower blocks a chunk pays for (in
prefill-token equivalents) and where its tokens then end; the scheduler holds the
tower's memory from admission until the prompt's prefill ends.
"""

from __future__ import annotations

import numpy as np
from plan_utils import sampled

from deltaserve.engine.cache.budget import MemoryBudget, StateCosts
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.plan import VisionWork
from deltaserve.engine.scheduling.scheduler import Scheduler
from deltaserve.engine.types import GenerationRequest, ImageInput, SamplingParams
from deltaserve.engine.vision.media import PromptMedia, VisionPrice, VisionProgress


def _media(
    spans: list[tuple[int, int]], block_tokens: list[int], length: int = 200, depth: int = 4
) -> PromptMedia:
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
        depth=depth,
        block_tokens=tuple(block_tokens),
        vision_bytes=1000,
    )


START = VisionProgress()


def test_a_chunk_that_can_pay_runs_the_whole_tower_and_the_tokens_after() -> None:
    media = _media([(10, 30)], [10])  # 4 blocks of 10
    assert media.plan(START, 0, 64, 200, True) == (64, (VisionWork(0, 0, 4),), VisionProgress(1))
    assert media.cost(START, 64) == 40 and media.cost(START, 10) == 0


def test_tokens_stop_at_an_image_whose_tower_has_not_finished() -> None:
    """The budget after the text runs what blocks it affords; the rest waits."""
    media = _media([(10, 30)], [10])
    assert media.plan(START, 0, 64, 35, True) == (10, (VisionWork(0, 0, 2),), VisionProgress(0, 2))
    later = VisionProgress(0, 2)
    assert media.cost(later, 64) == 20
    assert media.plan(later, 10, 64, 25, True) == (15, (VisionWork(0, 2, 4),), VisionProgress(1))


def test_the_oldest_prompt_advances_one_block_whatever_the_budget() -> None:
    media = _media([(10, 30)], [500])
    assert media.plan(START, 10, 74, 100, True) == (
        10,
        (VisionWork(0, 0, 1),),
        VisionProgress(0, 1),
    )
    assert media.plan(START, 10, 74, 100, False) == (10, (), START)
    one_block = _media([(10, 30)], [500], depth=1)  # forced past the budget: no tokens after
    assert one_block.plan(START, 10, 74, 100, True) == (
        10,
        (VisionWork(0, 0, 1),),
        VisionProgress(1),
    )
    assert media.plan(START, 0, 74, 100, False) == (10, (), START)  # text before it runs


def test_encoded_images_are_not_charged_again_and_later_ones_wait() -> None:
    media = _media([(10, 30), (40, 60)], [5, 100])
    at_second = VisionProgress(1)
    assert media.plan(at_second, 20, 84, 90, False) == (40, (), at_second)
    assert media.plan(START, 0, 84, 70, False) == (40, (VisionWork(0, 0, 4),), at_second)
    assert media.first_needed(30) == 1 and media.first_needed(29) == 0


def test_blocks_cost_their_price_and_stop_at_its_limit() -> None:
    """The step-cost model's price: blocks cost scale x their estimate (rounded up, at
    least one token), and no more than `limit` estimated equivalents of them run."""
    media = _media([(10, 30)], [10])
    assert VisionPrice(2.5).block(10) == 25 and VisionPrice(0.01).block(10) == 1
    assert media.cost(START, 64, VisionPrice(2.5)) == 100
    assert media.plan(START, 10, 64, 60, True, VisionPrice(2.5)) == (
        10,
        (VisionWork(0, 0, 2),),
        VisionProgress(0, 2),
    )
    assert media.plan(START, 10, 64, 200, True, VisionPrice(1.0, limit=30)) == (
        10,
        (VisionWork(0, 0, 3),),
        VisionProgress(0, 3),
    )
    probe = VisionPrice(1.0, limit=0)  # nothing measured yet: the oldest runs one block
    assert media.plan(START, 10, 64, 200, True, probe) == (
        10,
        (VisionWork(0, 0, 1),),
        VisionProgress(0, 1),
    )
    assert media.plan(START, 10, 64, 200, False, probe) == (10, (), START)


def _scheduler(budget_bytes: int) -> Scheduler:
    budget = MemoryBudget(budget_bytes, StateCosts(kv_bytes_per_token=10, ssm_bytes_per_row=100))
    config = EngineConfig(max_num_batched_tokens=64, max_prefill_chunk=64, prefix_cache=False)
    return Scheduler(config, budget, max_context=4096)


def test_the_tower_memory_is_held_until_the_prefill_ends() -> None:
    media = _media([(10, 30)], [5], length=40, depth=1)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    scheduler = _scheduler(100_000)
    scheduler.add(GenerationRequest("r", tuple(range(40)), params), frozenset(), media)
    row = 100 + 10 * 44
    out = scheduler.schedule()
    assert out.prefill[0].vision == (VisionWork(0, 0, 1),)
    assert out.prefill[0].vision_tokens == 5
    assert scheduler.budget.reserved == row + 1000
    scheduler.update(out, sampled(out, [7]))
    out = scheduler.schedule()  # the row joins the decode batch: its prefill has ended
    assert scheduler.budget.reserved == row
    assert out.decode_positions == (40 - 5,)  # sequence index + rope delta
