"""bench.serve's figures from the streams and /metrics: the steady state (chunks while
at least 90% of the clients stream) and the engine's steps between two scrapes. Pure
arithmetic on made-up timings; no server runs and no time is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import bench.serve
from bench.serve import _at_full_concurrency, _inproc, _prompts, _steps_between


def test_the_steady_state_is_where_nearly_every_client_streams() -> None:
    """Two streams overlapping over [2, 3]: with 2 clients only that second counts (its
    5 chunks); with 1 client the whole [1, 4]; with 3 clients never."""
    streams = [[1.0, 1.5, 2.0, 2.5, 3.0], [2.0, 2.2, 3.5, 4.0]]
    assert _at_full_concurrency(streams, 2) == (1.0, 5)
    assert _at_full_concurrency(streams, 1) == (3.0, 9)
    assert _at_full_concurrency(streams, 3) == (0.0, 0)
    # a client's second request after a gap: the steady state pauses and resumes
    spans = [[0.0, 1.0], [0.0, 0.4], [0.6, 1.0]]  # 90% of 2 clients: both streaming
    assert _at_full_concurrency(spans, 2) == (0.8, 6)


def test_engine_steps_between_two_scrapes() -> None:
    """Per kind: count, mean, host share and the steps over 0.1 / 0.25 s of this phase only (the
    scrape before it subtracted); traced steps and full GCs likewise."""
    step = "deltaserve_step_seconds"
    before = {
        (f"{step}_count", "decode/"): 10.0,
        (f"{step}_sum", "decode/"): 0.1,
        (f"{step}_bucket", "decode/0.1"): 10.0,
        (f"{step}_bucket", "decode/0.25"): 10.0,
        ("deltaserve_step_host_seconds_total", "decode/"): 0.05,
        ("deltaserve_step_host_part_seconds_total", "decode:submit/"): 0.02,
        ("deltaserve_traced_steps_total", "/"): 3.0,
    }
    after = {
        (f"{step}_count", "decode/"): 30.0,
        (f"{step}_sum", "decode/"): 1.1,
        (f"{step}_bucket", "decode/0.1"): 27.0,
        (f"{step}_bucket", "decode/0.25"): 29.0,
        ("deltaserve_step_host_seconds_total", "decode/"): 0.15,
        ("deltaserve_step_host_part_seconds_total", "decode:submit/"): 0.1,
        ("deltaserve_traced_steps_total", "/"): 4.0,
        ("deltaserve_gc_pause_seconds_count", "2/"): 1.0,
        ("deltaserve_gc_pause_seconds_sum", "2/"): 0.002,
    }
    got = _steps_between(before, after)
    assert got["decode"] == {
        "n": 20,
        "mean_ms": 50.0,
        "host_ms": 5.0,
        "host_parts_ms": {
            "schedule": 0.0,
            "build": 0.0,
            "submit": 4.0,
            "sample": 0.0,
            "update": 0.0,
        },
        "over_100ms": 3,
        "over_250ms": 1,
    }
    assert "mixed" not in got and got["traced"] == 1
    assert got["gc_full"] == 1 and got["gc_full_s"] == 0.002


def test_fixed_length_prompts_have_that_many_words() -> None:
    """--prompt-words: every prompt that long (the in-process run's one length); without it
    the lengths are drawn from 32-400 words."""
    fixed = _prompts(8, 2, words=96)
    assert [len(p.split()) for ps in fixed for p in ps] == [96] * 16
    drawn = {len(p.split()) for ps in _prompts(8, 2) for p in ps}
    assert len(drawn) > 1 and all(32 <= n <= 400 for n in drawn)


def test_the_server_is_put_against_its_engine_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--inproc: bench.gpu runs at B = each client count with the phase's median prompt
    tokens and --max-tokens; the share is the server's tok/s over the in-process tok/s
    (and the steady chunks/s over its decode rate); a failed run is an error row."""
    commands: list[list[str]] = []

    class Done:
        def __init__(self, code: int) -> None:
            self.code = code

        def wait(self) -> int:
            return self.code

    def launch(cmd: list[str], log: Path, preload_blas: bool = True) -> Done:
        commands.append(cmd)
        log.write_text("Traceback: out of memory")
        batch = int(cmd[cmd.index("--batches") + 1])
        if batch == 16:
            return Done(1)
        line = {"impl": "deltaserve", "batch": batch, "tok_s": 4000.0, "decode_tok_s": 6000.0}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(line) + "\n")
        return Done(0)

    monkeypatch.setattr(bench.serve, "launch", launch)
    args = argparse.Namespace(
        log_dir=tmp_path, max_tokens=128, on_cpu=False, ramp_s=0.0, requests_per_client=1
    )
    rows = [
        {
            "server": "deltaserve",
            "clients": 64,
            "tok_s": 3200.0,
            "prompt_tokens_p50": 110,
            "full_chunks_s": 5400.0,
        },
        {
            "server": "deltaserve",
            "clients": 16,
            "tok_s": 900.0,
            "prompt_tokens_p50": 90,
            "full_chunks_s": None,
        },
        {"server": "mlx_lm", "clients": 64, "tok_s": 250.0, "prompt_tokens_p50": 110},
    ]
    out = _inproc(Path("/ckpt/9B"), rows, args)
    assert [c[c.index("--batches") + 1] for c in commands] == ["16", "64"]
    assert commands[1][commands[1].index("--prompt") + 1] == "110"
    assert commands[1][commands[1].index("--gen") + 1] == "128"
    assert out[0]["clients"] == 16 and "out of memory" in out[0]["error"]
    assert out[1]["share"] == 0.8 and out[1]["steady_share"] == 0.9
    # all rows at once, one request each: the schedule allows the in-process decode rate
    assert out[1]["schedule_tok_s"] == 6000.0 and out[1]["schedule_share"] == 1.5


def test_the_arrival_schedule_caps_what_a_server_can_do() -> None:
    """The headline's schedule (a 2 s ramp, two requests a client one after another): the
    last client starts at 2 x 63/64 s and its two 128-token requests take 2 x 128 steps
    of 64 rows at 9,000 tok/s, so 16,384 tokens take >= 3.79 s."""
    from bench.serve import schedule_ceiling

    ceiling = schedule_ceiling(64, 2.0, 2, 128, 9000.0)
    wall = 2.0 * 63 / 64 + 2 * 128 * 64 / 9000.0
    assert ceiling == pytest.approx(64 * 2 * 128 / wall)
    assert 4300 < ceiling < 4350  # well under the 9,000 tok/s the rows decode at
    assert schedule_ceiling(64, 0.0, 1, 128, 9000.0) == pytest.approx(9000.0)
