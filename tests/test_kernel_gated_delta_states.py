"""The DeltaNet recurrence with the state kept after every token (a speculative verify
chunk), kernels/gated_delta.gated_delta(every_state=True), against the per-step reference.

On the CPU both paths are plain MLX (one decode step per token); on a CUDA machine
(bench/gpu_tests.sh) `scan=True` runs the scan kernel that writes every slot, and the
`cuda` case checks that the kernel is what ran.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from deltaserve.kernels.gated_delta import gated_delta, gated_delta_reference
from deltaserve.kernels.gated_delta_scan import gated_delta_scan
from tests.test_kernel_gated_delta import make_inputs

HAS_CUDA = mx.default_device() != mx.cpu and mx.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="the scan kernel runs on CUDA only")
# GPU float32 reductions may reorder; the CPU loop is the reference arithmetic itself
TOL = 2e-4 if HAS_CUDA else 1e-5

# (B, L, Hk, Hv, D): verify chunks of 1 + k tokens, k = 0..3, and the real head sizes
SHAPES = [(1, 1, 2, 2, 32), (2, 2, 2, 4, 32), (3, 4, 1, 2, 64), (2, 4, 16, 32, 128)]


def _close(a: mx.array, b: mx.array) -> None:
    err = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    assert err <= TOL * max(1.0, mx.abs(b.astype(mx.float32)).max().item()), err


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scan", [False, True])
def test_slot_t_is_state_after_first_t_plus_1_tokens(shape: tuple[int, ...], scan: bool) -> None:
    """states[:, t] equals the state of feeding tokens 0..t alone; y equals the loop's."""
    x = make_inputs(*shape, seed=sum(shape))
    y, states = gated_delta(*x, scan=scan, every_state=True)
    assert states.shape == (shape[0], shape[1], *x[5].shape[1:])
    y_ref, _ = gated_delta_reference(*x)
    _close(y, y_ref)
    q, k, v, g, beta, state = x
    for t in range(shape[1]):
        prefix = (a[:, : t + 1] for a in (q, k, v, g, beta))
        _, s_ref = gated_delta_reference(*prefix, state)
        _close(states[:, t], s_ref)


def test_reference_every_state_matches_states() -> None:
    """The reference loop's every_state output is the same stack of states."""
    x = make_inputs(2, 3, 2, 2, 32, seed=4)
    _, every = gated_delta_reference(*x, every_state=True)
    _, states = gated_delta(*x, every_state=True)
    _close(states, every)


def test_fresh_rows_start_from_zeros() -> None:
    """state None is the zero state, as for gated_delta."""
    q, k, v, g, beta, _ = make_inputs(1, 3, 2, 2, 32, seed=9)
    _, states = gated_delta(q, k, v, g, beta, None, every_state=True)
    _, ref = gated_delta_reference(q, k, v, g, beta, None, every_state=True)
    _close(states, ref)


@cuda
def test_kernel_is_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA scan=True runs the slot-writing kernel: with the reference loop and the
    per-token step broken, the result is still right."""
    import deltaserve.kernels.gated_delta as dispatch
    import deltaserve.kernels.gated_delta_scan as scan

    x = make_inputs(2, 4, 16, 16, 128, seed=5)
    ref = gated_delta_reference(*x, every_state=True)

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("a plain path ran instead of the kernel")

    monkeypatch.setattr(scan, "gated_delta_reference", broken)
    monkeypatch.setattr(dispatch, "gated_delta_step_fused", broken)
    y, states = gated_delta_scan(*x, every_state=True)
    _close(y, ref[0])
    _close(states, ref[1])
