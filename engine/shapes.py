"""The bucketed shapes the compiled calls run at, as plain integers.

A compiled call (engine/decode.py's decode step and later chunk, engine/compiled_prefill.py's
fresh prompts) is traced once per input shape, so its batch sizes, lengths and KV
capacities are rounded up to a few buckets. The scheduler plans for them (a chunk that
does not finish its prompt fills its bucket; the memory budget counts a prefilling row's
capacity bucket and the dead rows of a held decode batch), so they live here, without
mlx, for both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

# Lengths up to a power of two up to 128, then a multiple of 128 (the DeltaNet scan walks
# every padded column, so padding is not free)
LENGTH_STEP = 128
# A later chunk's KV capacity: a power of two up to this many columns, then a multiple of it
CAPACITY_STEP = 8192


def chunk_bucket(length: int) -> int:
    """The traced length of a prompt chunk of `length` tokens: a power of two >= 16 up to
    128, then a multiple of 128."""
    if length <= LENGTH_STEP:
        return max(16, 1 << max(length - 1, 0).bit_length())
    return -(-length // LENGTH_STEP) * LENGTH_STEP


def chunk_capacity(columns: int) -> int:
    """The KV capacity a later chunk runs its row at, for `columns` in use after it: a
    power of two >= 256 up to 8,192, then a multiple of 8,192. A trace is keyed by its
    capacity, so the store's own (a multiple of 256) would make every few hundred tokens
    of history a new shape; this keeps them few (9 up to 32k columns) at the price of up
    to 2x one prefilling row's KV (at most 8,192 columns beyond 8,192), which
    `prefill_columns` bounds for the memory budget."""
    if columns > CAPACITY_STEP:
        return -(-columns // CAPACITY_STEP) * CAPACITY_STEP
    return max(256, 1 << (columns - 1).bit_length())


def prefill_columns(num_prompt: int) -> int:
    """The most KV columns a row's store can hold while a prompt of `num_prompt` tokens
    runs through compiled later chunks: the capacity bucket of the prompt and its last
    chunk's padding (a chunk that does not finish its prompt fills its bucket, so only
    the last one pads, by less than LENGTH_STEP columns)."""
    return chunk_capacity(num_prompt + LENGTH_STEP - 1)


def decode_bucket(num_rows: int, max_rows: int) -> int:
    """Rows the decode batch is held at: 1, 2, 4, 8, then steps of 1.5x / 2x (12, 16, 24,
    32, 48, 64, 96, ...), never above max(num_rows, max_rows). Dead rows cost their
    compute and state memory (at most a third of the batch past 8 rows); a new batch
    size costs a new trace of the compiled step (seconds of kernel JIT on first use)."""
    size = 1
    while size < num_rows:
        if size < 8:
            size *= 2
        elif size & (size - 1) == 0:  # a power of two: 8 -> 12, 16 -> 24, ...
            size = size * 3 // 2
        else:  # 12 -> 16, 24 -> 32, ...
            size = size * 4 // 3
    return max(num_rows, min(size, max_rows))


# A fresh prompts' compiled call (engine/compiled_prefill.py): rows up to a power of two
# (lengths: chunk_bucket)
MAX_ROWS = 16


def prompt_bucket(rows: int, length: int) -> tuple[int, int]:
    """The traced [rows, length] shape a group of `rows` first chunks (the longest
    `length` tokens) runs at."""
    return 1 << max(rows - 1, 0).bit_length(), chunk_bucket(length)


def cohort_splits(lengths: Sequence[int], max_area: int) -> list[list[int]]:
    """Indices of a cohort's fresh prompts (of these lengths) in groups of at most
    MAX_ROWS whose bucket holds at most `max_area` padded tokens (a lone prompt always
    forms a group), each in the given order. Longest first, so rows of like lengths share
    a bucket: less padding for the DeltaNet scan, and only the buckets within the area
    run, which are those warm-up traces (engine/warmup.py; H200, 0.8B: a bucket first met
    under load cost ~0.4 s of tracing, a stall of every decoding row)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else None
        if group and len(group) < MAX_ROWS:
            rows_b, length_b = prompt_bucket(len(group) + 1, lengths[group[0]])
            if rows_b * length_b <= max_area:
                group.append(i)
                continue
        groups.append([i])
    return [sorted(group) for group in groups]
