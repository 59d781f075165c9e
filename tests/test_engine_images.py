"""Image rows in the batched engine: an image row is an ordinary row.

Image rows and text rows joining and leaving mid-flight give the tokens each gives
alone (an image's tokens spanning several chunks, cohorts of padded first chunks, n > 1
forks); the prefix cache keys on the image, not on its pad tokens; bad requests are
refused before any work. The tower sees random patches: the engine does not care what
the pixels are, only that the features land on the right tokens.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.types import (
    GenerationRequest,
    ImageInput,
    InvalidRequestError,
    SamplingParams,
)
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.rope_index import image_runs
from deltaserve.models.testing import cached_checkpoint

SMALL = EngineConfig(max_num_seqs=16, max_num_batched_tokens=48, max_prefill_chunk=24)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(str(cached_checkpoint(request.param)))


def image(seed: int, grid: tuple[int, int, int] = (1, 4, 6)) -> ImageInput:
    """Random patches of a (t, h, w) patch grid: t*h*w/4 tokens after the 2x2 merge."""
    rng = np.random.default_rng(seed)
    t, h, w = grid
    patches = rng.standard_normal((t * h * w, 3 * 2 * 16 * 16)).astype(np.float32)
    return ImageInput(patches, grid, t * h * w // 4, f"digest-{seed}-{grid}")


def prompt_with(loaded: LoadedModel, images: list[ImageInput], seed: int) -> list[int]:
    """Text, then each image as <|vision_start|> pads <|vision_end|> followed by text."""
    vision = loaded.vision_config
    rng = random.Random(seed)
    ids = [rng.randrange(100, 240000) for _ in range(rng.randrange(3, 30))]
    for im in images:
        ids += [vision.vision_start_token_id] + [vision.image_token_id] * im.num_tokens
        ids += [vision.vision_end_token_id]
        ids += [rng.randrange(100, 240000) for _ in range(rng.randrange(1, 20))]
    return ids


def _greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _request(loaded: LoadedModel, rid: str, images: list[ImageInput], seed: int, **kw):
    ids = prompt_with(loaded, images, seed)
    return GenerationRequest(rid, tuple(ids), _greedy(**kw), images=tuple(images))


def _run(engine: LLMEngine, joins: dict[int, list[GenerationRequest]]) -> dict:
    """Step the engine, adding requests at given steps; tokens per (request id, index)."""
    out: dict[tuple[str, int], list[int]] = {}
    cached: dict[str, int] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in joins):
        for req in joins.get(step, []):
            engine.add_request(req)
        for delta in engine.step():
            out.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
            cached[delta.request_id] = delta.num_cached_tokens
        step += 1
    out[("cached", 0)] = cached  # type: ignore[assignment]
    return out


def _alone(loaded: LoadedModel, req: GenerationRequest, config: EngineConfig = SMALL) -> list:
    return _run(LLMEngine(loaded, config), {0: [req]})[(req.request_id, 0)]


@pytest.mark.parametrize("batch_prefill", [False, True])
def test_image_and_text_rows_joining_mid_flight_equal_alone(
    loaded: LoadedModel, batch_prefill: bool
) -> None:
    """Image rows (one or two images, some spanning chunks) and text rows join while
    others decode; every row's greedy tokens equal its tokens alone."""
    config = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=64, max_prefill_chunk=24,
        batch_prefill=batch_prefill, prefix_cache=False,
    )  # fmt: skip
    reqs = [
        _request(loaded, "a", [image(1)], 1),
        _request(loaded, "b", [], 2),
        _request(loaded, "c", [image(2, (1, 8, 8)), image(3)], 3, max_tokens=5),
        _request(loaded, "d", [image(4, (1, 2, 2))], 4),
        _request(loaded, "e", [], 5, max_tokens=3),
    ]
    got = _run(LLMEngine(loaded, config), {0: reqs[:2], 2: reqs[2:4], 5: reqs[4:]})
    for req in reqs:
        assert got[(req.request_id, 0)] == _alone(loaded, req, config), req.request_id


def test_images_change_the_output(loaded: LoadedModel) -> None:
    """The features reach the model: another image changes the first token's top-20
    logprobs (the peaked checkpoints' top token itself rarely moves)."""
    ids = prompt_with(loaded, [image(1)], 7)
    outs = []
    for seed in (1, 2):
        req = GenerationRequest(
            f"r{seed}", tuple(ids), _greedy(1, logprobs=True, top_logprobs=20),
            images=(image(seed),),
        )  # fmt: skip
        engine = LLMEngine(loaded, SMALL)
        engine.add_request(req)
        outs += [d.logprobs[0].top for d in _steps(engine) if d.logprobs]
    assert outs[0] != outs[1]


def _steps(engine: LLMEngine) -> list:
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    return deltas


