"""Gated DeltaNet (linear attention) layer of Qwen3.5.

Everything between the input projections and out_proj (conv, L2 norms, gates, the
recurrence, the gated norm) is one pure function, `deltanet_core`. For prefill (L > 1) on
Metal/CUDA it runs through mx.compile, traced once per input shape and shared by every
layer: eagerly it is ~250 small ops per layer (the chunked recurrence is most of them), and
on the GPU an eager op costs ~8 us of graph building and launch whatever its size, so a
prefill step was op-bound (see bench/README.md). Decode (L == 1) already runs inside the
engine's compiled step (engine/decode.py).

With compiling on, `prefill_many` also runs the prefill groups of one step (cohorts of
different chunk lengths) as ONE call per layer, left-padded to a shared length, and pads
rows and length up to buckets (`prefill_buckets`), so a layer's cost no longer grows with
the number of cohorts and only a few shapes are ever traced. Padding is masked: a padded
token is an exact no-op on the state (kernels/gated_delta.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from deltaserve.kernels import deltanet_decode as dn_decode
from deltaserve.kernels import fastmath
from deltaserve.kernels.deltanet_chunk import deltanet_chunk
from deltaserve.kernels.deltanet_chunk import uses_kernels as chunk_kernels
from deltaserve.kernels.gated_delta import gated_delta
from deltaserve.kernels.platform import current_platform
from deltaserve.models.config import TextConfig
from deltaserve.models.fused import fuse_into
from deltaserve.models.layers import GatedRMSNorm, gated_rms_norm, linear_plus
from deltaserve.models.state import RecurrentState


def _l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def shifted_conv_input(
    conv_state: mx.array,
    x: mx.array,
    mask: mx.array | None,
    left_pad: tuple[int, ...] | mx.array | None,
    fresh: bool = False,
) -> mx.array:
    """[B, K-1, C] state + [B, L, C] inputs -> [B, K-1+L, C] with each row's state adjacent
    to its first real token, so left padding never sits between a row's history and its
    new tokens (padding moves to the far left, as zeros). left_pad: per-row pad counts
    (tuple or [B] int32 array; only read when mask is given). fresh: every row's state
    is zeros (no history yet), so state and padding are both zeros and nothing moves:
    a prompt's first chunk skips the gather (per DeltaNet layer four kernels and a
    copy of its padded inputs)."""
    if mask is None:
        return mx.concatenate([conv_state, x], axis=1)
    x = mx.where(mask[..., None], x, mx.zeros_like(x))
    full = mx.concatenate([conv_state, x], axis=1)
    if fresh:
        return full
    tail = conv_state.shape[1]
    pad = mx.array(left_pad, dtype=mx.int32)[:, None]  # [B, 1]
    j = mx.arange(full.shape[1], dtype=mx.int32)[None]  # [1, K-1+L]
    # positions j < pad + tail read the state (shifted right by pad); later ones are in place
    src = mx.where(j < pad + tail, mx.maximum(j - pad, 0), j)
    gathered = mx.take_along_axis(full, src[..., None], axis=1)
    return mx.where((j >= pad)[..., None], gathered, mx.zeros_like(gathered))


@dataclass(frozen=True)
class CoreDims:
    """The static sizes and choices `deltanet_core` needs (hashable: one compiled trace
    set per dims). scan: the recurrence of L > 1 inputs as the CUDA scan kernel."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    norm_eps: float
    scan: bool = False


