"""The prefix cache's arrays, under the node ids of engine/prefix_cache/index.py.

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

With a disk tier (engine/prefix_cache/disk.py), each save's new arrays are copied to host
one flush after they were queued (write_back: computed by then, so the engine thread
rarely waits) and handed to the disk's writer thread; nodes loaded back from disk come in
through load(), before the step's restores.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore, fresh_copy
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.prefix_cache.disk import DiskNode, PrefixDisk
from deltaserve.engine.prefix_cache.index import CacheDrop, CacheLoad, CacheSave


class PrefixStore:
    """Node id -> arrays; save from and restore into B=1 prefill states."""

    def __init__(self, new_state: Callable[[], BatchState], disk: PrefixDisk | None = None) -> None:
        self._new_state = new_state
        self.disk = disk
        # (node, kind, arrays) saved but not yet handed to the disk: this flush's, the last
        self._to_write: list[tuple[DiskNode, str, list[mx.array]]] = []
        self._writing: list[tuple[DiskNode, str, list[mx.array]]] = []
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
        if save.disk and self.disk is not None:
            for (node_id, _, _), node in zip(save.blocks, save.disk, strict=False):
                self._to_write.append((node, "kv", _flat_kv(self.kv[node_id])))
            self._to_write.append((save.disk[-1], "snap", [a for pair in snapshot for a in pair]))
        return new

    def write_back(self, all_saved: bool = False) -> None:
        """Hand the saves of the flush before this one to the disk (copied to host here,
        on the engine thread: the writer thread never touches an MLX array), then hold
        this flush's until the next; `all_saved`: every save (at close)."""
        if self.disk is None:
            return
        ready, self._writing, self._to_write = self._writing, self._to_write, []
        if all_saved:
            ready, self._writing = ready + self._writing, []
        for node, kind, arrays in ready:
            self.disk.put(node, kind, [_to_host(a) for a in arrays], [str(a.dtype) for a in arrays])

    def load(self, loads: tuple[CacheLoad, ...]) -> None:
        """Put the nodes read back from disk into the store (before the step's restores)."""
        assert self.disk is not None or not loads, "loads without a disk tier"
        for load in loads:
            if load.kv:
                arrays = _from_host(*self.disk.take(load.key, "kv"))
                layers = sum(isinstance(x, KVStore) for x in self._new_state().layers)
                size = len(arrays) // layers
                self.kv[load.node_id] = [arrays[i : i + size] for i in range(0, len(arrays), size)]
            if load.snapshot:
                arrays = _from_host(*self.disk.take(load.key, "snap"))
                self.snapshots[load.node_id] = list(zip(arrays[::2], arrays[1::2], strict=True))

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
        self._to_write, self._writing = [], []

    def nbytes(self) -> int:
        kv = sum(a.nbytes for layers in self.kv.values() for arrs in layers for a in arrs)
        ssm = sum(c.nbytes + s.nbytes for snap in self.snapshots.values() for c, s in snap)
        return kv + ssm


def _flat_kv(per_layer: list[list[mx.array]]) -> list[mx.array]:
    return [a for arrays in per_layer for a in arrays]


def _to_host(a: mx.array) -> np.ndarray:
    """A host copy; bfloat16 (numpy has none) as its raw uint16 bits."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _from_host(arrays: list[np.ndarray], dtypes: list[str]) -> list[mx.array]:
    out = []
    for a, dtype in zip(arrays, dtypes, strict=True):
        x = mx.array(a)
        out.append(x.view(mx.bfloat16) if dtype == str(mx.bfloat16) else x)
    return out
