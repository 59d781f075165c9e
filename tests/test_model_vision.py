"""The vision tower, 3-D positions and image splicing (the runner's, engine/vision/features.py)
against transformers' Qwen3.5.

transformers reads the tiny HF checkpoint (tower: depth 1, width 32, 2 heads, 8x8
position table) into Qwen3_5ForConditionalGeneration in float32 on CPU; pixel patches
come from transformers' own Qwen2VL image processor (PIL backend, patch 16, merge 2), so
the patch order is the one real prompts have.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from parity_utils import encode, rel_error

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.plan import PrefillChunk, VisionWork
from deltaserve.engine.request import Request, choices_of
from deltaserve.engine.types import GenerationRequest, ImageInput, SamplingParams
from deltaserve.engine.vision.features import VisionInputs
from deltaserve.engine.vision.media import prepare_media
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.loader import load_checkpoint
from deltaserve.models.rope_index import decode_positions, mrope_positions
from deltaserve.models.state import ForwardGroup
from deltaserve.models.testing import cached_checkpoint
from deltaserve.models.vision import VisionConfig, load_vision

# Relative error bounds, max|ours - ref| / max|ref|. Tower features measured 9e-7 (float32
# summation order); logits with images as in test_parity_transformers (~1e-5 measured).
# A wrong patch order, position tap or rotary axis moves features by O(1).
FEATURE_TOL = 1e-4
LOGIT_TOL = 1e-4
GREEDY_TOKENS = 8
IMAGE, START, END = 248056, 248053, 248054
Grid = tuple[int, int, int]


@pytest.fixture(scope="module")
def reference() -> Iterator[object]:
    """transformers' float32 Qwen3_5ForConditionalGeneration of the tiny checkpoint."""
    import torch
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        cached_checkpoint("tiny"), dtype=torch.float32
    ).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None)
    yield model


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


def pixels(sizes: list[tuple[int, int]], seed: int = 0) -> tuple[np.ndarray, list[Grid]]:
    """Patches [N, 1536] and grids of random RGB images of (height, width) pixels."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 512 * 512},
    )  # fmt: skip
    out = processor(images=images)
    grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
    return np.asarray(out["pixel_values"], dtype=np.float32), grids


def reference_features(reference: object, patches: np.ndarray, grids: list[Grid]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = reference.model.get_image_features(torch.tensor(patches), torch.tensor(grids))
    return torch.cat(out.pooler_output).numpy()


def image_prompt(layout: str, grids: list[Grid]) -> list[int]:
    """Token ids of a prompt: 't' = a piece of text, 'i' = the next image (with its
    vision start/end tokens), e.g. 'titit'."""
    texts = iter(["Describe", " this picture, please", " and compare it with", " now."] * 2)
    images, ids = iter(grids), []
    for part in layout:
        if part == "t":
            ids += encode(next(texts))
        else:
            t, h, w = next(images)
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    return ids


@pytest.mark.parametrize(
    "sizes", [[(64, 96), (160, 64)], [(64, 64), (96, 128), (64, 64), (32, 224)]]
)
def test_tower_matches_transformers(
    ours: LoadedModel, reference: object, sizes: list[tuple[int, int]]
) -> None:
    """Several images of different sizes in one call (frames regrouped by size inside)
    equal transformers' features, image after image."""
    patches, grids = pixels(sizes)
    expected = reference_features(reference, patches, grids)
    got = ours.vision(mx.array(patches), grids)
    assert got.shape == expected.shape
    assert rel_error(got, mx.array(expected)) <= FEATURE_TOL


def test_multi_frame_grids_match_transformers(ours: LoadedModel, reference: object) -> None:
    """Grids with t > 1 (each frame attends alone; T positions step per frame): the
    features and get_rope_index's positions equal transformers'."""
    import torch

    grids = [(2, 4, 6), (1, 4, 4), (3, 2, 4)]
    count = sum(t * h * w for t, h, w in grids)
    patches = np.random.default_rng(3).normal(size=(count, 1536)).astype(np.float32)
    expected = reference_features(reference, patches, grids)
    assert rel_error(ours.vision(mx.array(patches), grids), mx.array(expected)) <= FEATURE_TOL
    ids = image_prompt("tiiit", grids)
    got, delta = mrope_positions(ids, grids, IMAGE, 2)
    input_ids = torch.tensor([ids])
    positions, deltas = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids)
    )
    assert np.array_equal(got, positions[:, 0].numpy()) and delta == int(deltas[0, 0])