def test_forks_share_one_tower_pass(loaded: LoadedModel) -> None:
    """n = 3 forks of an image prompt decode greedily like the prompt alone."""
    req = _request(loaded, "f", [image(5)], 9)
    forked = GenerationRequest("g", req.prompt_ids, req.params, n=3, images=req.images)
    got = _run(LLMEngine(loaded, SMALL), {0: [forked]})
    ref = _alone(loaded, req)
    assert [got[("g", i)] for i in range(3)] == [ref] * 3


@pytest.mark.parametrize("pipeline", [False, True])
def test_an_image_row_that_ends_on_its_first_token_gives_its_memory_back(
    loaded: LoadedModel, pipeline: bool
) -> None:
    """In lockstep a row's first token is read back before the next step promotes it: a
    row that ends there (max_tokens=1) must not give the tower's reservation back twice
    (next to a decoding row, the pipelined engine runs such steps in lockstep too)."""
    config = dataclasses.replace(SMALL, pipeline_steps=pipeline, prefix_cache=False)
    engine = LLMEngine(loaded, config)
    joins = {0: [_request(loaded, "text", [], 3, max_tokens=12)]}
    joins[2] = [_request(loaded, "img", [image(4)], 5, max_tokens=1)]
    got = _run(engine, joins)
    assert len(got[("img", 0)]) == 1 and len(got[("text", 0)]) == 12
    assert engine.budget.reserved == 0


def test_prefix_cache_keys_on_the_image(loaded: LoadedModel) -> None:
    """Equal token ids with another image reuse only the text before the image (x2 after
    x1); the same image again resumes past it (x3 after x2, whose prompt was snapshotted
    at its last block boundary). Outputs equal a cacheless engine's."""
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32,
        prefix_block_tokens=8, prefix_min_tokens=1,
    )  # fmt: skip
    base = _request(loaded, "x1", [image(1, (1, 8, 8))], 11)
    ids = base.prompt_ids
    start = image_runs(np.asarray(ids), loaded.vision_config.image_token_id)[0][0]
    # a snapshot where the image starts, as a chat's history before a new image makes one
    first = GenerationRequest("x1", ids, base.params, prefix_hint=start, images=base.images)
    other = GenerationRequest("x2", ids, first.params, images=(image(2, (1, 8, 8)),))
    again = GenerationRequest("x3", ids, first.params, images=other.images)
    engine = LLMEngine(loaded, config)
    got = _run(engine, {0: [first], 30: [other], 60: [again]})
    cached = got[("cached", 0)]
    assert cached["x1"] == 0
    assert cached["x2"] == start
    assert cached["x3"] > start
    cold = EngineConfig(**{**config.__dict__, "prefix_cache": False})
    for req in (first, other, again):
        assert got[(req.request_id, 0)] == _alone(loaded, req, cold), req.request_id


def test_bad_image_requests_are_refused(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, SMALL)
    req = _request(loaded, "bad", [image(1)], 1)
    short = ImageInput(image(1).patches, (1, 4, 6), 5, "d")  # 5 tokens, the prompt has 6
    with pytest.raises(InvalidRequestError, match="image-pad runs"):
        engine.add_request(GenerationRequest("b1", req.prompt_ids, req.params, images=(short,)))
    with pytest.raises(InvalidRequestError, match="no images"):
        engine.add_request(GenerationRequest("b2", req.prompt_ids, req.params))
    with pytest.raises(InvalidRequestError, match="image-pad runs"):
        two = (image(1), image(2))
        engine.add_request(GenerationRequest("b3", req.prompt_ids, req.params, images=two))
    assert not engine.has_work()


def test_tower_passes_in_stages_equal_whole_passes(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tower block dearer than a step's allowance, each image's pass spreads
    over steps (a block at a time, the oldest prompt first) while text rows decode;
    every row's tokens equal those of whole passes."""
    reqs = [
        _request(loaded, "t", [], 1, max_tokens=12),
        _request(loaded, "i1", [image(1)], 2),
        _request(loaded, "i2", [image(2, (1, 8, 8)), image(3)], 3, max_tokens=5),
    ]
    joins = {0: reqs[:1], 2: reqs[1:]}
    whole = _run(LLMEngine(loaded, SMALL), joins)
    monkeypatch.setattr("deltaserve.engine.vision.media.text_flops_per_token", lambda cfg: 1e-3)
    engine = LLMEngine(loaded, SMALL)
    works = []
    execute = engine.runner.execute

    def spy(plan):  # noqa: ANN001, ANN202
        works.extend(w for c in plan.prefill for w in c.vision)
        return execute(plan)

    engine.runner.execute = spy
    staged = _run(engine, joins)
    depth = loaded.vision_config.depth
    assert depth > 1 and all(w.stop - w.start == 1 for w in works)
    assert len(works) == 3 * depth
    for req in reqs:
        assert staged[(req.request_id, 0)] == whole[(req.request_id, 0)], req.request_id
