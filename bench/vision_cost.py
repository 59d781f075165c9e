"""Benchmark: the vision tower's ms per image at the 0.8B shape, random weights, vs mlx-vlm.

Run:  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      .venv/bin/python -m bench.vision_cost [--sizes 448 1024] [--images 1 4] [--reps 5]
The 0.8B tower: depth 12, width 768, 12 heads, MLP 3072, 48x48 position table, out 1024.
float32 on CPU, bfloat16 on a GPU (as the server loads it). One JSON line per (size,
images per call, implementation): median and min ms per call and per image. Images of
one call share a size (a step with several images of one resolution).

mlx-vlm's tower runs in the same process when `mlx_vlm` imports (it is not a dependency;
e.g. `pip install --no-deps --target DIR mlx-vlm` and PYTHONPATH=DIR), loaded with the
same weights; its line gives our speedup and the max relative difference of the features.

Measured 2026-11-30 (mlx 0.32.4, mlx-vlm 0.7.10; ms per image, median):
- H200, bf16, compiled (--eager in brackets): 448x448 3.9 (6.5), 4 per call 2.0 (2.3);
  1024x1024 9.2 (10.4), 4 per call 5.9 (6.6). mlx-vlm 15.5 / 7.0 / 17.2 / 14.1, i.e.
  1.9-4.0x slower (it splits attention per frame with a host sync per block). Features
  agree to 1.3e-2 of their max in bf16 (9.8e-7 in float32 on CPU).
- CPU, 2 shared cores, float32 + OpenBLAS: 448x448 3.6 s (mlx-vlm 5.5 s); 1024x1024
  84 s with other jobs on the box (mlx-vlm 99 s): there the softmax's 2^x over 12 x
  4096^2 scores per block costs more than the block's matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deltaserve.models.testing.config import SHAPES, hf_config  # noqa: E402
from deltaserve.models.vision import VisionConfig, VisionTower  # noqa: E402


def time_ms(fn: Callable[[], mx.array], reps: int, warmup: int) -> dict:
    """Median and min wall ms of `reps` evaluated calls after `warmup` calls, and the
    median process CPU ms (all threads: on a shared CPU box it moves less with other
    load than wall time does)."""
    for _ in range(warmup):
        mx.eval(fn())
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        mx.eval(fn())
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return {"median": sorted(wall)[reps // 2], "min": min(wall), "cpu": sorted(cpu)[reps // 2]}


def build_tower(dtype: mx.Dtype) -> VisionTower:
    """The 0.8B-shape tower with MLX's default random init, in `dtype`."""
    cfg = VisionConfig.from_dict(hf_config(SHAPES["0.8B"]))
    tower = VisionTower(cfg)
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    return tower


def mlx_vlm_tower(ours: VisionTower) -> Callable[[mx.array, mx.array], mx.array] | None:
    """mlx-vlm's Qwen3.5 vision model holding our weights, or None when not importable."""
    try:
        from mlx_vlm.models.qwen3_5.config import VisionConfig as VlmConfig
        from mlx_vlm.models.qwen3_5.vision import VisionModel
    except ImportError:
        return None
    c = ours.config
    model = VisionModel(VlmConfig(
        model_type="qwen3_5", depth=c.depth, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, out_hidden_size=c.out_hidden_size,
        num_heads=c.num_heads, patch_size=c.patch_size, spatial_merge_size=c.spatial_merge_size,
        temporal_patch_size=c.temporal_patch_size, in_channels=c.in_channels,
        num_position_embeddings=c.num_position_embeddings,
    ))  # fmt: skip
    weights = dict(nn.utils.tree_flatten(ours.parameters()))
    conv = weights["patch_embed.proj.weight"].reshape(
        c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size
    )
    weights["patch_embed.proj.weight"] = conv.transpose(0, 2, 3, 4, 1)  # mlx-vlm: channels last
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return lambda patches, grid_thw: model(patches, grid_thw)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 1024], help="square pixels")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4], help="images per call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="no mx.compile on the GPU either")
    args = ap.parse_args()
    gpu = mx.default_device() != mx.cpu
    dtype = mx.bfloat16 if gpu else mx.float32
    tower = build_tower(dtype)
    tower.compiled = gpu and not args.eager
    peer = mlx_vlm_tower(tower)
    device = str(mx.default_device())
    if peer is None:
        print(json.dumps({"note": "mlx_vlm not importable: no peer line"}))
    for size in args.sizes:
        side = size // tower.config.patch_size
        for count in args.images:
            grids = [(1, side, side)] * count
            key = mx.random.key(size * 100 + count)
            patches = mx.random.normal((count * side * side, tower.config.patch_dim), key=key)
            patches = patches.astype(dtype)
            ours_fn = lambda p=patches, g=grids: tower(p, g)  # noqa: E731
            line = {"device": device, "dtype": str(dtype), "size": size, "images": count,
                    "tokens_per_image": side * side // 4}  # fmt: skip
            ours_t = time_ms(ours_fn, args.reps, args.warmup)
            impl = "deltaserve" + (" compiled" if tower.compiled else "")
            print(json.dumps({**line, "impl": impl, **_figures(ours_t, count)}), flush=True)
            if peer is None:
                continue
            grid_thw = mx.array(grids, dtype=mx.int32)
            peer_fn = lambda p=patches, g=grid_thw: peer(p, g)  # noqa: E731
            peer_t = time_ms(peer_fn, args.reps, args.warmup)
            ref = peer_fn().astype(mx.float32)
            diff = (mx.abs(ours_fn().astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
            figures = _figures(peer_t, count)
            speedup = round(peer_t["median"] / ours_t["median"], 2)
            extra = {"speedup": speedup, "max_rel_diff": float(f"{diff:.2e}")}
            print(json.dumps({**line, "impl": "mlx-vlm", **figures, **extra}), flush=True)


def _figures(times: dict, count: int) -> dict:
    return {
        "ms_per_call": round(times["median"], 2), "min_ms_per_call": round(times["min"], 2),
        "ms_per_image": round(times["median"] / count, 2), "cpu_ms_per_call": round(times["cpu"]),
    }  # fmt: skip


if __name__ == "__main__":
    main()