def test_tower_batch_equals_images_alone(ours: LoadedModel) -> None:
    """An image's features do not depend on the other images of the call."""
    patches, grids = pixels([(96, 64), (64, 64), (96, 64)], seed=1)
    together = ours.vision(mx.array(patches), grids)
    start, rows = 0, 0
    for grid in grids:
        count = int(np.prod(grid))
        alone = ours.vision(mx.array(patches[start : start + count]), [grid])
        part = together[rows : rows + alone.shape[0]]
        assert mx.allclose(part, alone, rtol=1e-5, atol=1e-5).item()
        start, rows = start + count, rows + alone.shape[0]


def test_compiled_encoder_equals_eager(ours: LoadedModel) -> None:
    """The mx.compile'd blocks + merger (the GPU default, one trace per frame layout)
    give the eager features, for two layouts in turn."""
    tower = ours.vision
    calls = [pixels([(64, 64), (96, 128), (64, 64)]), pixels([(96, 64)], seed=2)]
    eager = [tower(mx.array(p), g) for p, g in calls]
    tower.compiled = True
    try:
        compiled = [tower(mx.array(p), g) for p, g in calls * 2]  # traced, then replayed
    finally:
        tower.compiled = False
    for got, expected in zip(compiled, eager * 2, strict=True):
        assert rel_error(got, expected) <= 1e-5


def test_mlx_vlm_layout_loads_the_same_tower(ours: LoadedModel, tmp_path: Path) -> None:
    """A checkpoint with mlx-vlm's vision naming (`vision_tower.`) and channels-last
    Conv3d weight [W, T, P, P, C] gives the same features as the HF layout."""
    source = cached_checkpoint("tiny")
    tensors = mx.load(str(source / "model.safetensors"))
    renamed = {}
    for key, value in tensors.items():
        if key.startswith("model.visual."):
            key = "vision_tower." + key.removeprefix("model.visual.")
            if key.endswith("patch_embed.proj.weight"):
                value = value.transpose(0, 2, 3, 4, 1)
        renamed[key] = value
    assert renamed["vision_tower.patch_embed.proj.weight"].shape == (32, 2, 16, 16, 3)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), renamed, {"format": "mlx"})
    ckpt = load_checkpoint(tmp_path, compute_dtype=mx.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    tower = load_vision(config, ckpt.vision_weights, mx.float32)
    patches, grids = pixels([(64, 96), (96, 96)])
    assert mx.array_equal(tower(mx.array(patches), grids), ours.vision(mx.array(patches), grids))


def test_text_only_checkpoint_has_no_tower() -> None:
    """mlx-lm's conversion drops the vision tensors and config: vision stays None."""
    loaded = load_model(str(cached_checkpoint("tiny-mlx-4bit")))
    assert loaded.vision is None and loaded.vision_config is None


def test_vision_config_from_checkpoint(ours: LoadedModel) -> None:
    cfg = ours.vision_config
    assert cfg == VisionConfig.from_dict(json.loads((ours.path / "config.json").read_text()))
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.out_hidden_size) == (2, 32, 2, 128)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.spatial_merge_size) == (
        IMAGE, START, 2,
    )  # fmt: skip
    assert cfg.num_tokens((1, 4, 6)) == 6
    assert VisionConfig.from_dict({"model_type": "qwen3_5_text"}) is None


@pytest.mark.parametrize("layout", ["titit", "it", "ti", "tiit", "i"])
def test_mrope_positions_match_transformers(reference: object, layout: str) -> None:
    """Positions [3, L] and the rope delta equal transformers' get_rope_index."""
    import torch

    grids = [(1, 4, 6), (1, 10, 4), (1, 2, 2)][: layout.count("i")]
    ids = image_prompt(layout, grids)
    got, delta = mrope_positions(ids, grids, IMAGE, 2)
    input_ids = torch.tensor([ids])
    expected, deltas = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids)
    )
    assert got.dtype == np.int32 and got.shape == (3, len(ids))
    assert np.array_equal(got, expected[:, 0].numpy())
    assert delta == int(deltas[0, 0])


def test_mrope_positions_reject_mismatched_images() -> None:
    ids = image_prompt("tit", [(1, 4, 4)])
    with pytest.raises(ValueError):
        mrope_positions(ids, [(1, 4, 6)], IMAGE, 2)  # 6 tokens wanted, run has 4
    with pytest.raises(ValueError):
        mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], IMAGE, 2)  # one run, two images


