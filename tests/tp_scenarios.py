"""Engine scenarios that tests/test_tensor_parallel.py runs in one process and under
`mlx.launch` on two (tensor parallel, ring backend on loopback), then compares.

Each scenario: seven requests on a three-row engine, so rows join and leave the decode
batch mid-flight; 16-token chunks, so prompts prefill over several steps next to decoding
rows; an n = 2 seeded sampling request; one request aborted mid-way; then a prompt that
resumes from the prefix cache. Run as a script on every rank: rank 0 writes the outputs
as JSON to argv[1], the other ranks follow its steps.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.parallel.tensor_parallel import follow, join_group, start_engine
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.parallel import TensorParallel
from deltaserve.models.testing import cached_checkpoint

CONFIG = EngineConfig(
    max_num_seqs=3,
    max_num_batched_tokens=64,
    max_prefill_chunk=16,
    memory_budget_bytes=1 << 30,
    prefix_block_tokens=16,
    prefix_min_tokens=16,
    distributed_timeout_s=60.0,
    # the same steps every run: plans from the token budget alone, and tokens read back
    # in the step that computed them (the abort lands at the same token either way)
    max_stall_factor=0,
    pipeline_steps=False,
)
# name -> (checkpoint, engine config)
SCENARIOS: dict[str, tuple[str, EngineConfig]] = {
    "dense": ("tiny", CONFIG),
    "tied": ("tiny-tied", CONFIG),
    "moe": ("tiny-moe", CONFIG),
    "quantized": ("tiny-mlx-4bit", CONFIG),
    "affine-kv": ("tiny", dataclasses.replace(CONFIG, kv_cache=KVCacheConfig(kind="affine"))),
    "turboquant-kv": (
        "tiny",
        dataclasses.replace(CONFIG, kv_cache=KVCacheConfig(kind="turboquant")),
    ),
}
LENGTHS = (5, 40, 17, 70, 9, 33)
MAX_TOKENS = (12, 5, 20, 8, 16, 10)
ABORT_ID, ABORT_AFTER_STEPS = "r2", 8


def _requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, 240000, n)) for n in LENGTHS]
    requests = [
        GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=m))
        for i, (prompt, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True))
    ]
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=9)
    requests.append(GenerationRequest("forks", prompts[1], sampled, n=2))
    return requests


def _drain(engine: LLMEngine, outputs: dict[str, list[int]], abort: str | None) -> None:
    steps = 0
    while engine.has_work():
        deltas = engine.step()
        steps += 1
        if abort is not None and steps == ABORT_AFTER_STEPS:
            deltas += engine.abort(abort)
        for delta in deltas:
            key = f"{delta.request_id}/{delta.index}"
            outputs.setdefault(key, []).extend(delta.token_ids)
            if delta.finished:
                outputs[key].append(f"<{delta.finish_reason}:{delta.num_cached_tokens}>")


def run_rank0(engine: LLMEngine) -> dict[str, list]:
    """Rank 0 (or the lone process): every request of the scenario, outputs by choice."""
    outputs: dict[str, list] = {}
    requests = _requests()
    for request in requests:
        engine.add_request(request)
    _drain(engine, outputs, ABORT_ID)
    # a prompt that continues r3's: resumes from the prefix cache
    follow_up = requests[3].prompt_ids + (11, 12, 13)
    engine.add_request(GenerationRequest("cached", follow_up, SamplingParams(0.0, max_tokens=6)))
    _drain(engine, outputs, None)
    return outputs


def run(parallel: TensorParallel | None, names: list[str]) -> dict[str, dict]:
    """Every named scenario in turn (all ranks call this with the same names)."""
    results = {}
    for name in names:
        checkpoint, config = SCENARIOS[name]
        engine = start_engine(str(cached_checkpoint(checkpoint)), config, parallel)
        if parallel is not None and parallel.rank > 0:
            follow(engine)
            continue
        results[name] = run_rank0(engine)
        engine.close()
    return results


def main(argv: list[str]) -> int:
    parallel = join_group("ring")
    results = run(parallel, argv[2:] or list(SCENARIOS))
    if parallel is None or parallel.rank == 0:
        Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
