"""The prefix cache's arrays, under the node ids of engine/cache/prefix_index.py.

Per node: its block's KV in every full-attention layer, in the store's encoded form
(fp, affine or TurboQuant arrays, each [1, Hkv, block, X]: a hit never re-encodes), and,
for snapshot nodes, every DeltaNet layer's conv tail [1, K-1, C] and recurrent state
[1, Hv, Dv, Dk]. Blocks are shared by every cached prefix that passes through them.

A hit builds the row's own B=1 prefill state from a chain of nodes: its KV columns are
the blocks concatenated with free columns after them (one copy, because a row's
attention reads one contiguous [B, Hkv, T, X] slab), its DeltaNet state the snapshot's
arrays themselves (arrays are values: the row's next chunk makes new ones and the
snapshot stays as it was). Saving copies (fresh_copy): a slice would pin the whole batch
it came from.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore, fresh_copy
from deltaserve.engine.cache.prefix_index import CacheDrop, CacheSave
from deltaserve.engine.cache.ssm import SSMState


class PrefixStore:
    """Node id -> arrays; save from and restore into B=1 prefill states."""

    def __init__(self, new_state: Callable[[], BatchState]) -> None:
        self._new_state = new_state
        self.kv: dict[int, list[list[mx.array]]] = {}  # node -> per attention layer
        self.snapshots: dict[int, list[tuple[mx.array, mx.array]]] = {}  # node -> per DeltaNet

    def save(self, state: BatchState, row: int, save: CacheSave) -> list[mx.array]:
        """Copy row `row` of `state` into the cache: the KV columns of the new nodes and
        the DeltaNet state. The row has computed up to the snapshot's position, or past
        it in this step's chunk, whose forward then kept the DeltaNet state there
        (SSMState.checkpoint). Returns the new arrays (lazy: the caller evaluates them
        with the step)."""
        kv_layers = [layer for layer in state.layers if isinstance(layer, KVStore)]
        computed = {kv.lengths()[row] for kv in kv_layers}
        assert len(computed) == 1 and computed.pop() >= save.position, "saved off-step"
        new: list[mx.array] = []
        for node_id, lo, hi in save.blocks:
            per_layer = []
            for layer in kv_layers:
                pad = layer.left_pad[row]
                cols = [a[row : row + 1, :, pad + lo : pad + hi] for a in layer.state_arrays()]
                per_layer.append([fresh_copy(c) for c in cols])
            self.kv[node_id] = per_layer
            new += [a for arrays in per_layer for a in arrays]
        snapshot = []
        for layer in state.layers:
            if isinstance(layer, SSMState):
                pair = layer.checkpoint if save.inside else (layer.conv, layer.ssm)
                assert pair is not None and pair[0] is not None, "state not computed"
                conv, ssm = (fresh_copy(a[row : row + 1]) for a in pair)
                snapshot.append((conv, ssm))
                new += [conv, ssm]
        self.snapshots[save.snapshot] = snapshot
        return new

    def restore(self, chain: tuple[int, ...]) -> BatchState:
        """A fresh B=1 state holding the chain's tokens: KV blocks joined in order, the
        DeltaNet state of the chain's last node."""
        state = self._new_state()
        blocks = [self.kv[node_id] for node_id in chain]
        snapshot = iter(self.snapshots[chain[-1]])
        kv_index = 0
        for layer in state.layers:
            if isinstance(layer, KVStore):
                per_array = zip(*(b[kv_index] for b in blocks), strict=True)
                layer.load([list(parts) for parts in per_array])
                kv_index += 1
            elif isinstance(layer, SSMState):
                layer.conv, layer.ssm = next(snapshot)
        return state

    def drop(self, drop: CacheDrop) -> None:
        for node_id in drop.kv:
            self.kv.pop(node_id, None)
        for node_id in drop.snapshots:
            self.snapshots.pop(node_id, None)

    def reset(self) -> None:
        self.kv, self.snapshots = {}, {}

    def nbytes(self) -> int:
        kv = sum(a.nbytes for layers in self.kv.values() for arrs in layers for a in arrs)
        ssm = sum(c.nbytes + s.nbytes for snap in self.snapshots.values() for c, s in snap)
        return kv + ssm
