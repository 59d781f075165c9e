"""The DeltaNet scan kernel (kernels/gated_delta_scan.py) against the per-step reference.

On the CPU `gated_delta_scan` is the reference loop and `gated_delta(..., scan=True)`
must ignore the flag (the CPU keeps the chunked form): those cases run everywhere. On a
CUDA machine (`python -m pytest tests/test_kernel_gated_delta_scan.py`, bench/gpu_tests.sh)
the same cases run the kernel, and the `cuda` ones check that the kernel is what ran and
that a DeltaNet layer's output through it matches the chunked path.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from deltaserve.kernels.gated_delta import gated_delta, gated_delta_reference
from deltaserve.kernels.gated_delta_scan import gated_delta_scan
from tests.test_kernel_gated_delta import assert_close, left_pad_mask, make_inputs

HAS_CUDA = mx.default_device() != mx.cpu and mx.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="the scan kernel runs on CUDA only")

# (B, L, Hk, Hv, D): one token, a chunk shorter than a warp's rows, repeat-interleaved
# heads, a length past the chunked form's 64, and the 0.8B / 9B layer shapes.
SHAPES = [(1, 1, 2, 2, 32), (2, 5, 2, 4, 32), (3, 70, 1, 2, 64), (1, 16, 16, 16, 128)]
SHAPES_BIG = [(2, 300, 16, 16, 128), (4, 64, 16, 32, 128)]


@pytest.mark.parametrize("shape", SHAPES + (SHAPES_BIG if HAS_CUDA else []))
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(shape: tuple[int, ...], masked: bool) -> None:
    """y and the float32 state equal the per-step float32 loop (left-padded rows too)."""
    b, length = shape[:2]
    x = make_inputs(*shape, seed=sum(shape))
    mask = left_pad_mask(length, [(3 * i) % length for i in range(b)]) if masked else None
    assert_close(gated_delta_scan(*x, mask), gated_delta_reference(*x, mask))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_inputs(dtype: mx.Dtype) -> None:
    """Half-precision v (as a model's projections give) comes back as y in that dtype,
    within one half-precision step of the float32 loop on the same rounded inputs."""
    x = make_inputs(2, 24, 2, 4, 32, seed=7)
    q, k, v, g, beta = (a.astype(dtype) for a in x[:5])
    state = x[5]
    y, s = gated_delta_scan(q, k, v, g, beta, state)
    y_ref, s_ref = gated_delta_reference(q, k, v, g, beta, state)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item() < 2e-2
    assert mx.abs(s - s_ref).max().item() < 1e-3


def test_masked_steps_keep_state_exactly() -> None:
    """A row whose every step is masked keeps its state bit for bit and yields zeros."""
    x = make_inputs(2, 12, 2, 2, 32, seed=3)
    mask = mx.array([[False] * 12, [True] * 12])
    y, s = gated_delta_scan(*x, mask)
    assert mx.array_equal(s[0], x[5][0]).item()
    assert mx.abs(y[0]).max().item() == 0.0


def test_dispatcher_flag_matches_reference() -> None:
    """gated_delta(scan=True) matches the per-step loop on every backend (on the CPU the
    flag is ignored: the chunked call). Not compared with the chunked form on CUDA, whose
    float32 matmuls run at reduced precision there (1.2e-4 off, measured on an H200)."""
    x = make_inputs(2, 40, 2, 4, 32, seed=11)
    mask = left_pad_mask(40, [0, 9])
    assert_close(gated_delta(*x, mask, scan=True), gated_delta_reference(*x, mask))


def test_bad_shapes_raise() -> None:
    """Mismatched q/k or gate shapes are a ValueError naming them, not a kernel fault."""
    q, k, v, g, beta, state = make_inputs(1, 4, 2, 2, 32)
    with pytest.raises(ValueError, match="q"):
        gated_delta_scan(q[:, :3], k, v, g, beta, state)
    with pytest.raises(ValueError, match="g"):
        gated_delta_scan(q, k, v, g[:, :3], beta, state)


def test_broadcast_mask_matches_reference() -> None:
    """A mask the reference broadcasts ([1, L]: the same pads for every row) gives the
    same result: the kernel reads mask[b * L + t], so it must get a full [B, L] array."""
    x = make_inputs(3, 20, 2, 4, 32, seed=13)
    mask = left_pad_mask(20, [6])  # [1, L]
    assert_close(gated_delta_scan(*x, mask), gated_delta_reference(*x, mask))


@cuda
def test_9b_prefill_cohort() -> None:
    """The largest prompt group a 9B step runs: 16 rows x 768 tokens, Hk = 16 key heads for
    Hv = 32 value heads, rows left-padded from none to all (a dead row) of the columns."""
    b, length = 16, 768
    x = make_inputs(b, length, 16, 32, 128, seed=9)
    pads = [0, 1, 7, 63, 64, 200, 383, 384, 500, 600, 700, 750, 760, 766, 767, 768]
    mask = left_pad_mask(length, pads)
    assert_close(gated_delta_scan(*x, mask), gated_delta_reference(*x, mask))


@cuda
def test_kernel_is_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the dispatcher sends L > 1 to the kernel: with the reference loop broken,
    the result is still right."""
    import deltaserve.kernels.gated_delta_scan as scan

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference loop ran instead of the kernel")

    monkeypatch.setattr(scan, "gated_delta_reference", broken)
    x = make_inputs(1, 33, 16, 16, 128, seed=5)
    assert_close(gated_delta(*x, scan=True), gated_delta_reference(*x))


@cuda
@pytest.mark.parametrize("length", [16, 200])
def test_deltanet_layer_scan_matches_chunked(length: int) -> None:
    """A 0.8B-sized DeltaNet layer's prompt output and state are the same (bf16 rounding
    aside) with the recurrence as the scan kernel or the chunked form."""
    from deltaserve.models.config import TextConfig
    from deltaserve.models.deltanet import GatedDeltaNet
    from deltaserve.models.testing.config import resolve_shape, text_config

    layer = GatedDeltaNet(TextConfig.from_dict(text_config(resolve_shape("0.8B", False))))
    layer.set_dtype(mx.bfloat16)
    x = (0.5 * mx.random.normal((2, length, 1024), key=mx.random.key(1))).astype(mx.bfloat16)

    class State:
        conv = None
        ssm = None
        checkpoint = None

    outs = []
    for scan_on in (True, False):
        layer.scan_prefill = scan_on
        state = State()
        outs.append((layer(x, state, None, None), state.ssm))
    (y1, s1), (y2, s2) = outs
    assert mx.abs(s1 - s2).max().item() < 1e-2 * max(1.0, mx.abs(s2).max().item())
    err = mx.abs(y1.astype(mx.float32) - y2.astype(mx.float32)).max().item()
    assert err < 3e-2 * max(1.0, mx.abs(y2.astype(mx.float32)).max().item())
