"""Image preprocessing: smart resize and patches equal to transformers' PIL
Qwen2VLImageProcessor, the checkpoint's processor config, and the server's cap on
resized pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from image_samples import data_url, encoded, picture, write_processor_dir

from deltaserve.models.image_processor import ImageProcessorConfig, preprocess, smart_resize
from deltaserve.server.frontend.messages import ImageRef
from deltaserve.server.images import load_images
from deltaserve.server.settings import ConfigError, ImageSettings

PART = "messages[0].content[0].image_url"


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the test checkpoints' preprocessor_config.json."""
    return write_processor_dir(tmp_path_factory.mktemp("processor"))


def test_checkpoint_config_is_qwen35_and_the_default(processor_dir: Path) -> None:
    """The test checkpoints' file reads back as the built-in defaults (Qwen3.5's values);
    min/max_pixels and processor_config.json's nested form are read too."""
    assert ImageProcessorConfig.from_dir(processor_dir) == ImageProcessorConfig()
    legacy = ImageProcessorConfig.from_dict({"min_pixels": 1024, "max_pixels": 4096})
    assert (legacy.min_pixels, legacy.max_pixels) == (1024, 4096)
    nested = processor_dir / "nested"
    nested.mkdir()
    (nested / "processor_config.json").write_text(
        json.dumps({"image_processor": {"patch_size": 14, "size": {"longest_edge": 10**6}}})
    )
    cfg = ImageProcessorConfig.from_dir(nested)
    assert cfg.patch_size == 14 and cfg.max_pixels == 10**6 and cfg.factor == 28
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessorConfig.from_dict({"do_normalize": False})


def test_smart_resize_matches_transformers() -> None:
    """Our smart_resize gives transformers' size for small, huge and thin images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    cfg = ImageProcessorConfig()
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (1, 150), (31, 33), (4097, 4095), (10, 2000), *rng.integers(1, 9000, (200, 2))]
    for height, width in sizes:
        if max(height, width) / min(height, width) > 200:
            continue
        args = (int(height), int(width), cfg.factor, cfg.min_pixels, cfg.max_pixels)
        assert smart_resize(*args) == ref(*args), (height, width)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, cfg.factor, cfg.min_pixels, cfg.max_pixels)


@pytest.mark.parametrize(
    ("size", "mode", "max_pixels"),
    [
        ((300, 200), "RGB", None),
        ((1001, 333), "RGBA", None),
        ((640, 480), "LA", None),
        ((320, 240), "P+transparency", None),
        ((250, 700), "L", None),
        ((2000, 10), "CMYK", None),
        ((1, 1), "RGB", None),
        ((900, 700), "RGB", 300 * 300),  # shrunk to max_pixels
    ],
)
def test_preprocess_matches_transformers(
    processor_dir: Path, size: tuple[int, int], mode: str, max_pixels: int | None
) -> None:
    """Patches and grid equal transformers' (PIL backend) Qwen2VLImageProcessor's for
    every mode (alpha on white), upscaled, downscaled and thin images."""
    from transformers import Qwen2VLImageProcessorPil

    kwargs = {"size": {"shortest_edge": 65536, "longest_edge": max_pixels}} if max_pixels else {}
    reference = Qwen2VLImageProcessorPil.from_pretrained(processor_dir, **kwargs)
    cfg = ImageProcessorConfig(max_pixels=max_pixels or ImageProcessorConfig.max_pixels)
    image = picture(*size, mode=mode)
    patches, grid = preprocess(image, cfg)
    expected = reference(images=[image], return_tensors="np")
    assert grid == tuple(expected["image_grid_thw"][0])
    assert patches.dtype == np.float32 and patches.shape == expected["pixel_values"].shape
    np.testing.assert_allclose(patches, expected["pixel_values"], atol=1e-5, rtol=0)


def test_large_images_are_scaled_down_to_max_resized_pixels() -> None:
    """A 2000x1500 image (about 2,900 tokens at the checkpoint's own bound) becomes at
    most images.max_resized_pixels: 1,024 tokens by default, fewer when set lower; its
    aspect ratio is kept (to the 32-pixel grid)."""
    refs = [ImageRef(data_url(encoded(picture(2000, 1500))), PART)]
    processor = ImageProcessorConfig()
    (big,) = load_images(refs, ImageSettings(), processor)
    assert big.num_tokens <= 1024 and big.grid[2] > big.grid[1]
    (small,) = load_images(refs, ImageSettings(max_resized_pixels=256 * 256), processor)
    assert small.num_tokens <= 64 < big.num_tokens
    with pytest.raises(ConfigError, match="max_resized_pixels"):
        ImageSettings(max_resized_pixels=100)
