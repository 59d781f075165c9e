"""Batched Gated-DeltaNet row state: conv tail and float32 recurrent state per row.

Unlike KV, recurrent state cannot be trimmed, shared by prefix or padded in time: each
row holds exactly one [K-1, C] conv tail and one [Hv, Dv, Dk] matrix. Padding tokens never
reach it (the model masks them), so the row ops are plain gathers along the batch axis.
"""

from __future__ import annotations

import mlx.core as mx

from deltaserve.engine.cache.kv import fresh_copy, take_rows


class SSMState:
    """RecurrentState for one linear-attention layer; None means all-zero (fresh rows)."""

    def __init__(self, num_rows: int = 0) -> None:
        self.conv: mx.array | None = None  # [B, K-1, conv_dim]
        self.ssm: mx.array | None = None  # [B, Hv, Dv, Dk] float32
        # (conv, ssm) inside the last forward (ForwardGroup.snapshot_at): read by the
        # prefix store's save of that step, then cleared
        self.checkpoint: tuple[mx.array, mx.array] | None = None
        # (conv [B, L, K-1, C], ssm [B, L, Hv, Dv, Dk]) after each column of the last
        # verify forward (ForwardGroup.state_slots): read by `select_slots`, then cleared
        self.slots: tuple[mx.array, mx.array] | None = None
        self._num_rows = num_rows

    @property
    def num_rows(self) -> int:
        return self._num_rows if self.conv is None else int(self.conv.shape[0])

    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep` in that order. Survivors that are one run of consecutive rows
        are views of the old arrays, not copies: the decode batch is filtered only in a
        step that decodes it (RowStates.sync), whose forward replaces both arrays, so the
        leavers' memory is held one step longer instead of the survivors being copied
        (CPU, small shape: 6 layers' copies were ~4 ms of that step)."""
        if self.conv is None or not keep:
            self.conv = self.ssm = None
            self._num_rows = len(keep)
            return
        self.conv = take_rows(self.conv, keep)
        self.ssm = take_rows(self.ssm, keep)

    def select_slots(self, slot: list[int] | mx.array) -> None:
        """After a verify forward: row b takes its state after column slot[b] (it kept
        slot[b] + 1 of the columns; the rest were rejected drafts), slot a list or a
        lazy [B] int32 array (a chained verify's, not read back yet). One gather per
        array; the slots are dropped."""
        assert self.slots is not None, "select_slots without a verify forward"
        conv, ssm = self.slots
        if isinstance(slot, list):
            assert len(slot) == conv.shape[0] and all(0 <= s < conv.shape[1] for s in slot)
            slot = mx.array(slot, dtype=mx.int32)
        rows, picked = mx.arange(conv.shape[0]), slot
        self.conv, self.ssm = conv[rows, picked], ssm[rows, picked]
        self.slots = None

    def extract(self, row: int) -> SSMState:
        """An independent B=1 copy of `row`."""
        out = SSMState(1)
        if self.conv is not None:
            out.conv = fresh_copy(self.conv[row : row + 1])
            out.ssm = fresh_copy(self.ssm[row : row + 1])
        return out

    def merge(self, other: SSMState) -> None:
        """Append `other`'s rows after ours."""
        mine, theirs = self.num_rows, other.num_rows
        if self.conv is None and other.conv is None:
            self._num_rows = mine + theirs
            return
        template = self if self.conv is not None else other
        conv = [
            self._filled(self.conv, mine, template.conv),
            self._filled(other.conv, theirs, template.conv),
        ]
        ssm = [
            self._filled(self.ssm, mine, template.ssm),
            self._filled(other.ssm, theirs, template.ssm),
        ]
        self.conv = mx.concatenate(conv, axis=0)
        self.ssm = mx.concatenate(ssm, axis=0)

    def pad_rows(self, count: int) -> None:
        """Append `count` dead rows of zero state (see KVStore.pad_rows)."""
        if self.conv is None:
            self._num_rows += count
        elif count:
            self.conv, self.ssm = (
                mx.concatenate([a, mx.zeros((count, *a.shape[1:]), a.dtype)])
                for a in (self.conv, self.ssm)
            )

    @staticmethod
    def _filled(x: mx.array | None, rows: int, template: mx.array) -> mx.array:
        return x if x is not None else mx.zeros((rows, *template.shape[1:]), template.dtype)

    def state_arrays(self) -> list[mx.array]:
        """Every stored array (the runner evaluates these after each step)."""
        return [a for a in (self.conv, self.ssm) if a is not None]

    def nbytes(self) -> int:
        if self.conv is None:
            return 0
        return self.conv.nbytes + self.ssm.nbytes
