"""KV cache kinds: bytes per token, cache memory, decode speed and attention-kernel timings.

    .venv/bin/python -m bench.kv_cache [--sections memory decode kernels]

(re-executes itself with OpenBLAS preloaded on a CPU-only Linux host, before mlx loads)

memory   bytes per token (all full-attention layers, K + V) and the cache of 32 rows x
         4,096 tokens, per kind, at the 0.8B and 9B shapes (formula of
         engine/cache/factory.py; checked against a real store's arrays at head_dim 256).
decode   decode tok/s at B=1 and B=32 per kind vs fp on the cached "small" checkpoint,
         prompts of ~512 tokens (all rows prefilled before the clock starts).
kernels  one attention call per path: affine quantized_matmul vs fp SDPA vs dequantize+SDPA,
         TurboQuant rotated-space vs dequantize+SDPA, for decode and prefill shapes.
Prints JSON lines; ratios are against fp in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltaserve.kernels.cpu.blas import blas_summary, ensure_openblas

if __name__ == "__main__":
    ensure_openblas()  # must run before mlx.core is imported

import mlx.core as mx  # noqa: E402

from deltaserve.engine.config import KVCacheConfig  # noqa: E402

if TYPE_CHECKING:
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.models.build import LoadedModel

KINDS: dict[str, KVCacheConfig] = {
    "fp": KVCacheConfig(),
    "affine8": KVCacheConfig(kind="affine", bits=8),
    "affine4": KVCacheConfig(kind="affine", bits=4),
    "tq_k8v3": KVCacheConfig(kind="turboquant", key_bits=8, value_bits=3),
    "tq_k4v4": KVCacheConfig(kind="turboquant", key_bits=4, value_bits=4),
    "tq_k3v3": KVCacheConfig(kind="turboquant", key_bits=3, value_bits=3),
    "affine8_start64": KVCacheConfig(kind="affine", bits=8, start=64),
}
DECODE_KINDS = ["fp", "affine8", "affine4", "tq_k8v3", "affine8_start64"]


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# --------------------------------------------------------------------------- memory


def memory_rows(rows: int = 32, tokens: int = 4096) -> None:
    from deltaserve.engine.cache.budget import StateCosts
    from deltaserve.engine.cache.factory import kv_bytes_per_element_pair, kv_prefix_tokens
    from deltaserve.models.config import TextConfig
    from deltaserve.models.testing.config import SHAPES, text_config

    for shape in ("0.8B", "9B"):
        cfg = TextConfig.from_dict(text_config(SHAPES[shape]))
        for dtype, size in (("bf16", 2), ("f32", 4)):
            fp = None
            for name, kv in KINDS.items():
                pair = kv_bytes_per_element_pair(kv, size, cfg.head_dim)
                costs = StateCosts.for_model(cfg, pair, size, kv_prefix_tokens(kv))
                total = rows * (tokens * costs.kv_bytes_per_token + costs.kv_prefix_bytes_per_row)
                fp = fp or total
                _emit(
                    {"section": "memory", "shape": shape, "dtype": dtype, "kind": name,
                     "bytes_per_token": costs.kv_bytes_per_token,
                     "cache_GiB_32x4096": round(total / 2**30, 4),
                     "ratio_vs_fp": round(fp / total, 3)}
                )  # fmt: skip
    _check_formula()


def _check_formula() -> None:
    """A real store at head_dim 256 / 4 KV heads holds exactly the formula's bytes."""
    from deltaserve.engine.cache.factory import kv_bytes_per_element_pair, kv_store_factory

    for name, kv in KINDS.items():
        store = kv_store_factory(kv)()
        x = mx.random.normal((1, 4, 8, 256))
        store.attend(mx.random.normal((1, 16, 8, 256)), x, x, 0.0625, None)
        formula = kv_bytes_per_element_pair(kv, 4, 256) * 4 * 256
        assert abs(store.bytes_per_token() - formula) < 1e-6, (name, store.bytes_per_token())


# --------------------------------------------------------------------------- decode


