"""bench.collapsed: a sampled profile's collapsed stacks summed by function."""

from __future__ import annotations

from pathlib import Path

from bench.collapsed import read_stacks, shares

RAW = """\
p;main (gpu.py:10);step (engine.py:5);execute (runner.py:208);build (runner.py:400) 30
p;main (gpu.py:10);step (engine.py:5);execute (runner.py:209);submit (runner.py:300) 50
p;main (gpu.py:10);step (engine.py:7);update (engine.py:430) 20
a line without a count
"""


def test_functions_are_summed_across_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    stacks = read_stacks(path)
    assert len(stacks) == 3  # the line without a count is skipped
    total, inclusive, own = shares(stacks)
    assert total == 100
    assert inclusive["execute (runner.py)"] == 80  # two line numbers, one function
    assert inclusive["step (engine.py)"] == 100
    assert own == {"build (runner.py)": 30, "submit (runner.py)": 50, "update (engine.py)": 20}


def test_under_keeps_the_stacks_through_a_frame(tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    total, inclusive, own = shares(read_stacks(path), under="execute (")
    assert total == 80
    assert "step (engine.py)" not in inclusive  # frames above the one asked for are cut
    assert own["submit (runner.py)"] == 50
