"""Tensor parallel (models/parallel.py, engine/parallel/tensor_parallel.py).

The proof: two processes under `mlx.launch` (ring backend, loopback, CPU) give greedy
outputs token-exact with one process, for a dense, a tied, an MoE and a quantized
checkpoint and the affine and TurboQuant KV stores, with rows joining and leaving, chunked
prefill, n = 2 seeded forks, an abort and a prefix-cache hit (tests/tp_scenarios.py).
Plus the pieces alone: how tensors split, the watchdog.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import tests.tp_scenarios as scenarios
from deltaserve.engine.parallel.tensor_parallel import HEARTBEAT_S, STOP, Leader, Watchdog
from deltaserve.engine.plan import NewRow, PrefillChunk, StepPlan
from deltaserve.engine.types import SamplingParams
from deltaserve.models.config import TextConfig
from deltaserve.models.loader import load_checkpoint, scales_name
from deltaserve.models.parallel import ShardError, shard_config, shard_tensor, shard_weights
from deltaserve.models.testing import cached_checkpoint
from tests.processes import ring_envs

REPO = Path(__file__).resolve().parent.parent


def _config(name: str) -> TextConfig:
    return TextConfig.from_dict(json.loads((cached_checkpoint(name) / "config.json").read_text()))


@pytest.fixture(scope="module")
def two_rank_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every scenario's outputs from rank 0 of a two-process run."""
    for name, _ in scenarios.SCENARIOS.values():
        cached_checkpoint(name)  # written once, before two processes race to write it
    tmp = tmp_path_factory.mktemp("tp")
    out, logs = tmp / "outputs.json", [tmp / "rank0.log", tmp / "rank1.log"]
    command = [sys.executable, str(REPO / "tests" / "tp_scenarios.py"), str(out)]
    procs = []
    for env, log in zip(ring_envs(tmp), logs, strict=True):
        with log.open("w") as f:
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=f))
    codes = [p.wait(900) for p in procs]
    assert codes == [0, 0] and out.is_file(), "\n".join(f.read_text()[-3000:] for f in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", list(scenarios.SCENARIOS))
def test_two_ranks_equal_one_process(two_rank_outputs: dict, scenario: str) -> None:
    alone = scenarios.run(None, [scenario])[scenario]
    assert two_rank_outputs[scenario] == alone
    # the scenario exercises what it claims to
    assert alone["r2/0"][-1] == "<abort:0>" and len(alone["r2/0"]) < 1 + scenarios.MAX_TOKENS[2]
    assert alone["cached/0"][-1].endswith(":64>")  # resumed from the prefix cache
    assert alone["forks/0"] != alone["forks/1"]


# --------------------------------------------------------------------------- shapes


def test_shard_config_splits_heads_and_widths() -> None:
    cfg = _config("tiny-moe")
    half = shard_config(cfg, 2)
    assert half.num_attention_heads == cfg.num_attention_heads // 2
    assert half.num_key_value_heads == cfg.num_key_value_heads // 2
    assert half.linear_num_value_heads == cfg.linear_num_value_heads // 2
    assert half.moe_intermediate_size == cfg.moe_intermediate_size // 2
    assert half.conv_dim == cfg.conv_dim // 2
    assert (half.vocab_size, half.hidden_size) == (cfg.vocab_size, cfg.hidden_size)
    with pytest.raises(ShardError, match="num_key_value_heads=2"):
        shard_config(cfg, 4)


def test_deltanet_qkv_split_keeps_each_rank_its_own_heads() -> None:
    cfg = _config("tiny")
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    rows = mx.arange(cfg.conv_dim)
    parts = [shard_tensor("layers.0.linear_attn.conv1d.weight", rows, cfg, r, 2) for r in (0, 1)]
    half_key = key_dim // 2
    assert parts[0][:half_key].tolist() == list(range(half_key))  # q heads 0..
    assert parts[0][half_key : 2 * half_key].tolist() == list(range(key_dim, key_dim + half_key))
    assert parts[1][0].item() == half_key  # rank 1: the second half of q first
    assert sorted(mx.concatenate(parts).tolist()) == list(range(cfg.conv_dim))


def test_quantized_weights_split_in_packed_form() -> None:
    """Slicing the packed weight, scales and biases equals slicing the dequantized weight,
    for row-split and column-split layers alike."""
    path = cached_checkpoint("tiny-mlx-4bit")
    ckpt = load_checkpoint(path, keep_quantized=True)
    cfg = TextConfig.from_dict(ckpt.config)
    names = ["layers.3.self_attn.q_proj.weight", "layers.3.self_attn.o_proj.weight"]
    names += ["layers.0.linear_attn.in_proj_qkv.weight", "layers.0.mlp.down_proj.weight"]
    for name in names:
        spec = ckpt.quantization[name]
        w, s = ckpt.weights[name], ckpt.weights[scales_name(name)]
        b = ckpt.weights[name.removesuffix(".weight") + ".biases"]
        full = mx.dequantize(w, s, b, spec["group_size"], spec["bits"])
        for rank in (0, 1):
            parts = [shard_tensor(name, x, cfg, rank, 2) for x in (w, s, b)]
            got = mx.dequantize(*parts, spec["group_size"], spec["bits"])
            assert mx.array_equal(got, shard_tensor(name, full, cfg, rank, 2)), name


def test_tied_checkpoint_gets_a_head_slice() -> None:
    cfg = _config("tiny-tied")
    weights = {"embed_tokens.weight": mx.arange(cfg.vocab_size)[:, None]}
    shard_weights(cfg, 1, 2)(weights, None)
    assert weights["embed_tokens.weight"].shape[0] == cfg.vocab_size  # embedding whole
    assert weights["lm_head.weight"][0].item() == cfg.vocab_size // 2


# --------------------------------------------------------------------------- watchdog


def test_watchdog_fires_only_on_a_wait_that_outlasts_it() -> None:
    fired: list[str] = []
    event = threading.Event()
    dog = Watchdog(0.3, lambda message: (fired.append(message), event.set()))
    with dog.guard("a quick wait"):
        pass
    assert not event.wait(0.6) and not fired
    with dog.guard("a plan"):
        assert event.wait(5)
    assert "within 0.3 s while waiting for a plan" in fired[0]


# --------------------------------------------------------------------------- leader


class _Recorder:
    """A Channel stand-in that keeps what rank 0 sends."""

    def __init__(self) -> None:
        self.sent: list[StepPlan | None] = []

    def send(self, plan: StepPlan | None) -> None:
        self.sent.append(plan)


def test_leader_sends_the_plan_itself_then_heartbeats_and_stop() -> None:
    """Followers get the very plan rank 0 runs (a new row's prompt inside it), an empty
    plan as an idle heartbeat, and STOP at shutdown."""
    channel, lost = _Recorder(), []
    leader = Leader(channel, Watchdog(30), on_lost=lost.append)
    row = NewRow("a/0", (1, 2, 3, 4), SamplingParams(), 0)
    plan = StepPlan(new_rows=(row,), prefill=(PrefillChunk("a/0", 0, 2),), num_tokens=2)
    leader.publish(plan)
    leader._last_sent -= HEARTBEAT_S
    leader.heartbeat()
    leader.stop()
    assert channel.sent[0] is plan and channel.sent[0].new_rows[0].prompt_ids == (1, 2, 3, 4)
    assert channel.sent[1] == StepPlan() and channel.sent[1].is_empty
    assert channel.sent[2] is STOP and not lost


def test_a_failed_step_on_rank_0_ends_the_group() -> None:
    lost: list[str] = []
    done = threading.Event()
    leader = Leader(_Recorder(), Watchdog(30), on_lost=lambda m: (lost.append(m), done.set()))
    leader.fail("engine error: boom")
    assert done.wait(5) and "a step failed on rank 0 (engine error: boom)" in lost[0]


def test_watchdog_guards_nest() -> None:
    """An inner guard (a plan sent inside a step) hands the outer limit back: the rest of
    the step stays guarded."""
    fired = threading.Event()
    dog = Watchdog(0.3, lambda message: fired.set())
    with dog.guard("a step"):
        with dog.guard("a plan", timeout_s=5):
            assert not fired.wait(0.5)  # the inner limit holds
        assert fired.wait(5)  # the outer one is back and runs out