def image_inputs(patches: np.ndarray, grids: list[Grid]) -> tuple[ImageInput, ...]:
    """The prompt's images as the server hands them to the engine."""
    counts = [t * h * w for t, h, w in grids]
    parts = np.split(patches, np.cumsum(counts)[:-1])
    return tuple(
        ImageInput(p, g, n // 4, f"img{i}")
        for i, (p, g, n) in enumerate(zip(parts, grids, counts, strict=True))
    )


def image_row(ours: LoadedModel, ids: list[int], images: tuple[ImageInput, ...]) -> Request:
    """The scheduler's row of an image prompt, its PromptMedia prepared as the engine does."""
    gen = GenerationRequest("image", tuple(ids), SamplingParams(max_tokens=1), images=images)
    media = prepare_media(gen, ours.config, ours.vision_config)
    return choices_of(gen, frozenset(), media, len(ids) + 1)[0]


def spliced_embeds(
    ours: LoadedModel, ids: list[int], patches: np.ndarray, grids: list[Grid], bounds: list
) -> list[mx.array]:
    """[1, hi - lo, H] input embeddings of each chunk [lo, hi) of an image prompt, the
    tower's features spliced in by the runner's VisionInputs."""
    rows = {"image": image_row(ours, ids, image_inputs(patches, grids))}
    inputs = VisionInputs(ours.model, ours.vision, ours.dtype)
    work = tuple(VisionWork(i, 0, len(ours.vision.blocks)) for i in range(len(grids)))
    inputs.encode([PrefillChunk("image", 0, 0, vision=work)], rows)
    return [
        inputs.embeds(mx.array([ids[lo:hi]]), [PrefillChunk("image", lo, hi - lo)], [0], rows)
        for lo, hi in bounds
    ]


def prefill_with_images(
    ours: LoadedModel, ids: list[int], patches: np.ndarray, grids: list[Grid], cut: int = 0
) -> tuple[mx.array, BatchState, int]:
    """Logits [L, V] of an image prompt through our model (in two chunks split at `cut`
    when > 0), the row's state after it and its rope delta."""
    bounds = [(0, cut), (cut, len(ids))] if cut else [(0, len(ids))]
    embeds = spliced_embeds(ours, ids, patches, grids, bounds)
    positions, delta = mrope_positions(ids, grids, IMAGE, 2)
    state, logits = BatchState.empty(ours.config), []
    for (lo, hi), chunk_embeds in zip(bounds, embeds, strict=True):
        group = ForwardGroup(
            tokens=None, positions=mx.array(positions[:, None, lo:hi]), states=state.layers,
            embeds=chunk_embeds,
        )  # fmt: skip
        (hidden,) = ours.model([group])
        logits.append(ours.model.logits(hidden)[0])
    return mx.concatenate(logits), state, delta


def reference_inputs(ids: list[int], patches: np.ndarray, grids: list[Grid]) -> dict:
    import torch

    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids, "pixel_values": torch.tensor(patches),
        "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (input_ids == IMAGE).int(),
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["titit", "it"])
def test_logits_with_images_match_transformers(
    ours: LoadedModel, reference: object, layout: str
) -> None:
    """Teacher-forced logits of a prompt with images (spliced features, 3-D positions)."""
    import torch

    patches, grids = pixels([(64, 96), (160, 64)][: layout.count("i")])
    ids = image_prompt(layout, grids)
    with torch.no_grad():
        expected = mx.array(reference(**reference_inputs(ids, patches, grids)).logits[0].numpy())
    got, _, _ = prefill_with_images(ours, ids, patches, grids)
    assert rel_error(got, expected) <= LOGIT_TOL
    assert mx.array_equal(got.argmax(-1), expected.argmax(-1)).item()
    # A prefill chunk boundary inside the first image changes nothing.
    cut = ids.index(IMAGE) + 3
    chunked, _, _ = prefill_with_images(ours, ids, patches, grids, cut=cut)
    assert rel_error(chunked, got) <= LOGIT_TOL


