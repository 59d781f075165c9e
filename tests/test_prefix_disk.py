"""The prefix cache's disk tier: a restarted engine resumes from what an earlier one wrote.

Greedy float32 on the CPU, so "the same tokens as a cold run" is token-exact. Each test
runs a first engine into a cache directory, closes it (the writes and the index land),
then starts a new engine on that directory.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import mlx.core as mx
import pytest

from deltaserve.engine.config import EngineConfig, KVCacheConfig
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.prefix_cache.disk import INDEX, PrefixDisk, decode, encode
from deltaserve.engine.prefix_cache.store import _from_host, _to_host
from deltaserve.engine.types import GenerationRequest, SamplingParams
from deltaserve.models.build import LoadedModel, load_model
from deltaserve.models.testing import cached_checkpoint

BLOCK = 16
FP = KVCacheConfig()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(str(cached_checkpoint("tiny")))


def _config(cache_dir: Path | str | None, kv: KVCacheConfig = FP, **kw) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=48,
        max_prefill_chunk=24,
        prefix_cache=cache_dir is not None,
        prefix_cache_dir=str(cache_dir or ""),
        prefix_block_tokens=BLOCK,
        prefix_min_tokens=1,
        kv_cache=kv,
        **kw,
    )


def _run(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """One request alone: its greedy tokens and the cached-token count it reported."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(GenerationRequest("one", tuple(prompt), params))
    tokens, cached = [], -1
    while engine.has_work():
        for delta in engine.step():
            tokens += delta.token_ids
            cached = delta.num_cached_tokens
    return tokens, cached


def _chat(seed: int = 0) -> tuple[list[int], list[int]]:
    """A first turn of 4 blocks + 5 tokens (snapshot at 64) and a next turn extending it."""
    rng = random.Random(seed)
    first = [rng.randrange(100, 240000) for _ in range(4 * BLOCK + 5)]
    return first, first + [rng.randrange(100, 240000) for _ in range(20)]


def _cold(loaded: LoadedModel, *prompts: list[int]) -> list[list[int]]:
    return [_run(LLMEngine(loaded, _config(None)), p)[0] for p in prompts]


def _first_engine(loaded: LoadedModel, cache_dir: Path, prompt: list[int], **kw) -> None:
    engine = LLMEngine(loaded, _config(cache_dir, **kw))
    _run(engine, prompt)
    engine.close()


def _files(cache_dir: Path, suffix: str = "") -> list[Path]:
    return sorted(p for p in cache_dir.rglob(f"*{suffix}") if p.is_file() and p.name != INDEX)


def test_restart_resumes_the_next_turn_token_exact(tiny: LoadedModel, tmp_path: Path) -> None:
    """A new engine on the same checkpoint and directory serves the next turn (and the
    resent first turn) from disk, equal to cold runs; what it loaded is in the budget."""
    first, second = _chat()
    want = _cold(tiny, second, first)
    _first_engine(tiny, tmp_path, first)
    engine = LLMEngine(tiny, _config(tmp_path))
    assert _run(engine, second) == (want[0], 4 * BLOCK)
    assert _run(engine, first) == (want[1], 4 * BLOCK)
    assert engine.states.prefix.nbytes() == engine.prefix_cache.stats.nbytes > 0
    engine.close()


@pytest.mark.parametrize("suffix", [".snap", ".kv"])
def test_a_corrupt_file_is_skipped_with_a_warning(
    tiny: LoadedModel, tmp_path: Path, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes flipped in a snapshot or a KV block: never served (the next turn prefills
    cold, the same tokens), a warning, and the corrupt file is dropped."""
    first, second = _chat(1)
    (want,) = _cold(tiny, second)
    _first_engine(tiny, tmp_path, first)
    victim = _files(tmp_path, suffix)[0]
    data = bytearray(victim.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    victim.write_bytes(bytes(data))
    engine = LLMEngine(tiny, _config(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert _run(engine, second) == (want, 0)
    assert "corrupt" in caplog.text
    engine.close()
    # gone, or written again from the cold run's state (a block of the same tokens)
    assert not victim.exists() or victim.read_bytes() != bytes(data)


@pytest.mark.parametrize("other", ["tiny-moe", "affine8"])
def test_another_checkpoint_or_kv_kind_reads_nothing(
    tiny: LoadedModel, tmp_path: Path, other: str
) -> None:
    first, second = _chat(2)
    _first_engine(tiny, tmp_path, first)
    if other == "tiny-moe":
        loaded, kv = load_model(str(cached_checkpoint("tiny-moe"))), KVCacheConfig()
    else:
        loaded, kv = tiny, KVCacheConfig(kind="affine", bits=8)
    engine = LLMEngine(loaded, _config(tmp_path, kv))
    assert _run(engine, second)[1] == 0
    engine.close()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # one per identity


def test_the_disk_bound_evicts_the_oldest_files(tiny: LoadedModel, tmp_path: Path) -> None:
    """With room for 1.5 chats' files, a third chat pushes out the first one's."""
    chats = [_chat(10 + i) for i in range(3)]
    probe = tmp_path / "probe"
    _first_engine(tiny, probe, chats[0][0])
    one_chat = sum(p.stat().st_size for p in _files(probe))
    bound = 1.5 * one_chat / 2**30
    cache_dir = tmp_path / "bounded"
    engine = LLMEngine(tiny, _config(cache_dir, prefix_cache_disk_gib=bound))
    for first, _ in chats:
        _run(engine, first)
    engine.close()
    assert sum(p.stat().st_size for p in _files(cache_dir)) <= 1.5 * one_chat
    engine = LLMEngine(tiny, _config(cache_dir, prefix_cache_disk_gib=bound))
    assert _run(engine, chats[2][1])[1] == 4 * BLOCK  # the newest resumes
    assert _run(engine, chats[0][1])[1] == 0  # the oldest was evicted
    engine.close()


def test_an_unwritable_dir_degrades_to_memory_only(
    tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = _chat(3)
    want = _cold(tiny, first, second)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(tiny, _config(blocker / "cache"))
    assert "memory only" in caplog.text and engine.prefix_cache.disk is None
    assert _run(engine, first) == (want[0], 0)
    assert _run(engine, second) == (want[1], 4 * BLOCK)  # the memory tier still serves
    engine.close()


def test_a_failing_write_degrades_to_memory_only(
    tiny: LoadedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full disk (OSError on write) turns the tier off with a warning; tokens as cold."""
    first, second = _chat(4)
    want = _cold(tiny, first, second)

    def full(self: PrefixDisk, name: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PrefixDisk, "_replace", full)
    engine = LLMEngine(tiny, _config(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert _run(engine, first) == (want[0], 0)
        assert _run(engine, second) == (want[1], 4 * BLOCK)
        engine.close()
    assert "memory only" in caplog.text and not engine.prefix_cache.disk.enabled


def test_bfloat16_and_quantized_arrays_round_trip_through_a_file() -> None:
    """numpy has no bfloat16: such arrays travel as their bits and come back equal."""
    arrays = [
        mx.random.normal((2, 3, 5)).astype(mx.bfloat16),
        mx.random.randint(0, 2**31, (4, 8)).astype(mx.uint32),
        mx.random.normal((3,)),
    ]
    host = [_to_host(a) for a in arrays]
    back = _from_host(*decode(encode(host, [str(a.dtype) for a in arrays])))
    for a, b in zip(arrays, back, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and mx.array_equal(a, b).item()
