"""Row-state memory accounting: what one row costs and how much is reserved.

Plain Python (no arrays): admission reserves a row's worst case (its DeltaNet state plus
KV for prompt + max_tokens) and finishing releases it, so running rows never run out.
The decode batch is left-padded to its longest row (engine/cache/kv.py), so it really
holds rows x the longest row's columns: `padding` charges that difference for the rows
running now (the scheduler sets it as rows come and go), so one long row makes short
rows cost what they really cost. The prefix cache reserves here too. A row that may
speculate also holds the MTP head's KV (one full-precision full-attention layer, a
column per token: engine/speculative.py), reserved with it, and where verify steps are
chained, the left padding their rejected drafts leave (`draft_pad_columns`). What a row
holds only while its prompt is prefilled (the vision tower's activations, a compiled
later chunk's KV capacity bucket) is reserved until its prefill ends
(Admission.prefill_bytes).
With the compiled decode step, the decode batch is held at a bucket size with dead
rows (engine/shapes.py decode_bucket): `padding` counts them too (the longest row's
KV columns and a DeltaNet state each).
Not counted, and covered only by the default budget being half of the memory left: KV
capacity headroom (up to 256 free columns per store, an eighth of its columns past
2,048: kv.round_capacity), the MTP head's KV of dead rows and its left padding (a
verify batch of several rows runs k + 1 head columns a row a step, whatever a row keeps:
engine/speculative.py chain_width),
the speculating rows' verify batch's dead rows, and, for one step, the merged copy of
prefilling rows whose chunks run as one cohort (each row at the longest one's columns;
split back after the step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.models.config import TextConfig


@dataclass(frozen=True)
class StateCosts:
    """Bytes of row state for one model and KV kind."""

    kv_bytes_per_token: int  # all full-attention layers, keys + values
    ssm_bytes_per_row: int  # all DeltaNet layers: conv tail + float32 recurrent state
    kv_prefix_bytes_per_row: int = 0  # full-precision prefix of quantized KV (start > 0)
    draft_kv_bytes_per_token: int = 0  # the MTP head's KV (one layer, full precision)

    @classmethod
    def for_model(
        cls,
        cfg: TextConfig,
        kv_bytes_per_element_pair: float,
        dtype_size: int,
        kv_prefix_tokens: int = 0,
    ) -> StateCosts:
        """kv_bytes_per_element_pair: bytes one K element plus one V element take;
        kv_prefix_tokens: tokens per row also stored at full precision (dtype_size)."""
        num_full = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
        num_linear = cfg.num_hidden_layers - num_full
        kv = num_full * cfg.num_key_value_heads * cfg.head_dim * kv_bytes_per_element_pair
        recurrent = (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim * 4
        )
        conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * dtype_size
        layer = cfg.num_key_value_heads * cfg.head_dim * 2 * dtype_size  # K + V, one token
        return cls(
            int(round(kv)),
            num_linear * (recurrent + conv),
            kv_prefix_tokens * num_full * layer,
            layer,
        )


MIN_BUDGET_BYTES = 256 * 2**20


def default_budget_bytes(
    device_info: dict, host_bytes: int, weight_bytes: int, on_cpu: bool
) -> int:
    """Row-state budget when none is configured: half of the memory left for it.

    A cap on admission, not an allocation: row state is allocated as rows join and freed
    as they leave, so a small model on a large machine holds only what its running rows
    use; the start-up summary states it as "up to", next to what is reserved and resident
    now. Sizing the cap to the model instead (say, max_num_seqs full-context rows) would
    refuse long requests that the machine can hold.

    CPU: host RAM minus the weights. CUDA (`mx.device_info()` has total_memory /
    free_memory): free memory as measured after loading, so the weights are already out
    of it. Metal (memory_size, max_recommended_working_set_size): the working set the
    OS recommends for the GPU (else all unified memory) minus the weights. Unknown keys
    fall back to host RAM minus the weights, never to the floor alone.
    """
    if on_cpu:
        left = host_bytes - weight_bytes
    elif "free_memory" in device_info or "total_memory" in device_info:
        total = int(device_info.get("total_memory", 0))
        left = int(device_info.get("free_memory", total - weight_bytes))
    elif "memory_size" in device_info:
        total = int(device_info.get("max_recommended_working_set_size", 0))
        left = (total or int(device_info["memory_size"])) - weight_bytes
    else:
        left = host_bytes - weight_bytes
    return max(MIN_BUDGET_BYTES, left // 2)


class MemoryBudget:
    """Reserve/release bytes against a fixed total."""

    def __init__(
        self,
        total: int,
        costs: StateCosts,
        held_rows: Callable[[int], int] | None = None,
        draft_pad_columns: int = 0,
    ) -> None:
        """held_rows: how many rows a decode batch of n live rows is held at (the compiled
        decode step's buckets, engine/shapes.py decode_bucket; None: n).
        draft_pad_columns: KV columns of left padding a speculating row may hold beyond
        the longest row's (chained verify steps: each row's rejected drafts stay as its
        padding until every row of the store has COMPACT_PAD of them, engine/cache/kv.py
        settle), in the trunk's store and the head's."""
        self.total = total
        self.costs = costs
        self.held_rows = held_rows
        self.draft_pad_columns = draft_pad_columns
        self.reserved = 0
        self.padding = 0  # KV of left padding the running rows may need (padding_bytes)

    def padding_bytes(self, max_tokens: list[int]) -> int:
        """Bytes the rows of these worst-case lengths can need in one batch beyond what
        each reserves itself: every row's KV padded to the longest, and the dead rows
        that hold the batch at its bucket size (held_rows), each with the longest row's
        KV columns and its own DeltaNet state."""
        if not max_tokens:
            return 0
        rows = len(max_tokens)
        held = self.held_rows(rows) if self.held_rows is not None else rows  # >= rows
        columns = held * max(max_tokens) - sum(max_tokens)
        dead = (held - rows) * (self.costs.ssm_bytes_per_row + self.costs.kv_prefix_bytes_per_row)
        return columns * self.costs.kv_bytes_per_token + dead

    def row_bytes(self, num_tokens: int, drafts: bool = False) -> int:
        """A row's worst case at `num_tokens` tokens; `drafts`: it may speculate, so it
        also holds the MTP head's KV of those tokens, and draft_pad_columns more of both."""
        fixed = self.costs.ssm_bytes_per_row + self.costs.kv_prefix_bytes_per_row
        per_token = self.costs.kv_bytes_per_token
        if drafts:
            per_token += self.costs.draft_kv_bytes_per_token
            num_tokens += self.draft_pad_columns
        return fixed + num_tokens * per_token

    def rows_of(self, num_tokens: int) -> int:
        """How many rows of `num_tokens` tokens each the whole budget holds."""
        return self.total // self.row_bytes(num_tokens)

    def can_reserve(self, nbytes: int) -> bool:
        return self.reserved + self.padding + nbytes <= self.total

    def reserve(self, nbytes: int) -> None:
        assert self.can_reserve(nbytes), "reservation over budget"
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0, "released more than reserved"

    def clear(self) -> None:
        """Nothing is reserved any more (every row and cached prefix was dropped)."""
        self.reserved = self.padding = 0
