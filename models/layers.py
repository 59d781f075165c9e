"""Token-wise building blocks of Qwen3.5: RMSNorm, interleaved mRoPE, SwiGLU MLP, MoE."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from deltaserve.kernels import fastmath, moe_experts
from deltaserve.kernels.platform import current_platform
from deltaserve.kernels.rms_norm import rms_norm
from deltaserve.models.fused import fuse_into


class RMSNorm(nn.Module):
    """RMSNorm whose `weight` holds the full gain (the loader folds HF's 1 + w in float32)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,), dtype=mx.float32)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # Gains stay float32 (bf16 would round 1 + w to steps of 2^-7); normalise in float32
        # (one kernel on the GPU for half-precision x: kernels/rms_norm.py).
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: weight * rmsnorm(x) * silu(gate); plain weight, no +1."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * rmsnorm(x) * silu(gate) in float32, returned in x's dtype (a pure function,
    so compiled callers pass the weight in)."""
    normed = mx.fast.rms_norm(x.astype(mx.float32), None, eps)
    out = weight.astype(mx.float32) * normed * fastmath.silu(gate.astype(mx.float32))
    return out.astype(x.dtype)


def mrope_axis_map(num_freqs: int, sections: tuple[int, ...]) -> list[int]:
    """Which position axis (0=T, 1=H, 2=W) drives each rotary frequency.

    Interleaved mRoPE: frequency j uses axis j % 3 while that axis has budget left in
    `sections`; with [11, 11, 10] over 32 frequencies the tail j = 30, 31 reads T then H.
    """
    axes = [0] * num_freqs
    for axis in (1, 2):
        idx = list(range(axis, num_freqs, 3))[: sections[axis]]
        for j in idx:
            axes[j] = axis
    return axes


class MRoPE(nn.Module):
    """Partial rotate-half rotary over the first `rotary_dim` dims with 3-D positions."""

    def __init__(self, rotary_dim: int, theta: float, sections: tuple[int, ...]) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        half = rotary_dim // 2
        self._inv_freq = 1.0 / (
            theta ** (mx.arange(0, rotary_dim, 2, dtype=mx.float32) / rotary_dim)
        )
        # [3, half] one-hot selector of the position axis per frequency (frozen constant)
        axes = mx.array(mrope_axis_map(half, sections))
        self._axis_onehot = (axes[None, :] == mx.arange(3)[:, None]).astype(mx.float32)
        # Materialise now: lazy constants are tied to this thread's stream, and the engine
        # runs the model from its own thread.
        mx.eval(self._inv_freq, self._axis_onehot)

    def cos_sin(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """positions [3, B, L] -> cos, sin of shape [B, 1, L, rotary_dim] (float32)."""
        pos = positions.astype(mx.float32)
        # angles per axis [3, B, L, half], then pick each frequency's axis
        angles = pos[..., None] * self._inv_freq
        angles = (angles * self._axis_onehot[:, None, None, :]).sum(axis=0)
        emb = mx.concatenate([angles, angles], axis=-1)[:, None]
        return mx.cos(emb), mx.sin(emb)

    def apply(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x [B, heads, L, D]: rotate the first rotary_dim dims, pass the rest through."""
        r = self.rotary_dim
        rot, rest = x[..., :r].astype(mx.float32), x[..., r:]
        first, second = rot[..., : r // 2], rot[..., r // 2 :]
        rotated = mx.concatenate([-second, first], axis=-1)
        out = (rot * cos + rotated * sin).astype(x.dtype)
        return mx.concatenate([out, rest], axis=-1)


def linear_plus(linear: nn.Module, x: mx.array, residual: mx.array | None) -> mx.array:
    """linear(x) + residual (linear(x) for None). A full-precision, bias-free projection
    adds the residual inside its matmul (`mx.addmm`): on a GPU a residual add is otherwise
    a kernel of its own, two per layer and step; a quantized one adds it after."""
    if residual is None:
        return linear(x)
    if type(linear) is nn.Linear and "bias" not in linear:
        return mx.addmm(residual, x, linear.weight.T)
    return residual + linear(x)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """x [..., H] -> [..., H]; with `residual`, residual + that (`linear_plus`)."""
        if "gate_up_proj" in self:
            gate, up = self.gate_up_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return linear_plus(self.down_proj, fastmath.silu(gate) * up, residual)

    def fuse_projections(self) -> None:
        """After loading: gate and up projections as one matmul (models/fused.py)."""
        fuse_into(self, ["gate_proj", "up_proj"], "gate_up_proj")


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# (name, rows [..., 1, in], their expert ids [...], whether the ids are sorted) -> [..., 1, out]
ExpertProjection = Callable[[str, mx.array, mx.array, bool], mx.array]

# Fewest (token, expert) rows for which they are sorted by expert first; below it each
# token's row is broadcast over its k experts (mlx-lm's SwitchGLU sorts from 64 rows).
# Sorting lets the gathered matmul walk each expert's weights once for all of its rows, but
# costs two argsorts and two row gathers per layer. H200, 35B-A3B 4-bit, one MoE layer alone
# (bench/moe_profile.py): at B=1 (8 rows) 0.38 ms per compiled call unsorted vs 0.50 sorted,
# at B=16 (128 rows) the same either way; inside the engine it is not measured yet, so the
# default keeps sorting always (0). Read through the module global, so a benchmark can set
# it; a compiled trace keeps the value it was traced with.
SORT_MIN_ROWS = 0


def _switch_glu(x: mx.array, indices: mx.array, project: ExpertProjection) -> mx.array:
    """SwiGLU of each token through each of its k experts. x [N, H], indices [N, k] -> [N, k, H].

    From SORT_MIN_ROWS rows the N*k (token, expert) rows are sorted by expert so that the
    gathered matmul walks each expert's weights once, in order (sorted_indices=True), then
    put back in token order; below it each token's row is broadcast over its k experts.
    """
    n, k = indices.shape
    indices = mx.stop_gradient(indices)
    if n * k < SORT_MIN_ROWS:
        rows = x[:, None, None, :]  # [N, 1, 1, H], broadcast against indices [N, k]
        act = fastmath.silu(project("gate_proj", rows, indices, False))
        act = act * project("up_proj", rows, indices, False)  # [N, k, 1, I]
        return project("down_proj", act, indices, False).reshape(n, k, -1)
    flat = indices.reshape(-1)
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    rows = x[order // k][:, None, :]  # [N*k, 1, H]; sorted row r is token order[r] // k
    idx = flat[order]
    act = fastmath.silu(project("gate_proj", rows, idx, True)) * project("up_proj", rows, idx, True)
    out = project("down_proj", act, idx, True)  # [N*k, 1, H]
    return out[inverse].reshape(n, k, -1)


class SwitchExperts(nn.Module):
    """E stacked SwiGLU experts; each token runs its top-k experts via gather_mm."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = mx.zeros((num_experts, intermediate, hidden))
        self.up_proj = mx.zeros((num_experts, intermediate, hidden))
        self.down_proj = mx.zeros((num_experts, hidden, intermediate))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [N, H], indices [N, k] -> [N, k, H]."""
        return _switch_glu(x, indices, self._project)

    def _project(self, name: str, rows: mx.array, idx: mx.array, is_sorted: bool) -> mx.array:
        weight = self[name].swapaxes(-1, -2)  # [E, in, out]
        hint = is_sorted and sorted_gather_mm_ok()
        return mx.gather_mm(rows, weight, rhs_indices=idx, sorted_indices=hint)


def sorted_gather_mm_ok() -> bool:
    """Whether mx.gather_mm may be told its rows are sorted by expert. Not on CUDA:
    mlx-cuda 0.32.4 then returns wrong products once the rows span several experts
    (H200, 30 tokens x 4 of 16 experts: relative error 1.3 against per-row matmuls in
    float32 and bf16, exact without the hint; gather_qmm's sorted path was right). The
    rows stay sorted, so each expert's rows are still contiguous."""
    return current_platform().device != "cuda"


class QuantizedExpertLinear(nn.Module):
    """One projection of E stacked experts, kept MLX-quantized; rows run through gather_qmm.

    weight [E, out, in * bits / 32] uint32, scales (and, for "affine", biases)
    [E, out, in / group_size]: mlx-lm's QuantizedSwitchLinear layout, one spec per projection
    (mixed-bit recipes give down_proj more bits than gate/up).
    """

    def __init__(self, num_experts: int, out_dims: int, in_dims: int, spec: dict) -> None:
        super().__init__()
        self.group_size, self.bits = int(spec["group_size"]), int(spec["bits"])
        self.mode = spec.get("mode", "affine")
        # Placeholders with the checkpoint's shapes; load_weights replaces them.
        self.weight = mx.zeros((num_experts, out_dims, in_dims * self.bits // 32), mx.uint32)
        self.scales = mx.zeros((num_experts, out_dims, in_dims // self.group_size))
        if self.mode == "affine":  # the mx/nv fp formats have no biases
            self.biases = mx.zeros(self.scales.shape)
        self.freeze()

    def __call__(self, rows: mx.array, idx: mx.array, is_sorted: bool = True) -> mx.array:
        """rows [..., 1, in], idx [...] (the batch shapes broadcast) -> [..., 1, out];
        is_sorted: idx is sorted (rows grouped by expert)."""
        return mx.gather_qmm(
            rows,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=idx,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=is_sorted,
        )


class QuantizedSwitchExperts(nn.Module):
    """SwitchExperts whose stacked weights stay packed (gather_qmm, no dequantized copy)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, specs: dict) -> None:
        """specs: projection name -> {"group_size", "bits", "mode"} (Checkpoint.quantization)."""
        super().__init__()
        e = num_experts
        self.gate_proj = QuantizedExpertLinear(e, intermediate, hidden, specs["gate_proj"])
        self.up_proj = QuantizedExpertLinear(e, intermediate, hidden, specs["up_proj"])
        self.down_proj = QuantizedExpertLinear(e, hidden, intermediate, specs["down_proj"])

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [N, H], indices [N, k] -> [N, k, H]."""
        return _switch_glu(x, indices, self._project)

    def _project(self, name: str, rows: mx.array, idx: mx.array, is_sorted: bool) -> mx.array:
        return self[name](rows, idx, is_sorted)


class SparseMoE(nn.Module):
    """Softmax router, top-k, renormalise, plus a sigmoid-gated shared expert."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared: int, norm: bool
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = SwitchExperts(num_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def quantize_experts(self, specs: dict) -> None:
        """Before loading a quantized checkpoint: hold the experts packed (specs: projection
        name -> its quantization spec), as QuantizedSwitchExperts."""
        num_experts, intermediate, hidden = self.experts.gate_proj.shape  # [E, I, H]
        self.experts = QuantizedSwitchExperts(num_experts, hidden, intermediate, specs)

    def __call__(self, x: mx.array) -> mx.array:
        """x [N, H] (tokens already flattened) -> [N, H]."""
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if isinstance(self.experts, QuantizedSwitchExperts) and moe_experts.supported(
            self.experts, indices.size
        ):  # decode sizes on CUDA, when enabled: two kernels reading the packed weights
            routed = moe_experts.moe_experts(x, indices, weights, self.experts)
        else:
            routed = (self.experts(x, indices) * weights[..., None].astype(x.dtype)).sum(axis=1)
        shared = fastmath.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