def test_greedy_decode_with_images_matches_transformers(
    ours: LoadedModel, reference: object
) -> None:
    """Greedy tokens after an image prompt, decoding at position index + rope delta,
    equal transformers' generate()."""
    import torch

    patches, grids = pixels([(64, 96), (160, 64)])
    ids = image_prompt("titit", grids)
    with torch.no_grad():
        out = reference.generate(
            **reference_inputs(ids, patches, grids), max_new_tokens=GREEDY_TOKENS
        )
    expected = out[0, len(ids) :].tolist()
    logits, state, delta = prefill_with_images(ours, ids, patches, grids)
    assert delta < 0
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < GREEDY_TOKENS:
        index = len(ids) + len(tokens) - 1  # sequence index of the token being fed
        positions = mx.array(decode_positions(index, 1, delta)[:, None, :])
        group = ForwardGroup(mx.array([[tokens[-1]]]), positions, state.layers)
        (hidden,) = ours.model([group])
        tokens.append(int(ours.model.logits(hidden)[0, -1].argmax()))
    assert tokens == expected


def test_engine_greedy_with_images_matches_transformers(
    ours: LoadedModel, reference: object
) -> None:
    """Through the engine (chunks of 16 tokens cutting the images, the tower in its own
    plan, a text row decoding beside it): the greedy tokens equal transformers'."""
    import torch

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine

    patches, grids = pixels([(64, 96), (160, 64)])
    ids = image_prompt("titit", grids)
    with torch.no_grad():
        out = reference.generate(
            **reference_inputs(ids, patches, grids), max_new_tokens=GREEDY_TOKENS
        )
    images = image_inputs(patches, grids)
    config = EngineConfig(max_num_batched_tokens=32, max_prefill_chunk=16, prefix_cache=False)
    engine = LLMEngine(ours, config)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    engine.add_request(GenerationRequest("text", tuple(encode("A text row beside it")), params))
    engine.add_request(GenerationRequest("image", tuple(ids), params, images=images))
    tokens: list[int] = []
    while engine.has_work():
        tokens += [t for d in engine.step() if d.request_id == "image" for t in d.token_ids]
    assert tokens == out[0, len(ids) :].tolist()


class FixedTower:
    """A one-block stand-in for VisionTower that returns the features it was given."""

    blocks = [None]

    def __init__(self, features: mx.array) -> None:
        self.features = features

    def __call__(self, patches: mx.array, grids: list[Grid]) -> mx.array:
        return self.features


def test_runner_splices_features_over_image_tokens_in_order(ours: LoadedModel) -> None:
    """VisionInputs.embeds puts image i's feature rows, in order, over its image tokens:
    in a chunk that ends inside an image, and in the chunk after it, padded in a group
    beside a text row; every other column keeps its token embedding."""
    ids = [5, IMAGE, IMAGE, 7, IMAGE, IMAGE, IMAGE, 9]  # images of 2 and 3 tokens
    grids = [(1, 2, 4), (1, 2, 6)]
    patches = np.zeros((sum(t * h * w for t, h, w in grids), 4), dtype=np.float32)
    features = mx.arange(5 * 128, dtype=mx.float32).reshape(5, 128) + 1
    rows = {"image": image_row(ours, ids, image_inputs(patches, grids))}
    text = GenerationRequest("text", (3, 4, 6, 8, 10), SamplingParams(max_tokens=1))
    rows["text"] = choices_of(text, frozenset(), None, 6)[0]
    inputs = VisionInputs(ours.model, FixedTower(features), mx.float32)
    work = (VisionWork(0, 0, 1), VisionWork(1, 0, 1))
    inputs.encode([PrefillChunk("image", 0, 0, vision=work)], rows)
    embed = ours.model.embed_tokens

    first = inputs.embeds(mx.array([ids[:5]]), [PrefillChunk("image", 0, 5)], [0], rows)[0]
    assert mx.array_equal(first[mx.array([1, 2, 4])], features[:3]).item()
    assert mx.array_equal(first[mx.array([0, 3])], embed(mx.array([5, 7]))).item()

    tokens = mx.array([[0, 0, IMAGE, IMAGE, 9], [3, 4, 6, 8, 10]])  # the first padded by 2
    group = [PrefillChunk("image", 5, 3), PrefillChunk("text", 0, 5)]
    out = inputs.embeds(tokens, group, [2, 0], rows)
    assert mx.array_equal(out[0, 2:4], features[3:]).item()
    assert mx.array_equal(out[0, mx.array([0, 1, 4])], embed(tokens[0, mx.array([0, 1, 4])])).item()
    assert mx.array_equal(out[1], embed(tokens[1])).item()
