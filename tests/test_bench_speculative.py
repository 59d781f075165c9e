"""bench.speculative's forced drafts: the engine accepts about the forced share, the
output stays the plain run's, and the real head's row is labelled as random weights.
Figures only; no time is asserted."""

from __future__ import annotations

import argparse

import pytest

from bench.engine_throughput import Ours
from bench.speculative import compare, steps_table, table
from deltaserve.engine.scheduling.speculation import Speculation
from deltaserve.models.testing import cached_checkpoint


def test_forced_drafts_keep_output_and_set_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows keep the acceptance floor, not the break-even measured from this run's step
    # times: on a busy CPU a verify can measure as not paying for any draft, and the 50%
    # run's rows then pause and draft nothing (a CI run at 73e55a5: 0 accepted of 0)
    monkeypatch.setattr(Speculation, "break_even", lambda self: None)
    ours = Ours(str(cached_checkpoint("tiny")), 256, 128)
    args = argparse.Namespace(
        gen=24, prompt=16, k=2, accept=["real", "1.0", "0.5"], seed=0, always=False,
        time_drafts=True, imposed=False,
    )  # fmt: skip
    plain, real, perfect, half = compare(ours.loaded, ours.config, 2, args, random_weights=True)
    assert plain["mode"] == "no speculation" and "random weights" in real["mode"]
    assert [r["same_output"] for r in (real, perfect, half)] == [True] * 3
    assert perfect["mode"] == "forced 100%" and perfect["acceptance"] > 0.9
    assert 0 < half["accepted"] < half["drafted"]
    assert plain["tokens"] == perfect["tokens"] == 2 * 24  # every token counted, runs too
    assert len(table([plain, real, perfect, half]).splitlines()) == 6
    # the measured run's steps by kind: the plain run only decodes, a forced-100% run
    # verifies (each verify writes up to k + 1 tokens, so fewer steps than tokens)
    assert plain["decode_steps"] > 0 and "verify_steps" not in plain
    assert 0 < perfect["verify_steps"] < perfect["tokens"]
    assert set(perfect["verify_host_ms"]) == {"schedule", "build", "submit", "sample", "update"}
    verify = [ln for ln in steps_table([plain, perfect]).splitlines() if "| verify |" in ln]
    # the draft chains' mean time (timed apart, within the verify step's), the verify
    # steps chained (none: the CPU runs steps in lockstep), the run's traced steps (none
    # on the CPU: nothing compiled, one run), then the break-even (None here: the floor)
    assert 0 < perfect["draft_ms"] < perfect["verify_ms"] and "draft_ms" not in plain
    assert perfect["traced"] == 0 and perfect["runs"] == 1
    draft = f"{perfect['draft_ms']:.2f}"
    assert len(verify) == 1 and verify[0].endswith(f"| {draft} | 0 | 0 | 1 |  |")


def test_forced_drafts_of_chained_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU's verify steps (compiled, pipelined, chained: pipeline_verify) the
    forced drafts of a chained verify are gathered from what the verify before it keeps,
    still computing: all right (100%), the output stays the plain run's, nearly every
    draft is accepted, and the steps table counts the chained verifies."""
    monkeypatch.setattr(Speculation, "break_even", lambda self: None)
    gpu = {"compile_decode": True, "pipeline_steps": True, "pipeline_verify": True}
    ours = Ours(str(cached_checkpoint("tiny")), 256, 128, **gpu)
    args = argparse.Namespace(
        gen=24, prompt=16, k=2, accept=["1.0"], seed=0, always=False, time_drafts=False,
        imposed=False,
    )  # fmt: skip
    plain, perfect = compare(ours.loaded, ours.config, 1, args, random_weights=True)
    assert perfect["same_output"] and perfect["acceptance"] > 0.9
    assert perfect["chained_steps"] > 0 and perfect["verify_steps"] > perfect["chained_steps"]
    verify = [ln for ln in steps_table([plain, perfect]).splitlines() if "| verify |" in ln]
    assert f" | {perfect['chained_steps']} | 0 | " in verify[0]


@pytest.mark.parametrize("gpu", [False, True], ids=["lockstep", "chained"])
def test_imposed_acceptance_sets_the_rate_in_any_dtype(
    monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    """--imposed: each verify keeps its leading run of drafts kept with the given share,
    whatever the drafts were (the head's, random weights': ~0% on their own), in lockstep
    and chained verifies alike; every request still gets its tokens, and the output is
    reported as not comparable (speed only)."""
    monkeypatch.setattr(Speculation, "break_even", lambda self: None)
    flags = {"compile_decode": True, "pipeline_steps": True, "pipeline_verify": True}
    ours = Ours(str(cached_checkpoint("tiny")), 256, 128, **(flags if gpu else {}))
    args = argparse.Namespace(
        gen=24, prompt=16, k=2, accept=["1.0", "0.5"], seed=0, always=True, time_drafts=False,
        imposed=True,
    )  # fmt: skip
    plain, every, half = compare(ours.loaded, ours.config, 2, args, random_weights=True)
    assert every["mode"] == "imposed 100%" and half["mode"] == "imposed 50%"
    assert every["acceptance"] == 1.0 and every["drafted"] > 0
    # a draft after a rejected one is never accepted: p + p^2 of k = 2 at p = 0.5, 37.5%
    assert 0.15 < half["acceptance"] < 0.6, half
    assert plain["tokens"] == every["tokens"] == half["tokens"] == 2 * 24
    assert every["same_output"] is None and "| 100% | n/a |" in table([plain, every])
    assert every["verify_steps"] < half["verify_steps"]  # more tokens a verify at 100%
    if gpu:
        assert every["chained_steps"] > 0


def test_a_measured_run_that_traced_runs_again_on_the_same_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_steady: bench.engine_throughput's steady without shifted prompts (the forced
    drafts are the plain run's outputs for them), with the last run's steps."""
    import bench.engine_throughput as et
    import bench.speculative as spec

    calls = iter([3, 1, 0])
    shifts: list[int] = []

    def fake(impl: object, *shape: int, shift: int = 0) -> dict:
        shifts.append(shift)
        return {"tok_s": 1.0, "traced": next(calls)}

    monkeypatch.setattr(et, "throughput", fake)

    class Impl:
        def steps(self) -> dict:
            return {"decode_steps": 5}

    row = spec._steady(Impl(), (1, 2, 2, 4, 4, 2))  # type: ignore[arg-type]
    assert row["runs"] == 3 and row["traced"] == 0 and row["decode_steps"] == 5
    assert shifts == [0, 0, 0]
