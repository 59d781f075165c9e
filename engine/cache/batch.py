"""All layers' row state for one batch of rows, with row ops applied layer by layer."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from deltaserve.engine.cache.kv import FullPrecisionKV, KVStore
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.cache.start_precision import PrefixKV
from deltaserve.models.config import TextConfig

LayerStore = KVStore | PrefixKV | SSMState


class BatchState:
    """Per-layer stores of the same rows, in the same order (row i is row i everywhere).

    `draft`: the MTP head's own KV store of the same rows (speculative decoding,
    engine/speculative.py), or None. It follows every row op (merge, filter, extract,
    pad_rows) but not keep_verified: the head's columns are the drafter's to roll back. A
    row may hold none of its columns yet (its store then counts it with no tokens).
    """

    def __init__(self, layers: list[LayerStore], draft: KVStore | None = None) -> None:
        self.layers = layers
        self.draft = draft

    @classmethod
    def empty(
        cls,
        cfg: TextConfig,
        kv_factory: Callable[[], KVStore | PrefixKV] = FullPrecisionKV,
        draft: bool = False,
    ) -> BatchState:
        """Fresh state for rows that have seen no token yet (with an empty MTP-head store
        when `draft`)."""
        layers: list[LayerStore] = [
            kv_factory() if cfg.is_full_attention(i) else SSMState()
            for i in range(cfg.num_hidden_layers)
        ]
        return cls(layers, FullPrecisionKV() if draft else None)

    def aligned_draft(self) -> KVStore | None:
        """The head's store, holding every row (rows it never stored to get no tokens)."""
        if self.draft is not None and self.draft.num_rows < self.num_rows:
            self.draft.pad_rows(self.num_rows - self.draft.num_rows)
        return self.draft

    def state_arrays(self) -> list[mx.array]:
        """Every layer's stored arrays (not the head's store), e.g. to evaluate after a
        forward wrote them."""
        return [a for layer in self.layers for a in layer.state_arrays()]

    @property
    def num_rows(self) -> int:
        return max((layer.num_rows for layer in self.layers), default=0)

    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep` (new order); freed rows' memory goes with them."""
        draft = self.aligned_draft()
        for layer in self.layers:
            layer.filter(keep)
        if draft is not None:
            draft.filter(keep)

    def extract(self, row: int) -> BatchState:
        """Independent B=1 copy of one row (e.g. to fork n > 1 completions)."""
        draft = self.aligned_draft()
        layers = [layer.extract(row) for layer in self.layers]
        return BatchState(layers, draft.extract(row) if draft is not None else None)

    def merge(self, other: BatchState) -> None:
        """Append `other`'s rows after ours."""
        mine_draft, their_draft = self.aligned_draft(), other.aligned_draft()
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.merge(theirs)
        if mine_draft is not None and their_draft is not None:
            mine_draft.merge(their_draft)

    def keep_verified(self, kept: list[int], fed: int) -> None:
        """After a verify forward that fed `fed` columns to every row (ForwardGroup.
        state_slots): row b keeps its first kept[b] (1 <= kept[b] <= fed: its last
        token and the drafts it accepted). KV layers forget the other columns, DeltaNet
        layers take the state after column kept[b] - 1; no forward is replayed."""
        assert all(1 <= k <= fed for k in kept), (kept, fed)
        drop = [fed - k for k in kept]
        for layer in self.layers:
            if isinstance(layer, SSMState):
                layer.select_slots([k - 1 for k in kept])
            else:
                layer.rollback(drop)

    def keep_verified_pending(self, kept: mx.array, fed: int) -> None:
        """keep_verified with counts still computing (kept: [B] int32, lazy; a verify
        chained onto this one is being built): KV layers roll back pending
        (KVStore.rollback_pending) until `settle_verified` gets the counts read back."""
        for layer in self.layers:
            if isinstance(layer, SSMState):
                layer.select_slots(kept - 1)
            else:
                assert isinstance(layer, KVStore), "a pending rollback of a PrefixKV"
                layer.rollback_pending(fed - kept)

    def settle_verified(self, kept: list[int], fed: int) -> None:
        """The counts of keep_verified_pending, read back."""
        drop = [fed - k for k in kept]
        for layer in self.layers:
            if isinstance(layer, KVStore):
                layer.settle(drop)

    def pad_rows(self, count: int) -> None:
        """Append `count` dead rows to every layer (KVStore and SSMState only)."""
        draft = self.aligned_draft()
        for layer in self.layers:
            layer.pad_rows(count)
        if draft is not None:
            draft.pad_rows(count)

    def nbytes(self) -> int:
        head = self.draft.nbytes() if self.draft is not None else 0
        return head + sum(layer.nbytes() for layer in self.layers)
