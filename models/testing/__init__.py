"""Test and demo checkpoints: random-weight Qwen3.5 models with the real tokenizer.

`write_checkpoint` writes one (published HF layout, or mlx-community via mlx-lm's
converter); `cached_checkpoint` writes a named one once under a cache directory and
reuses it across test runs; `write_tokenizer` writes only the tokenizer files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from deltaserve.models.testing.checkpoint import (
    convert_to_mlx,
    tensor_plan,
    write_checkpoint,
    write_hf_checkpoint,
)
from deltaserve.models.testing.config import SHAPES, hf_config, resolve_shape, text_config
from deltaserve.models.testing.quantized import write_mlx_quantized
from deltaserve.models.testing.tokenizer import write_tokenizer

# Bump when the writer's output changes, so stale cached checkpoints are not reused.
CACHE_VERSION = 2  # 2: two vision blocks (staged tower passes), preprocessor_config.json
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "checkpoints"

# Named checkpoints for tests. "source" + "bits": mlx-lm conversion of another entry;
# "direct_bits": the mlx-community quantized layout written directly (models/testing/
# quantized.py), for shapes whose bf16 source does not fit the disk.
CACHED: dict[str, dict] = {
    "tiny": {"shape": "tiny"},
    "tiny-tied": {"shape": "tiny-tied"},
    "tiny-moe": {"shape": "tiny-moe"},
    "tiny-sharded": {"shape": "tiny", "shards": 2},
    "tiny-moe-per-expert": {"shape": "tiny-moe", "experts": "per_expert", "shards": 3},
    "tiny-inexact": {"shape": "tiny", "exact_gains": False},  # bf16 "+1" is lossy here
    "tiny-mlx-4bit": {"source": "tiny", "bits": 4},
    "tiny-mlx-8bit": {"source": "tiny", "bits": 8},
    "tiny-moe-mlx-4bit": {"source": "tiny-moe", "bits": 4},
    "tiny-inexact-mlx-8bit": {"source": "tiny-inexact", "bits": 8},
    "demo": {"shape": "small"},
    "35B-A3B-mlx-4bit": {"shape": "35B-A3B", "direct_bits": 4},
}


def cache_root() -> Path:
    """$DELTASERVE_TEST_CACHE, else <repo>/.cache/checkpoints (gitignored)."""
    return Path(os.environ.get("DELTASERVE_TEST_CACHE", DEFAULT_CACHE)) / f"v{CACHE_VERSION}"


def cached_checkpoint(name: str) -> Path:
    """The directory of a named test checkpoint, written on first use.

    name: a key of CACHED, or any shape name of SHAPES (HF layout, defaults). Writing
    goes to a temporary sibling that is renamed into place, so a crash or a concurrent
    writer never leaves a half-written checkpoint behind.
    """
    spec = CACHED.get(name) or ({"shape": name} if name in SHAPES else None)
    if spec is None:
        known = ", ".join([*CACHED, *SHAPES])
        raise ValueError(f"unknown cached checkpoint {name!r}; known: {known}")
    target = cache_root() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        out = staging / "ckpt"
        if "source" in spec:
            convert_to_mlx(cached_checkpoint(spec["source"]), out, spec["bits"])
        elif "direct_bits" in spec:
            write_mlx_quantized(out, spec["shape"], spec["direct_bits"])
        else:
            write_checkpoint(out, **spec)
        try:
            out.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


__all__ = [
    "CACHED",
    "SHAPES",
    "cache_root",
    "cached_checkpoint",
    "convert_to_mlx",
    "hf_config",
    "resolve_shape",
    "tensor_plan",
    "text_config",
    "write_checkpoint",
    "write_hf_checkpoint",
    "write_mlx_quantized",
    "write_tokenizer",
]
