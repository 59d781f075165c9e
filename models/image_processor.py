"""Qwen3.5's image preprocessing: a PIL image -> the pixel patches its vision tower reads.

Pure numpy + Pillow, numerically equal to transformers' PIL-backend `Qwen2VLImageProcessor`
(what `AutoImageProcessor` gives a Qwen3.5 checkpoint without torchvision): composite
alpha on white, resize (Pillow bicubic) to a size whose sides are multiples of
patch_size * merge_size and whose area lies in [min_pixels, max_pixels], rescale by 1/255
in float64 then cast to float32, normalize, and cut into patches. A still image is one
temporal step, so each patch repeats its pixels temporal_patch_size times.

Patch order: merge windows row-major, the merge_size x merge_size patches of a window
row-major inside it; each patch flattened as [C, T, P, P]. So the vision tower's merger
finds the merge_size^2 patches it fuses next to each other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses longer-than-this strips


@dataclass(frozen=True)
class ImageProcessorConfig:
    """A checkpoint's preprocessor_config.json; the defaults are Qwen3.5's published ones."""

    patch_size: int = 16  # pixels per patch side
    temporal_patch_size: int = 2  # frames per patch (a still image is repeated)
    merge_size: int = 2  # patches per side that the merger fuses into one token
    min_pixels: int = 256 * 256  # size.shortest_edge: least resized area
    max_pixels: int = 4096 * 4096  # size.longest_edge: most resized area
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        assert min(self.patch_size, self.temporal_patch_size, self.merge_size) >= 1
        assert 0 < self.min_pixels <= self.max_pixels, "need 0 < min_pixels <= max_pixels"
        assert len(self.image_mean) == len(self.image_std) == 3, "mean/std need 3 channels"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        """Read preprocessor_config.json (or processor_config.json's image_processor
        section); a checkpoint with neither gets the defaults."""
        model_dir = Path(model_dir)
        path = model_dir / "preprocessor_config.json"
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()))
        path = model_dir / "processor_config.json"
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()).get("image_processor", {}))
        return cls()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImageProcessorConfig:
        """The Qwen2-VL keys; top-level min_pixels/max_pixels override `size`, as in
        transformers. Steps switched off (do_resize: false, ...) are not supported."""
        off = [key for key in _STEPS if data.get(key) is False]
        if off:
            raise ValueError(f"preprocessor config switches off {off}; not supported")
        size = data.get("size") or {}
        fields: dict[str, Any] = {
            "min_pixels": data.get("min_pixels") or size.get("shortest_edge"),
            "max_pixels": data.get("max_pixels") or size.get("longest_edge"),
        }
        for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            fields[key] = data.get(key)
        fields["resample"] = data.get("resample")
        for key in ("image_mean", "image_std"):
            if data.get(key) is not None:
                fields[key] = tuple(float(v) for v in data[key])
        return cls(**{key: value for key, value in fields.items() if value is not None})

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor^2 pixels."""
        return self.patch_size * self.merge_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Prompt tokens of an image with this patch grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.merge_size**2


_STEPS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The resized (height, width): multiples of `factor`, area in [min_pixels,
    max_pixels], aspect ratio kept as closely as that allows (transformers' rule)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"the aspect ratio must be at most {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (as transformers converts)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(
    image: Image.Image, cfg: ImageProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches [t*h*w, 3*T*P*P] float32 and the grid (t, h, w) in patches (t = 1)."""
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = rgb.resize((width, height), resample=cfg.resample)
    # Same ops and dtypes as transformers: float64 rescale, float32 normalize.
    pixels = (np.asarray(resized, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.array(cfg.image_mean, dtype=np.float32)
    std = np.array(cfg.image_std, dtype=np.float32)
    pixels = (pixels - mean) / std  # [H, W, C]
    return patchify(pixels, cfg)


def patchify(
    pixels: np.ndarray, cfg: ImageProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[H, W, C] normalized pixels -> patches in the module docstring's order, and the grid."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, channels = pixels.shape
    grid_h, grid_w = height // p, width // p
    assert grid_h * p == height and grid_w * p == width and grid_h % m == grid_w % m == 0
    windows = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    windows = windows.transpose(0, 3, 1, 4, 6, 2, 5)  # [gh/m, gw/m, m, m, C, P, P]
    repeated = np.broadcast_to(windows[:, :, :, :, :, None], (*windows.shape[:5], t, p, p))
    patches = repeated.reshape(grid_h * grid_w, channels * t * p * p)  # copies: contiguous
    return patches, (1, grid_h, grid_w)