def _prefilled_engine(
    loaded: LoadedModel, kv: KVCacheConfig, batch: int, prompt_len: int, budget: int
) -> LLMEngine:
    """An engine whose `batch` rows have all prefilled and decoded twice (off the clock)."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.types import GenerationRequest, SamplingParams

    config = EngineConfig(
        max_num_seqs=max(batch, 1), max_num_batched_tokens=2048, max_prefill_chunk=512,
        memory_budget_bytes=8 * 2**30, kv_cache=kv, warm_up_seconds=0,
    )  # fmt: skip
    engine = LLMEngine(loaded, config)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=budget + 8, ignore_eos=True)
    for i in range(batch):
        prompt = tuple(rng.randrange(100, 200000) for _ in range(prompt_len))
        engine.add_request(GenerationRequest(f"r{i}", prompt, params))
    started: set[str] = set()
    while len(started) < batch:
        started |= {d.request_id for d in engine.step() if d.token_ids}
    engine.step(), engine.step()
    return engine


def _tok_s(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    produced = sum(len(d.token_ids) for _ in range(steps) for d in engine.step())
    return produced / (time.perf_counter() - t0)


def decode_rows(prompt_len: int, steps: int, rounds: int = 5) -> None:
    """Kinds are timed in interleaved rounds (best round kept): the host is shared and
    noisy, and a slow spell should hit every kind alike."""
    from deltaserve.models.build import load_model
    from deltaserve.models.testing import cached_checkpoint

    loaded = load_model(str(cached_checkpoint("small")))
    for batch in (1, 32):
        engines = {
            name: _prefilled_engine(loaded, KINDS[name], batch, prompt_len, steps * rounds)
            for name in DECODE_KINDS
        }
        best = dict.fromkeys(engines, 0.0)
        for _ in range(rounds):
            for name, engine in engines.items():
                best[name] = max(best[name], _tok_s(engine, steps))
        for name, tok_s in best.items():
            _emit(
                {"section": "decode", "checkpoint": "small", "batch": batch, "kind": name,
                 "prompt": prompt_len, "tok_s": round(tok_s, 2),
                 "ratio_vs_fp": round(tok_s / best["fp"], 3)}
            )  # fmt: skip


# --------------------------------------------------------------------------- kernels


def _ms(fn: Callable[[], mx.array], reps: int = 5) -> float:
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0) / reps


def _kernel_paths(q: mx.array, k: mx.array, v: mx.array, mask: str | None) -> dict:
    """One closure per attention path over the same q/k/v (affine 8-bit g64, TQ K8V3)."""
    from deltaserve.kernels.quant_attention import (
        affine_attention,
        fold_queries,
        masked_softmax,
        unfold_output,
    )
    from deltaserve.kernels.turboquant import turboquant_quantize
    from deltaserve.kernels.turboquant_attention import (
        turboquant_attention,
        turboquant_attention_dequantized,
    )

    scale = q.shape[-1] ** -0.5
    aq = [*mx.quantize(k, 64, 8), *mx.quantize(v, 64, 8)]
    tq = [*turboquant_quantize(k, 8), *turboquant_quantize(v, 3)]
    mx.eval(q, k, v, *aq, *tq)

    def qmm_only() -> mx.array:  # quantized_matmul whatever L (no prefill dispatch)
        f = fold_queries(q * scale, k.shape[1])
        scores = mx.quantized_matmul(f, *aq[:3], transpose=True, group_size=64, bits=8)
        probs = masked_softmax(scores, mask, q.shape[2])
        out = mx.quantized_matmul(probs, *aq[3:], transpose=False, group_size=64, bits=8)
        return unfold_output(out, q.shape[1])

    def dequant_sdpa() -> mx.array:
        kk = mx.dequantize(*aq[:3], group_size=64, bits=8)
        vv = mx.dequantize(*aq[3:], group_size=64, bits=8)
        return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask=mask)

    return {
        "fp_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
        "affine8_attention": lambda: affine_attention(q, *aq, scale, mask, 64, 8),
        "affine8_qmm_only": qmm_only,
        "affine8_dequant_sdpa": dequant_sdpa,
        "tq_k8v3_rotated": lambda: turboquant_attention(q, *tq, scale, mask, 8, 3),
        "tq_k8v3_dequant_sdpa": lambda: turboquant_attention_dequantized(q, *tq, scale, mask, 8, 3),
    }


def kernel_rows() -> None:
    """ms per attention call; affine8_attention is the dispatching kernel the store uses."""
    shapes = [(1, 1, 4096), (32, 1, 512), (32, 1, 2048), (1, 512, 512)]  # (B, L, S)
    for head_dim, hq, hkv in ((64, 4, 2), (256, 16, 4)):
        for b, length, s in shapes:
            q = mx.random.normal((b, hq, length, head_dim))
            k, v = (mx.random.normal((b, hkv, s, head_dim)) for _ in "kv")
            paths = _kernel_paths(q, k, v, "causal" if length > 1 else None)
            row = {"section": "kernels", "head_dim": head_dim, "B": b, "L": length, "S": s}
            row |= {f"{name}_ms": round(_ms(fn), 3) for name, fn in paths.items()}
            _emit(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sections", nargs="+", default=["memory", "decode", "kernels"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    args = ap.parse_args()
    _emit({"blas": blas_summary(), "device": str(mx.default_device())})
    if "memory" in args.sections:
        memory_rows()
    if "kernels" in args.sections:
        kernel_rows()
    if "decode" in args.sections:
        decode_rows(args.prompt, args.steps)


if __name__ == "__main__":
    main()
