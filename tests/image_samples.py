"""Test images for the image tests: smooth gradients plus noise in any Pillow mode,
encoded, as data: URLs, and the test checkpoints' preprocessor_config.json on disk."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from deltaserve.models.testing.tokenizer import preprocessor_config


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise (resampling has something to do), in `mode`."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    noise = rng.normal(0, 3, (height, width, 4))
    pixels = np.clip(x * 0.6 + y * 0.4 + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGBA")
    if mode == "P+transparency":
        image = image.convert("RGB").convert("P")
        image.info["transparency"] = 7
        return image
    return image.convert(mode)


def encoded(image: Image.Image, fmt: str = "PNG", **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def write_processor_dir(out: Path) -> Path:
    """`out` holding the test checkpoints' preprocessor_config.json."""
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config()))
    return out
