"""A mixed step packed and compiled: the decode batch and fresh prompts' first chunks as
one forward whose groups share each weight's matmul, traced one layer at a time.

At 9B a prompt chunk beside the decode rows reads every weight a second time (~6-7 ms of
an H100's ~10 ms fixed part of a mixed step, bench/README.md), which one forward over
both groups' tokens saves. Eagerly, that forward costs ~5 ms more host time than the
compiled decode and prompt forwards it replaces; compiled as one function it would need a
trace per (decode shape, KV capacity, prompt buckets), dozens met once each under load,
each a whole model's trace.

So each decoder layer runs as a compiled call with the layer's weights as inputs: one
traced function per layer kind (DeltaNet or attention, and the last layer, whose prompt
rows keep only their last position) serves every layer of that kind, and a new set of
shapes traces a layer of each kind, not the model. DeltaNet layers' traces are keyed by
the decode batch's and the prompt blocks' sizes alone; attention layers' by the decode
KV capacity too. The prompts come as blocks, each a bucketed group of the cohorts the
compiled prompt forward would run one call each (shapes.cohort_splits: a burst of
arrivals of unlike lengths is several); every block shares the matmuls. The embedding
with the rotary tables, and the final norm with the logits, are two more compiled calls.

Exact against the separate compiled forwards (engine/decode.py's decode step,
engine/compiled_prefill.py's fresh prompts) up to the order of floating-point sums:
each group's attention and DeltaNet core are theirs; only the token-wise matmuls run over
all groups' rows at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from deltaserve.engine.cache.batch import BatchState
from deltaserve.engine.cache.kv import KVStore
from deltaserve.engine.cache.ssm import SSMState
from deltaserve.engine.compiled_prefill import (
    CompiledPrefill,
    FreshKV,
    fresh_states,
    prompt_block,
)
from deltaserve.engine.decode import CompiledDecode, KVView, SSMView
from deltaserve.models.qwen35 import DecoderLayer, GroupContext, Qwen35Model
from deltaserve.models.state import ForwardGroup

# A layer kind: (full attention?, the last layer?)
Kind = tuple[bool, bool]


class PackedMixedStep:
    """The decode batch and blocks of fresh prompts' first chunks through one packed
    forward, each layer a compiled call of its kind's traced function (see the module
    docstring)."""

    def __init__(self, model: Qwen35Model) -> None:
        self.model = model
        last = len(model.layers) - 1
        self._kinds: list[Kind] = [
            (layer.is_full_attention, i == last) for i, layer in enumerate(model.layers)
        ]
        # each kind's traced body runs the first layer of that kind with another layer's
        # weights swapped in (only while tracing: a replay reads the inputs)
        self._template: dict[Kind, DecoderLayer] = {}
        self._names: dict[Kind, list[str]] = {}
        for kind, layer in zip(self._kinds, model.layers, strict=True):
            if kind not in self._template:
                self._template[kind] = layer
                self._names[kind] = [name for name, _ in tree_flatten(layer.parameters())]
        self._layer_fn = {kind: mx.compile(self._layer_body(kind)) for kind in self._template}
        self._prepare_fn = mx.compile(self._prepare)
        self._finish_fn = mx.compile(self._finish)
        self._weights: list[list[mx.array]] | None = None  # per layer, read at first call
        # read by a traced body while it traces: the layer's stores (their kinds and
        # encodings) and how many arrays its decode state has
        self._decode_store: KVStore | SSMState | None = None
        self._prompt_store: KVStore | SSMState | None = None
        self._decode_arrays = 0
        self._blocks = 0  # prompt blocks of the call
        # (decode batch shape, its first KV store's shape, prompt blocks' shapes) of each call:
        # a new one traced some layer kind (the runner reports it with the step)
        self.shapes: set[tuple] = set()

    @staticmethod
    def supports(decode: BatchState, template: BatchState, rows: int) -> bool:
        """Whether the decode batch (every store with a traced form, state present) and
        blocks of up to `rows` fresh prompts of `template`'s kinds can run packed."""
        if not (CompiledDecode.supports(decode) and CompiledPrefill.applies(template, rows)):
            return False
        kv = [s for s in decode.layers if isinstance(s, KVStore)]
        ssm = [s for s in decode.layers if isinstance(s, SSMState)]
        return not (kv and kv[0].arrays is None) and all(s.conv is not None for s in ssm)

    def __call__(
        self,
        tokens: mx.array,
        offsets: Sequence[int],
        decode: BatchState,
        blocks: Sequence[Sequence[Sequence[int]]],
        template: BatchState,
    ) -> tuple[mx.array, list[tuple[mx.array, list[BatchState]]]]:
        """tokens [B, 1] int32 (possibly lazy) of the decode batch's B live rows at
        `offsets` (dead rows after them, as CompiledDecode runs them), and blocks of fresh
        prompts' tokens from position 0 (each block one bucketed group, as one
        CompiledPrefill call runs it) -> (the decode rows' logits [B, V] float32, per
        block each prompt's last final-normed hidden state [P, 1, H] and one B=1
        BatchState per prompt, as CompiledPrefill returns them). The decode batch's new
        state goes into `decode`."""
        live, rows = tokens.shape[0], decode.num_rows
        offsets_a = mx.array(list(offsets), dtype=mx.int32)
        if rows > live:  # dead rows that hold the batch at its bucket size (RowStates)
            tokens = mx.concatenate([tokens, mx.zeros((rows - live, 1), tokens.dtype)])
            offsets_a = mx.concatenate([offsets_a, mx.zeros((rows - live,), mx.int32)])
        kv = [s for s in decode.layers if isinstance(s, KVStore)]
        for store in kv:
            store.reserve(1)
        size = mx.array([kv[0].size if kv else 0], mx.int32)
        left_pad = kv[0].pad_array() if kv else mx.zeros((rows,), mx.int32)
        padded = [prompt_block(prompts) for prompts in blocks]
        pads_a = [mx.array(pads, dtype=mx.int32) for _, pads in padded]
        store_shape = tuple(kv[0].arrays[0].shape) if kv else ()
        block_shapes = tuple(tuple(ids.shape) for ids, _ in padded)
        self.shapes.add((tuple(tokens.shape), store_shape, block_shapes))
        if self._weights is None:
            self._weights = self._layer_weights()
        inputs = [a for (ids, _), pads in zip(padded, pads_a, strict=True) for a in (ids, pads)]
        x_d, *rest = self._prepare_fn(tokens.astype(mx.int32), offsets_a, *inputs)
        n = len(blocks)
        x_ps, (cos_d, sin_d), tables = rest[:n], rest[n : n + 2], rest[n + 2 :]
        per_block = [[*tables[3 * j : 3 * j + 3], pads_a[j]] for j in range(n)]
        block_inputs = [a for parts in per_block for a in parts]
        block_flat: list[list[mx.array]] = [[] for _ in blocks]
        arity = []  # arrays per KV layer of a prompt row's state
        self._blocks = n
        layers = zip(self._kinds, decode.layers, template.layers, self._weights, strict=True)
        for kind, store, prompt_kind, weights in layers:
            flat = list(store.arrays) if isinstance(store, KVStore) else [store.conv, store.ssm]
            self._decode_store, self._prompt_store = store, prompt_kind
            self._decode_arrays = len(flat)
            out = self._layer_fn[kind](
                x_d, *x_ps, cos_d, sin_d, *block_inputs, left_pad, size, *flat, *weights
            )
            x_d, x_ps, new = out[0], out[1 : n + 1], out[n + 1 :]
            if isinstance(store, KVStore):
                store.arrays = new[: len(flat)]
            else:
                store.conv, store.ssm = new[:2]
            fresh = new[len(flat) :]
            width = len(fresh) // n  # each block's arrays of this layer
            if isinstance(store, KVStore):
                arity.append(width)
            for j in range(n):
                block_flat[j] += fresh[j * width : (j + 1) * width]
        for store in kv:
            store.size += 1
        logits, *hidden = self._finish_fn(x_d, *x_ps)
        runs = []
        for j, ((ids, pads), prompts) in enumerate(zip(padded, blocks, strict=True)):
            states = fresh_states(
                block_flat[j], pads[: len(prompts)], ids.shape[1], template, arity
            )
            runs.append((hidden[j][: len(prompts)], states))
        return logits[:live], runs

    def _layer_weights(self) -> list[list[mx.array]]:
        """Each layer's parameters in its kind's order (read once the model is loaded,
        its projections fused and its weights quantized: they do not change after)."""
        weights = []
        for kind, layer in zip(self._kinds, self.model.layers, strict=True):
            named = tree_flatten(layer.parameters())
            if [name for name, _ in named] != self._names[kind]:
                raise ValueError("a layer's parameters differ from its kind's first layer's")
            weights.append([value for _, value in named])
        return weights

    def _prepare(self, tokens: mx.array, offsets: mx.array, *blocks: mx.array) -> list[mx.array]:
        """The traced start: the decode rows' and each block's embeddings (blocks: each
        block's ids and pads in turn), then the decode rows' rotary tables, then each
        block's tables and token mask (as the model computes them once per forward)."""
        rope, embed = self.model._rope, self.model.embed_tokens
        pairs = list(zip(blocks[::2], blocks[1::2], strict=True))
        out = [embed(tokens), *(embed(ids) for ids, _ in pairs)]
        positions = mx.broadcast_to(offsets[None, :, None], (3, offsets.shape[0], 1))
        out += rope.cos_sin(positions)
        for ids, pads in pairs:
            length = ids.shape[1]
            base = mx.arange(length, dtype=mx.int32)[None] - pads[:, None]
            positions = mx.broadcast_to(mx.maximum(base, 0)[None], (3, *ids.shape))
            mask = mx.arange(length, dtype=mx.int32)[None, :] >= pads[:, None]
            out += [*rope.cos_sin(positions), mask]
        return out

    def _finish(self, x_d: mx.array, *x_ps: mx.array) -> list[mx.array]:
        """The traced end: the decode rows' logits and each block's last hidden states."""
        hidden_d = self.model.norm(x_d)
        return [self.model.logits(hidden_d[:, -1]), *(self.model.norm(x[:, -1:]) for x in x_ps)]

    def _layer_body(self, kind: Kind) -> Callable[..., list[mx.array]]:
        """The traced body of one layer of `kind` for the decode rows and `_blocks`
        prompt blocks: inputs x_d, each block's x, the decode rows' cos / sin, each
        block's cos / sin / mask / pads, the decode KV's left pads and size, the decode
        state's arrays and the layer's weights; outputs the new x_d and blocks' x, the
        decode state's new arrays, then each block's fresh arrays."""
        layer, names = self._template[kind], self._names[kind]
        attention, last = kind

        def body(*args: mx.array) -> list[mx.array]:
            n, arrays = self._blocks, self._decode_arrays
            x_d, xs, (cos_d, sin_d) = args[0], list(args[1 : n + 1]), args[n + 1 : n + 3]
            blocks = [args[n + 3 + 4 * j : n + 7 + 4 * j] for j in range(n)]
            left_pad, size, *rest = args[5 * n + 3 :]
            flat, weights = rest[:arrays], rest[arrays:]
            rope = self.model._rope
            views: list[KVView | FreshKV | SSMView]
            if attention:
                assert isinstance(self._decode_store, KVStore)
                assert isinstance(self._prompt_store, KVStore)
                views = [KVView(self._decode_store, list(flat), left_pad, size)]
                views += [FreshKV(self._prompt_store, pads) for *_, pads in blocks]
            else:
                views = [SSMView(flat[0], flat[1])] + [SSMView(None, None) for _ in blocks]
            # the groups' positions are read only through their contexts' tables here
            groups = [ForwardGroup(None, cos_d, [views[0]], embeds=x_d)]
            groups += [
                ForwardGroup(None, cos, [view], pads, embeds=x)
                for (cos, _, _, pads), view, x in zip(blocks, views[1:], xs, strict=True)
            ]
            contexts = [GroupContext(rope, (cos_d, sin_d), None)]
            contexts += [GroupContext(rope, (cos, sin), mask) for cos, sin, mask, _ in blocks]
            saved = layer.parameters()
            layer.update(tree_unflatten(list(zip(names, weights, strict=True))))
            try:
                mixed = layer.mix_packed([x_d, *xs], groups, contexts, views, (False, *[last] * n))
                result = layer.feed_forward_packed(mixed)
            finally:
                layer.update(saved)
            for view in views:
                if isinstance(view, SSMView):
                    result += [view.conv, view.ssm]
                else:
                    result += view.arrays
            return result

        return body
