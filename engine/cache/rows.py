"""Which row state belongs to which request: the decode batch and per-prompt prefill states.

The runner keeps one BatchState for the decode batch (rows in the scheduler's order) and a
B=1 BatchState per prompt that is still prefilling; a batched prefill chunk merges several
of those into a cohort for one forward and splits them back after it. `sync` applies the
scheduler's row changes: forks copy a prefilled row, freed rows are dropped, rows whose
prefill completed join the decode batch at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.prefix_cache.disk import PrefixDisk
from deltaserve.engine.prefix_cache.index import CacheDrop, CacheLoad, CacheSave
from deltaserve.engine.prefix_cache.store import PrefixStore


class RowStates:
    """Owner of every row's state inside the engine thread."""

    def __init__(
        self,
        new_state: Callable[[], BatchState],
        bucket: Callable[[int], int] | None = None,
        prefix_cache: bool = False,
        prefix_disk: PrefixDisk | None = None,
    ) -> None:
        """bucket: when given, the decode batch is held at bucket(live rows) rows, the
        rest dead (engine/shapes.py decode_bucket): a compiled step then sees few distinct
        shapes.
        prefix_cache: hold the prefix cache's arrays (engine/prefix_cache/store.py), with
        `prefix_disk` as their disk tier (None: memory only)."""
        self._new_state = new_state
        self._bucket = bucket
        self.prefix = PrefixStore(new_state, prefix_disk) if prefix_cache else None
        self.decode = new_state()
        self.decode_ids: list[str] = []
        # Rows that speculate (engine/speculative.py): their verify batch, apart from the
        # decode batch's [B, 1] step (bucketed like it when the steps are compiled)
        self.verify = new_state()
        self.verify_ids: list[str] = []
        self.prefill: dict[str, BatchState] = {}
        # The MTP-head stores of the cohorts built this step (cohort_state -> split_cohort)
        self._cohort_drafts: dict[tuple[str, ...], KVStore | None] = {}

    def prefill_state(self, row_id: str) -> BatchState:
        """The B=1 state a prompt is prefilled into (created on its first chunk)."""
        if row_id not in self.prefill:
            self.prefill[row_id] = self._new_state()
        return self.prefill[row_id]

    def cohort_state(self, row_ids: Sequence[str]) -> BatchState:
        """One batch holding copies of the prefill states of `row_ids`, in that order, for
        a batched prefill chunk; split_cohort hands the rows back afterwards."""
        state = self._new_state()
        for row_id in row_ids:
            state.merge(self.prefill_state(row_id))
        self._cohort_drafts[tuple(row_ids)] = state.aligned_draft()
        return state

    def split_cohort(self, row_ids: Sequence[str], layers: list) -> None:
        """Each row of a cohort's layers (after its chunk ran) becomes that row's own
        prefill state again (independent copies: none pins the cohort's arrays), with
        its MTP-head store when it has one."""
        cohort = BatchState(layers, self._cohort_drafts.pop(tuple(row_ids), None))
        for i, row_id in enumerate(row_ids):
            self.prefill[row_id] = cohort.extract(i)

    # -- prefix cache (engine/prefix_cache/store.py) ------------------------------------
    def restore_prefix(self, row_id: str, chain: tuple[int, ...]) -> None:
        """Start `row_id`'s prefill state from cached prefix nodes."""
        assert self.prefix is not None and row_id not in self.prefill, "restore a new row"
        self.prefill[row_id] = self.prefix.restore(chain)

    def load_prefix(self, loads: tuple[CacheLoad, ...]) -> None:
        """Put nodes read back from the disk tier into the prefix cache."""
        assert self.prefix is not None
        self.prefix.load(loads)

    def save_prefix(self, save: CacheSave) -> list[mx.array]:
        """Snapshot a prefilling row into the cache; returns the new (lazy) arrays."""
        assert self.prefix is not None
        state = self.prefill[save.row_id]
        arrays = self.prefix.save(state, 0, save)
        if save.inside:
            for layer in state.layers:
                if isinstance(layer, SSMState):
                    layer.checkpoint = None  # read: a later save of this row is its own
        return arrays

    def drop_prefix(self, drop: CacheDrop) -> None:
        assert self.prefix is not None
        self.prefix.drop(drop)

    def sync(
        self,
        decode_row_ids: Sequence[str],
        freed_row_ids: Sequence[str],
        forks: Sequence[tuple[str, str]],
        hold: bool = False,
        verify_row_ids: Sequence[str] = (),
    ) -> None:
        """Make the decode batch hold exactly `decode_row_ids` and the verify batch (rows
        that speculate this step) `verify_row_ids`, in those orders; with `hold` (the rows
        sit this step out) leave both as they are (freed rows leave at the next sync). A
        row that changes batch moves as an extracted B=1 state, except when every row of
        one batch moves to the other, which holds none: then the batches trade places."""
        for child, parent in forks:
            self.prefill[child] = self.prefill[parent].extract(0)
        for row_id in freed_row_ids:
            self.prefill.pop(row_id, None)
        if hold:
            return
        self._trade_places(decode_row_ids, verify_row_ids)
        self._move_out(self.decode, self.decode_ids, set(verify_row_ids))
        self._move_out(self.verify, self.verify_ids, set(decode_row_ids))
        self.decode_ids = self._sync_batch(self.decode, self.decode_ids, decode_row_ids)
        if self._bucket is not None and self.decode_ids:
            self.decode.pad_rows(self._bucket(len(self.decode_ids)) - self.decode.num_rows)
        self.verify_ids = self._sync_batch(self.verify, self.verify_ids, verify_row_ids)
        if self._bucket is not None and self.verify_ids:  # the compiled verify's shapes too
            self.verify.pad_rows(self._bucket(len(self.verify_ids)) - self.verify.num_rows)
        assert self.decode_ids == list(decode_row_ids), "decode batch order diverged"
        assert self.verify_ids == list(verify_row_ids), "verify batch order diverged"

    def _trade_places(self, decode_row_ids: Sequence[str], verify_row_ids: Sequence[str]) -> None:
        """When all the decode batch's rows go on to verify and the verify batch holds
        none, or the other way round, swap the two batches instead of extracting every
        row and merging it into the other (a probe of 64 rows that all speculate, and
        their way back: ~1,000 graph nodes each way, each a cost on a GPU)."""
        decode, verify = set(self.decode_ids), set(self.verify_ids)
        to_verify = bool(decode) and not verify and decode <= set(verify_row_ids)
        to_decode = bool(verify) and not decode and verify <= set(decode_row_ids)
        if to_verify or to_decode:
            self.decode, self.verify = self.verify, self.decode
            self.decode_ids, self.verify_ids = self.verify_ids, self.decode_ids

    def _move_out(self, batch: BatchState, ids: list[str], elsewhere: set[str]) -> None:
        """Rows of `batch` wanted in the other batch wait as B=1 states (with prompts)."""
        for i, row_id in enumerate(ids):
            if row_id in elsewhere:
                self.prefill[row_id] = batch.extract(i)

    def _sync_batch(
        self, batch: BatchState, ids: list[str], wanted_ids: Sequence[str]
    ) -> list[str]:
        """Filter `batch` to the wanted rows it holds, append the others (from the B=1
        states), then order them as wanted; returns the batch's new row ids."""
        wanted = set(wanted_ids)
        keep = [i for i, r in enumerate(ids) if r in wanted]
        held = set(ids)
        joining = [r for r in wanted_ids if r not in held]
        if len(keep) != len(ids) or (joining and keep != list(range(batch.num_rows))):
            batch.filter(keep)  # also drops dead rows before rows join
            ids = [ids[i] for i in keep]
        if joining:
            # Gather the joining rows first: the batch is copied once per step, not once
            # per joining row.
            joined = self.prefill.pop(joining[0])
            for row_id in joining[1:]:
                joined.merge(self.prefill.pop(row_id))
            batch.merge(joined)
            ids = ids + joining
        if ids != list(wanted_ids):  # a row moved in ahead of rows that stayed
            where = {r: i for i, r in enumerate(ids)}
            batch.filter([where[r] for r in wanted_ids])
            ids = list(wanted_ids)
        return ids

    def reset(self) -> None:
        """Drop every row (after a failed step the states may be half-written)."""
        self.decode = self._new_state()
        self.decode_ids = []
        self.verify = self._new_state()
        self.verify_ids = []
        self.prefill = {}
        self._cohort_drafts = {}
        if self.prefix is not None:
            self.prefix.reset()

    def nbytes(self) -> int:
        """Row state plus the prefix cache's arrays."""
        rows = self.decode.nbytes() + self.verify.nbytes()
        rows += sum(s.nbytes() for s in self.prefill.values())
        return rows + (self.prefix.nbytes() if self.prefix is not None else 0)