def deltanet_core(
    dims: CoreDims,
    qkv: mx.array,
    z: mx.array,
    beta_in: mx.array,
    a_in: mx.array,
    conv_state: mx.array,
    ssm: mx.array,
    conv_w: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    mask: mx.array | None = None,
    left_pad: mx.array | None = None,
    every_state: bool = False,
    fresh: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """Projections in, out_proj input out; a pure function of arrays (so it compiles).

    qkv [B, L, conv_dim], z [B, L, value_dim], beta_in / a_in [B, L, Hv] (projection
    outputs); conv_state [B, K-1, conv_dim]; ssm [B, Hv, Dv, Dk] float32; conv_w [C, K];
    mask [B, L] bool and left_pad [B] int32 (both or neither). Returns y [B, L, value_dim]
    (in qkv's dtype), the new conv tail and the new recurrent state. every_state
    (unmasked input): the conv tail and state after each column instead, [B, L, K-1, C]
    and [B, L, Hv, Dv, Dk] (RecurrentState.slots). fresh: conv_state is zeros (rows with
    no history; `shifted_conv_input`).
    """
    b, length, _ = qkv.shape
    kernel = conv_w.shape[-1]
    key_dim = dims.num_k_heads * dims.head_k_dim
    full = shifted_conv_input(conv_state.astype(qkv.dtype), qkv, mask, left_pad, fresh)
    w = conv_w.astype(qkv.dtype)
    conv = full[:, 0:length] * w[:, 0]
    for j in range(1, kernel):
        conv = conv + full[:, j : j + length] * w[:, j]
    conv = fastmath.silu(conv)
    q = conv[..., :key_dim].reshape(b, length, dims.num_k_heads, dims.head_k_dim)
    k = conv[..., key_dim : 2 * key_dim].reshape(q.shape)
    v = conv[..., 2 * key_dim :].reshape(b, length, dims.num_v_heads, dims.head_v_dim)
    q = _l2_normalize(q.astype(mx.float32)) * (dims.head_k_dim**-0.5)
    k = _l2_normalize(k.astype(mx.float32))
    beta = fastmath.sigmoid(beta_in.astype(mx.float32))
    a = a_in.astype(mx.float32) + dt_bias
    g = -mx.exp(a_log) * mx.logaddexp(a, mx.zeros_like(a))  # log-decay <= 0
    if every_state:
        assert mask is None, "state slots of padded input"
        y, ssm = gated_delta(q, k, v, g, beta, ssm, None, dims.scan, every_state=True)
        tail = mx.stack([full[:, t + 1 : t + kernel] for t in range(length)], axis=1)
    else:
        y, ssm = gated_delta(q, k, v, g, beta, ssm, mask, dims.scan)
        tail = full[:, -(kernel - 1) :]
    z = z.reshape(b, length, dims.num_v_heads, dims.head_v_dim)
    y = gated_rms_norm(y, z, norm_w, dims.norm_eps).reshape(b, length, -1)
    return y, tail, ssm


@cache
def _compiled_core(dims: CoreDims, fresh: bool = False) -> Callable[..., tuple[mx.array, ...]]:
    """One compiled core per dims (and `fresh`: deltanet_core), shared by every layer of
    that size (one trace per input shape and mask presence, replayed by all of them)."""
    return mx.compile(partial(deltanet_core, dims, fresh=fresh))


def _bucket(n: int, floor: int, step: int) -> int:
    """n rounded up to a power of two >= floor, or above `step` to a multiple of it."""
    if n > step:
        return -(-n // step) * step
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def prefill_buckets(rows: int, length: int) -> tuple[int, int]:
    """The traced shape of a prefill call: rows up to a power of two (multiples of 16 above
    16), length up to a power of two >= 16 (multiples of 64, the recurrence's chunk, above
    64: padding within a chunk is free there)."""
    return _bucket(rows, 1, 16), _bucket(length, 16, 64)


def fused_decode_default() -> bool:
    """The one-kernel decode token (kernels/deltanet_decode.py) where the platform profile
    has it on (Metal/CUDA by default: a decode step costs its kernel launches there); the
    plain ops of `deltanet_core` otherwise."""
    return current_platform().fused_deltanet_decode


def scan_prefill_default() -> bool:
    """The DeltaNet recurrence of prompt chunks as one scan kernel where the profile has it
    on (CUDA by default: the chunked form's small kernels cost a prompt chunk a fixed
    ~1.2 ms per layer there; kernels/gated_delta_scan.py)."""
    return current_platform().deltanet_scan


def compile_prefill_default() -> bool:
    """Compiled prefill core where the profile has it on (Metal/CUDA by default: op-bound
    there); plain ops on the CPU, where an op's cost is its arithmetic and compiling only
    adds traces."""
    return current_platform().compile_prefill


class GatedDeltaNet(nn.Module):
    """in_proj -> causal depthwise conv + SiLU -> L2-normed q/k -> gated delta rule ->
    gated RMSNorm -> out_proj. State: conv tail [B, K-1, C] and recurrent [B, Hv, Dv, Dk].

    compile_prefill: run `deltanet_core` compiled for L > 1; None = compile_prefill_default().
    fused_decode: run an unmasked L = 1 input as one kernel (kernels/deltanet_decode.py);
    None = fused_decode_default().
    scan_prefill: the recurrence of L > 1 inputs as one CUDA scan kernel
    (kernels/gated_delta_scan.py); None = scan_prefill_default().
    fused_chunk: run an L > 1 input (no split, no state slots) as the kernels of
    kernels/deltanet_chunk.py; None = where they run (CUDA, with the scan on).
    """

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = cfg.conv_dim
        self.compile_prefill: bool | None = None
        self.fused_decode: bool | None = None
        self.scan_prefill: bool | None = None
        self.fused_chunk: bool | None = None
        self._dims = CoreDims(
            self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim, cfg.rms_norm_eps
        )
        self._decode_dims = dn_decode.DecodeDims(
            self.num_k_heads,
            self.head_k_dim,
            self.num_v_heads,
            self.head_v_dim,
            self.kernel_size,
            cfg.rms_norm_eps,
        )
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((self.conv_dim, self.kernel_size))  # [C, K]
        self.A_log = mx.zeros((self.num_v_heads,), dtype=mx.float32)
        self.dt_bias = mx.ones((self.num_v_heads,), dtype=mx.float32)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def project(self, x: mx.array) -> list[mx.array]:
        """qkv [B, L, conv_dim], z [B, L, value_dim], b and a [B, L, Hv]."""
        if "in_proj" in self:
            return self.in_proj(x)
        return [self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)]

    def project_whole(self, x: mx.array) -> mx.array:
        """`project`'s outputs as one [B, L, P] array (qkv | z | b | a), the fused kernels'
        input: the fused projection's output unsplit (contiguous, no copy)."""
        if "in_proj" in self:
            return self.in_proj.proj(x)
        return mx.concatenate(self.project(x), axis=-1)

    def fuse_projections(self) -> None:
        """After loading: the four input projections as one matmul (models/fused.py)."""
        fuse_into(self, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "in_proj")

    def use_compiled(self, length: int) -> bool:
        """Whether an L = length input takes the compiled (and merged) prefill path."""
        enabled = self.compile_prefill
        if enabled is None:
            enabled = compile_prefill_default()
        return enabled and length > 1

    def core_dims(self) -> CoreDims:
        """The dims `deltanet_core` runs with (sizes, and whether prompts use the scan)."""
        enabled = self.scan_prefill
        if enabled is None:
            enabled = scan_prefill_default()
        return self._dims if enabled == self._dims.scan else replace(self._dims, scan=enabled)

    def use_fused_decode(self) -> bool:
        """Whether an unmasked L = 1 input runs as the one-kernel decode token."""
        enabled = self.fused_decode
        if enabled is None:
            enabled = fused_decode_default() and dn_decode.supported(self._decode_dims)
        return enabled

    def _decode_kernel(self, whole: mx.array, state: RecurrentState) -> mx.array:
        """whole [B, 1, P] -> [B, 1, value_dim] through kernels/deltanet_decode.py."""
        y, state.conv, state.ssm = dn_decode.deltanet_decode(
            self._decode_dims, whole.reshape(whole.shape[0], -1), *self._kernel_inputs(whole, state)
        )
        return y[:, None]

    def use_fused_chunk(self, length: int, split: int = 0, slots: bool = False) -> bool:
        """Whether an L = length input runs as kernels/deltanet_chunk.py's kernels (CUDA,
        by the platform profile): a prompt chunk without a split or state slots."""
        if length < 2 or split or slots:
            return False
        if self.fused_chunk is not None:
            return self.fused_chunk
        return chunk_kernels(self._decode_dims) and self.core_dims().scan

    def _chunk_kernels(
        self,
        whole: mx.array,
        state: RecurrentState,
        mask: mx.array | None,
        left_pad: tuple[int, ...] | mx.array | None,
    ) -> mx.array:
        """whole [B, L, P] -> [B, L, value_dim] through kernels/deltanet_chunk.py; mask
        and left_pad (pads as data or a tuple) describe the same padding."""
        pads = None
        if mask is not None:
            pads = left_pad if isinstance(left_pad, mx.array) else mx.array(left_pad, mx.int32)
        inputs = self._kernel_inputs(whole, state)
        y, state.conv, state.ssm = deltanet_chunk(self._decode_dims, whole, *inputs, pads, mask)
        return y

    def use_fused_slots(self, mask: mx.array | None, split: int, slots: bool) -> bool:
        """Whether a group that keeps its state after every column (a speculative verify's
        k + 1 columns: ForwardGroup.state_slots) runs as the decode kernel's many-column
        form (`_slots_kernel`), where the decode kernel is on: one kernel a layer instead of
        the eager core's conv views, norms, gates, scan and stacks, each a node of host
        time on a GPU."""
        return slots and mask is None and not split and self.use_fused_decode()

    def _slots_kernel(self, whole: mx.array, state: RecurrentState) -> mx.array:
        """whole [B, T, P] -> [B, T, value_dim], column after column a decode token
        (kernels/deltanet_decode.py `deltanet_decode_slots`); the conv tail and state after
        each column become state.slots, as `core` keeps them, and the last column's are
        the state. Each column is what a plain decode step computes, operation for
        operation, so a verify's tokens are those of decoding without drafts."""
        inputs = self._kernel_inputs(whole, state)
        y, convs, ssms = dn_decode.deltanet_decode_slots(self._decode_dims, whole, *inputs)
        state.slots = (convs, ssms)
        state.conv, state.ssm = convs[:, -1], ssms[:, -1]
        return y

    def _kernel_inputs(self, whole: mx.array, state: RecurrentState) -> tuple:
        """What every DeltaNet kernel (decode, its many-column form, the chunk) takes after
        the layer's dims and the whole projection: (conv tail, recurrent state, conv
        weight, A_log, dt_bias, norm weight)."""
        conv_state, ssm = self._states(state, whole.shape[0], whole.dtype)
        return (conv_state, ssm, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)

    def _states(self, state: RecurrentState, rows: int, dtype: mx.Dtype) -> tuple:
        """(conv tail, recurrent state) of `state`, zeros for fresh rows."""
        conv = state.conv
        if conv is None:
            conv = mx.zeros((rows, self.kernel_size - 1, self.conv_dim), dtype)
        ssm = state.ssm
        if ssm is None:
            ssm = mx.zeros((rows, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        return conv.astype(dtype), ssm

    def prefill_many(
        self,
        xs: list[mx.array],
        states: list[RecurrentState],
        left_pads: list[tuple[int, ...] | None],
        residuals: list[mx.array] | None = None,
    ) -> list[mx.array]:
        """Several groups' x [B_g, L_g, H] as one compiled call at a bucketed [B, L]: each
        row is left-padded to L (dead rows after the real ones are all padding), its
        state taken from and written back to its group's `states` entry; each group's
        output plus its `residuals` entry when given (`linear_plus`)."""
        rows = sum(x.shape[0] for x in xs)
        length = max(x.shape[1] for x in xs)
        rows_b, length_b = prefill_buckets(rows, length)
        hidden = xs[0].shape[-1]
        padded, pads = [], []
        for x, pad in zip(xs, left_pads, strict=True):
            extra = length_b - x.shape[1]
            padded.append(mx.pad(x, [(0, 0), (extra, 0), (0, 0)]) if extra else x)
            pads += [extra + p for p in (pad or (0,) * x.shape[0])]
        if rows_b > rows:  # dead rows: nothing but padding
            padded.append(mx.zeros((rows_b - rows, length_b, hidden), xs[0].dtype))
            pads += [length_b] * (rows_b - rows)
        fused = self.use_fused_chunk(length_b)
        x = mx.concatenate(padded, axis=0)
        projected = [self.project_whole(x)] if fused else self.project(x)
        dtype = projected[0].dtype
        parts = [self._states(s, x.shape[0], dtype) for s, x in zip(states, xs, strict=True)]
        convs, ssms = [p[0] for p in parts], [p[1] for p in parts]
        if rows_b > rows:
            convs.append(mx.zeros((rows_b - rows, *convs[0].shape[1:]), dtype))
            ssms.append(mx.zeros((rows_b - rows, *ssms[0].shape[1:]), mx.float32))
        left_pad = mx.array(pads, dtype=mx.int32)
        mask = mx.arange(length_b, dtype=mx.int32)[None] >= left_pad[:, None]
        weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        conv_state, ssm = mx.concatenate(convs), mx.concatenate(ssms)
        if fused:
            y, conv, ssm = deltanet_chunk(
                self._decode_dims, projected[0], conv_state, ssm, *weights, left_pad, mask
            )
        else:
            fresh = all(s.conv is None for s in states)
            y, conv, ssm = _compiled_core(self.core_dims(), fresh)(
                *projected, conv_state, ssm, *weights, mask, left_pad
            )
        out, start = [], 0
        for x, state in zip(xs, states, strict=True):
            b, length_g = x.shape[0], x.shape[1]
            state.conv, state.ssm = conv[start : start + b], ssm[start : start + b]
            out.append(y[start : start + b, length_b - length_g :])
            start += b
        # out_proj per group on its real columns only (cheaper than on the padded block)
        residuals = residuals or [None] * len(out)
        return [linear_plus(self.out_proj, o, r) for o, r in zip(out, residuals, strict=True)]

    def __call__(
        self,
        x: mx.array,
        state: RecurrentState,
        mask: mx.array | None,
        left_pad: tuple[int, ...] | mx.array | None,
        split: int = 0,
        slots: bool = False,
        residual: mx.array | None = None,
    ) -> mx.array:
        """x [B, L, H] -> [B, L, H], plus `residual` when given (`linear_plus`); mask
        [B, L] (True = real) keeps pads out of the state. split: ForwardGroup.snapshot_at;
        slots: ForwardGroup.state_slots (see `core`)."""
        length = x.shape[1]
        # pads as data: already inside a compiled forward (engine/compiled_prefill.py)
        if isinstance(left_pad, mx.array) or self.packable(length, mask, split, slots):
            y = self.mix_whole(self.project_whole(x), state, mask, left_pad, split, slots)
            return linear_plus(self.out_proj, y, residual)
        residuals = None if residual is None else [residual]
        return self.prefill_many([x], [state], [left_pad], residuals)[0]

    def packable(
        self, length: int, mask: mx.array | None, split: int = 0, slots: bool = False
    ) -> bool:
        """Whether an input runs from its own projection alone (`mix_whole`), so that
        projection may be one slice of a matmul over several groups' tokens
        (models/qwen35.py mix_packed): every path but the compiled prefill core, which
        pads groups into one bucketed call of its own (`prefill_many`)."""
        if self.use_fused_chunk(length, split, slots) or self.use_fused_slots(mask, split, slots):
            return True
        return self.eager(length, mask, split, slots) or not self.use_compiled(length)

    def mix_whole(
        self,
        whole: mx.array,
        state: RecurrentState,
        mask: mx.array | None,
        left_pad: tuple[int, ...] | mx.array | None,
        split: int = 0,
        slots: bool = False,
    ) -> mx.array:
        """`project_whole`'s output [B, L, P] -> out_proj's input [B, L, value_dim], by the
        kernels where they apply (a prompt chunk, a verify's columns, a decode token),
        else the eager `core`. Not for the compiled prefill core (`packable`)."""
        length = whole.shape[1]
        if self.use_fused_chunk(length, split, slots):
            return self._chunk_kernels(whole, state, mask, left_pad)
        if self.use_fused_slots(mask, split, slots):
            return self._slots_kernel(whole, state)
        if isinstance(left_pad, mx.array) or self.eager(length, mask, split, slots):
            sizes = [self.conv_dim, self.value_dim, self.num_v_heads]
            bounds = [sum(sizes[: i + 1]) for i in range(len(sizes))]
            parts = mx.split(whole, bounds, axis=-1)
            return self.core(parts, state, mask, left_pad, split, slots)
        assert not self.use_compiled(length), "the compiled prefill core is not packable"
        return self._decode_kernel(whole, state)

    def eager(
        self, length: int, mask: mx.array | None, split: int = 0, slots: bool = False
    ) -> bool:
        """Whether an input takes `core`, the eager path (a split or state slots always
        do), rather than the compiled prefill or the fused decode kernel; its projections
        may then run packed with other groups' (models/qwen35.py)."""
        fused = length == 1 and mask is None and self.use_fused_decode()
        if self.use_fused_slots(mask, split, slots):
            return False
        if split or slots:
            return True
        chunk = self.use_fused_chunk(length, split, slots)
        return not fused and not chunk and not self.use_compiled(length)

    def core(
        self,
        projected: list[mx.array],
        state: RecurrentState,
        mask: mx.array | None,
        left_pad: tuple[int, ...] | mx.array | None,
        split: int = 0,
        slots: bool = False,
    ) -> mx.array:
        """`project`'s outputs [B, L, *] -> out_proj's input [B, L, value_dim], eagerly.
        split > 0 (unpadded input): the core runs on columns [0, split) and then on the
        rest, and the state between the two is kept as state.checkpoint. slots
        (unpadded input): the state after every column is kept as state.slots, and the
        state itself becomes the last slot."""
        qkv = projected[0]
        fresh = state.conv is None
        conv_state, ssm = self._states(state, qkv.shape[0], qkv.dtype)
        masked = () if mask is None else (mask, mx.array(left_pad, dtype=mx.int32))
        weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        if slots:
            assert mask is None and not split, "state slots of unpadded input only"
            y, conv, ssm = deltanet_core(
                self.core_dims(), *projected, conv_state, ssm, *weights, every_state=True
            )
            state.slots = (conv, ssm)
            state.conv, state.ssm = conv[:, -1], ssm[:, -1]
            return y
        if not split:
            y, state.conv, state.ssm = deltanet_core(
                self.core_dims(), *projected, conv_state, ssm, *weights, *masked, fresh=fresh
            )
            return y
        assert mask is None and 0 < split < qkv.shape[1], "a split inside unpadded input"
        head = [p[:, :split] for p in projected]
        dims = self.core_dims()
        y_head, conv_state, ssm = deltanet_core(dims, *head, conv_state, ssm, *weights)
        state.checkpoint = (conv_state, ssm)
        tail = [p[:, split:] for p in projected]
        y_tail, state.conv, state.ssm = deltanet_core(dims, *tail, conv_state, ssm, *weights)
        return mx.concatenate([y_head, y_tail], axis=1)

    @property
    def output(self) -> nn.Module:
        """The output projection (out_proj), named alike in both mixers."""
        return self.out_proj
