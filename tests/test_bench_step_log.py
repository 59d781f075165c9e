"""bench.step_log joins a debug log's three lines a step and names the slow steps."""

from __future__ import annotations

from bench.step_log import Step, chunk_lags, parse, report, stream_gaps

LOG = """\
2026-12-06 08:34:00,001 DEBUG deltaserve.engine.runner: step 7 forwards: decode 4 compiled
2026-12-06 08:34:00,002 DEBUG deltaserve.engine.scheduling.scheduler: step 7: 4 decode rows, 0 prompt tokens in 0 chunks (0 later, longest 0), 0 tower units: 0.005 s
2026-12-06 08:34:00,003 DEBUG deltaserve.engine.engine: step 7 host 4.5 ms (schedule / build / submit / sample / update: 0.1 / 0.9 / 3.2 / 0.2 / 0.1), waited 0.1 ms; MLX active 2400 MiB, cache 4000 MiB
2026-12-06 08:34:00,004 DEBUG deltaserve.engine.runner: step 8 forwards: decode 4 compiled, prompt run 2 rows
2026-12-06 08:34:00,005 DEBUG deltaserve.engine.scheduling.scheduler: step 8: 4 decode rows, 300 prompt tokens in 2 chunks (0 later, longest 200), 0 tower units: 0.031 s
2026-12-06 08:34:00,006 DEBUG deltaserve.engine.engine: step 8 host 30.0 ms (schedule / build / submit / sample / update: 0.3 / 4.0 / 25.0 / 0.5 / 0.2), waited 0.2 ms; MLX active 2500 MiB, cache 4010 MiB
2026-12-06 08:34:00,007 DEBUG deltaserve.engine.scheduling.scheduler: step 9: 4 decode rows, 0 prompt tokens in 0 chunks (0 later, longest 0), 0 tower units: 0.006 s
2026-12-06 08:34:00,008 INFO deltaserve.requests: request x route=chat prompt=5
2026-12-06 08:34:00,009 DEBUG deltaserve.engine.scheduling.scheduler: step 10: 3 decode rows, 0 prompt tokens in 0 chunks (0 later, longest 0), 0 tower units: 0.020 s
2026-12-06 08:34:00,010 DEBUG deltaserve.engine.engine: step 10 host 6.0 ms (schedule / build / submit / sample / update: 0.1 / 0.9 / 4.6 / 0.2 / 0.2), waited 1.0 ms; MLX active 2400 MiB, cache 4000 MiB
"""  # noqa: E501


def test_steps_are_joined_and_the_slow_ones_listed() -> None:
    steps = parse(LOG.splitlines())
    kinds = [(s.number, s.kind) for s in steps]
    assert kinds == [(7, "decode"), (8, "mixed"), (9, "decode"), (10, "decode")]
    mixed = steps[1]
    assert (mixed.decode_rows, mixed.prompt_tokens, mixed.chunks) == (4, 300, 2)
    assert (mixed.wall_ms, mixed.host_ms, mixed.submit_ms, mixed.cache_mib) == (31, 30, 25, 4010)
    assert mixed.forwards == "decode 4 compiled, prompt run 2 rows"
    assert steps[2].host_ms is None  # no engine line for it
    assert steps[3].outside_ms == 13.0  # 20 ms of wall, 6 of host, 1 waiting on the device
    lines = report(steps, over=3.0)
    assert "| decode | 3 | 6.0 | 20.0 | 20.0 | 20.0 |" in lines  # the upper median of 3
    # a row left between steps 9 and 10; step 9 (after the mixed step) has no host line
    assert "| a row gone | 1 | 20.0 / 20.0 | 6.0 | 1.0 | 13.0 / 13.0 |" in lines
    assert not any(line.startswith("| after a mixed step") for line in lines)
    slow = [line for line in lines if line.startswith("| 8 |")]
    assert slow == [
        "| 8 | 31.0 | 4 | 300 | 2 | 30.0 | 4.0 / 25.0 | 0.2 | 4010 | "
        "decode 4 compiled, prompt run 2 rows |"
    ]
    assert "2 of 4 steps over 3x the median decode step (18.0 ms):" in lines


def test_long_stream_gaps_are_set_beside_the_steps_inside_them() -> None:
    steps = [
        Step(1, 2, 0, 0, 10.0, 100.000),
        Step(2, 2, 0, 0, 10.0, 100.010),
        Step(3, 2, 300, 1, 30.0, 100.040),
        Step(4, 2, 0, 0, 10.0, 100.050),
        Step(5, 2, 0, 0, 10.0, 100.060),
    ]
    streams = [
        [100.001, 100.011, 100.041, 100.051, 100.061],  # a chunk a step: one 30 ms gap
        [100.001, 100.011, 100.051, 100.061],  # step 3's token came with step 4's
    ]
    lines = stream_gaps(steps, streams, over=2.0)
    assert lines[0] == (
        "2 of 7 stream gaps over 2x their median (10.0 ms; p99 40.0 ms), "
        "by the steps finished inside:"
    )
    assert "| 1 / mixed | 1 | 30.0 / 30.0 | 30.0 | 1.0 / 1.0 | 0 |" in lines
    assert "| 2 / mixed+decode | 1 | 40.0 / 40.0 | 30.0 | 1.0 / 1.0 | 1 |" in lines


def test_every_chunks_lag_is_put_to_the_last_step_before_it() -> None:
    """Each chunk (but a stream's first) counts to the last step finished before it, by
    that step's kind, decode steps by what came before them."""
    steps = [
        Step(1, 2, 0, 0, 10.0, 100.000),
        Step(2, 2, 300, 1, 30.0, 100.030),
        Step(3, 2, 0, 0, 10.0, 100.040),
        Step(4, 2, 0, 0, 10.0, 100.050),
    ]
    streams = [
        [100.001, 100.038, 100.041, 100.052],  # 8 ms after the mixed step, 1 and 2 after decode
        [100.002, 100.034, 100.043, 100.0515],
    ]
    lines = chunk_lags(steps, streams)
    assert lines[0].startswith("| last step before the chunk | chunks |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert set(rows) == {"mixed", "decode, after a mixed step", "decode, rows steady"}
    # lags 8 and 4 ms, 1 and 3, 2 and 1.5 (_percentile takes the upper of two)
    assert rows["mixed"] == "| mixed | 2 | 8.0 / 8.0 / 8.0 |"
    after = "| decode, after a mixed step | 2 | 3.0 / 3.0 / 3.0 |"
    assert rows["decode, after a mixed step"] == after
    assert rows["decode, rows steady"] == "| decode, rows steady | 2 | 2.0 / 2.0 / 2.0 |"
    assert chunk_lags([], streams) == ["(no chunks after a time-stamped step)"]


def test_log_time_stamps_are_read_as_unix_seconds() -> None:
    steps = parse(LOG.splitlines())
    assert steps[1].done_s is not None and steps[0].done_s is not None
    assert round(1e3 * (steps[1].done_s - steps[0].done_s)) == 3  # ,002 -> ,005
