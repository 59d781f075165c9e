"""The prefix cache's index: which prompt prefixes have cached row state, and what it costs.

Pure Python (the scheduler owns it; the arrays live in engine/prefix_cache/store.py under
the same node ids). A trie of fixed-size token blocks: a node is one block of `block`
tokens after its parent's, so the path from the root spells a prompt prefix, and looking a
child up by its token tuple hashes the block (the chain of tuples is the hash chain).

Every node stands for the full-attention KV of its block. Some nodes also hold a
*snapshot*: every DeltaNet layer's conv tail and recurrent state after the node's last
token. Recurrent state cannot be cut back to an earlier token, so a prompt resumes only at
a snapshot: the deepest one on its path that leaves at least one prompt token to compute
(its logits sample the first token). KV alone resumes nothing, hence the invariant: every
leaf holds a snapshot, and nodes left without one below them are pruned.

Where snapshots are taken (the policy of Marconi, arXiv:2411.19379): a snapshot per
block would cost a full recurrent state per `block` tokens, so a prompt snapshots only
  - where the caller says the next request will continue it (GenerationRequest.prefix_hint:
    a chat's history before the generation prompt; any position, a partial block then
    ends the path as a *tail*), else at its last block boundary (a resent prompt, or a
    continuation of this whole prompt, resumes there), and
  - where it leaves the cached tokens (the block boundary at which it branches off a
    cached path that has no snapshot there yet): the prefix two requests share, e.g. a
    system prompt and tool list, so the third request on it resumes there.

Memory: every byte is reserved in the engine's MemoryBudget (rows and cache share it) and
capped at `max_bytes`. Least recently used snapshots go first when the cache is full or
when a row must be admitted; a node's KV goes when nothing below it needs it.

Disk tier (engine/prefix_cache/disk.py, when configured): each node has a key, the hash
chain of its tokens; every save is written through to disk, and a prompt whose memory hit
is shorter than a snapshot chain on disk loads that chain's missing nodes back (CacheLoad):
they enter the trie and the budget exactly as a save's nodes do, then resume as a hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.engine.cache.budget import MemoryBudget
from deltaserve.engine.prefix_cache.disk import DiskNode, PrefixDisk, node_key


@dataclass(eq=False)
class _Node:
    """A block (or a tail: fewer tokens, always a leaf with a snapshot)."""

    node_id: int
    parent: _Node | None
    tokens: tuple[int, ...]  # this block's token ids
    start: int  # prompt position of its first token (parent.end)
    kv_bytes: int
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # full blocks
    tails: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # partial blocks
    snapshot: bool = False
    last_used: int = 0
    key: str = ""  # hash chain of the tokens from the root (the disk tier's name)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def disk_node(self) -> DiskNode:
        return DiskNode(self.key, self.parent.key if self.parent else "", self.start, self.end)


@dataclass(frozen=True)
class CacheHit:
    """What a prompt finds at admission. Written by PrefixIndex.match."""

    chain: tuple[int, ...]  # node ids, root first, ending at the resumed snapshot
    tokens: int  # prompt tokens covered by the chain; 0 = a miss
    snapshot_at: tuple[int, ...]  # prompt positions (ascending) to snapshot at


@dataclass(frozen=True)
class CacheSave:
    """Store a row's state. Written by the scheduler, applied by the runner right after
    the prefill chunk that ends at the snapshot's position."""

    row_id: str
    blocks: tuple[tuple[int, int, int], ...]  # (node id, first, end token): KV to store
    snapshot: int  # node id that keeps the row's DeltaNet state
    position: int  # tokens the row has computed when it is saved (the snapshot's end)
    # The chunk runs past `position` (the forward keeps the DeltaNet state there: written
    # by the scheduler); False: the chunk ends at it
    inside: bool = False
    # The disk tier's names of the new blocks, then of the snapshot node (empty: no disk)
    disk: tuple[DiskNode, ...] = ()


@dataclass(frozen=True)
class CacheLoad:
    """A node read back from the disk tier (staged in PrefixDisk), to put in the store
    before this step's restores. Written by PrefixIndex.match."""

    node_id: int
    key: str
    kv: bool  # its KV block comes from disk (else it is in memory already)
    snapshot: bool  # its snapshot comes from disk


@dataclass(frozen=True)
class CacheDrop:
    """Arrays to free (after this step's restores and saves). Written by PrefixIndex."""

    kv: tuple[int, ...] = ()  # node ids whose KV block goes
    snapshots: tuple[int, ...] = ()  # node ids whose snapshot goes


@dataclass
class PrefixCacheStats:
    """Counters since start (or since the last reset), for /metrics."""

    lookup_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, restored from the cache
    evictions: int = 0  # snapshots evicted (LRU)
    nbytes: int = 0  # reserved now


class PrefixIndex:
    """Trie of cached prompt blocks, LRU eviction and byte accounting."""

    def __init__(
        self,
        block: int,
        kv_token_bytes: int,
        snapshot_bytes: int,
        max_bytes: int,
        budget: MemoryBudget,
        min_tokens: int = 1,
        disk: PrefixDisk | None = None,
    ) -> None:
        """min_tokens: no snapshot is planned before this prompt position. disk: the
        disk tier (None: memory only)."""
        self.block = block
        self.kv_token_bytes = kv_token_bytes
        self.snapshot_bytes = snapshot_bytes
        self.max_bytes = max_bytes
        self.budget = budget
        self.min_tokens = min_tokens
        self.stats = PrefixCacheStats()
        self._root = _Node(-1, None, (), 0, 0)
        self._next_id = 0
        self._clock = 0
        self._snapshots: dict[int, _Node] = {}  # node id -> node, for eviction
        self._dropped_kv: list[int] = []
        self._dropped_snapshots: list[int] = []
        self.disk = disk
        self._loads: list[CacheLoad] = []

    # -- lookup -------------------------------------------------------------------------
    def match(self, prompt: Sequence[int], hint: int = 0) -> CacheHit:
        """The longest cached prefix of `prompt` to resume from, and where to snapshot
        (`hint`: one more position, see GenerationRequest.prefix_hint)."""
        self._clock += 1
        last = (len(prompt) - 1) // self.block  # deepest usable boundary (1 token left)
        path = self._walk(prompt, last)
        chain = self._resume_chain(prompt, path)
        if self.disk is not None and self._load_from_disk(prompt, last, path, chain):
            path = self._walk(prompt, last)
            chain = self._resume_chain(prompt, path)
        for node in chain:
            node.last_used = self._clock
        tokens = chain[-1].end if chain else 0
        # The hint, when given, replaces the last boundary: it is where the next request
        # continues, and a resend of this same prompt resumes there too.
        points = {len(path) * self.block, hint or last * self.block}
        points = {p for p in points if max(tokens + 1, self.min_tokens) <= p < len(prompt)}
        self.stats.lookup_tokens += len(prompt)
        self.stats.hit_tokens += tokens
        ids = tuple(n.node_id for n in chain)
        return CacheHit(ids, tokens, tuple(sorted(points)))

    def _resume_chain(self, prompt: Sequence[int], path: list[_Node]) -> list[_Node]:
        """The deepest snapshot on `path` or in a tail below one of its nodes that leaves
        at least one prompt token, with the nodes leading to it."""
        best: list[_Node] = []
        for depth, node in enumerate([self._root, *path]):
            if node.snapshot:
                best = path[:depth]
            for tail in node.tails.values():
                end = tail.end
                fits = end < len(prompt) and tuple(prompt[tail.start : end]) == tail.tokens
                if fits and end > (best[-1].end if best else 0):
                    best = [*path[:depth], tail]
        return best

    def _walk(self, prompt: Sequence[int], depth: int) -> list[_Node]:
        """Nodes matching the prompt's first `depth` blocks, root's child first."""
        path, node = [], self._root
        for d in range(depth):
            node = node.children.get(self._block_of(prompt, d))
            if node is None:
                break
            path.append(node)
        return path

    def _block_of(self, prompt: Sequence[int], d: int) -> tuple[int, ...]:
        return tuple(prompt[d * self.block : (d + 1) * self.block])

    # -- the disk tier --------------------------------------------------------------------
    def _load_from_disk(
        self, prompt: Sequence[int], last: int, path: list[_Node], chain: list[_Node]
    ) -> bool:
        """Bring back from disk the deepest snapshot chain that resumes more of `prompt`
        than memory (`chain`) does; True when it did. A file that fails its check is
        dropped by the disk tier, so the next try finds a shorter chain."""
        for _ in range(3):
            nodes = self._disk_chain(prompt, last)
            if not nodes or nodes[-1][1] <= (chain[-1].end if chain else 0):
                return False
            if self._load_chain(prompt, nodes, path):
                return True
        return False

    def _disk_chain(self, prompt: Sequence[int], last: int) -> list[tuple[str, int]]:
        """(key, end) of each node from the root to the deepest snapshot on disk that
        leaves at least one prompt token; every node's KV is on disk or in memory."""
        assert self.disk is not None
        best: list[tuple[str, int]] = []
        keys: list[tuple[str, int]] = []
        node: _Node | None = self._root
        for d in range(last + 1):
            parent = keys[-1][0] if keys else ""
            if keys and self.disk.has(parent, "snap"):
                best = list(keys)
            for n in sorted(self.disk.tail_lengths(parent)):
                end = d * self.block + n
                key = node_key(parent, tuple(prompt[d * self.block : end]))
                fits = n < self.block and (best[-1][1] if best else 0) < end < len(prompt)
                if fits and self.disk.has(key, "snap") and self.disk.has(key, "kv"):
                    best = [*keys, (key, end)]
            if d == last:
                break
            block = self._block_of(prompt, d)
            child = node.children.get(block) if node is not None else None
            key = child.key if child is not None else node_key(parent, block)
            if child is None and not self.disk.has(key, "kv"):
                break
            keys.append((key, (d + 1) * self.block))
            node = child
        return best

    def _load_chain(
        self, prompt: Sequence[int], nodes: list[tuple[str, int]], path: list[_Node]
    ) -> bool:
        """Stage the files of the nodes memory lacks, make room, add the nodes; False
        (nothing added) when a file fails or the cache has no room."""
        assert self.disk is not None
        in_memory = [n for n, (key, _) in zip(path, nodes, strict=False) if n.key == key]
        missing = nodes[len(in_memory) :]
        kinds = [(key, "kv") for key, _ in missing] + [(nodes[-1][0], "snap")]
        if not all(self.disk.stage(key, kind) for key, kind in kinds):
            self.disk.clear_staged()
            return False
        kv = sum(end - (nodes[i - 1][1] if i else 0) for i, (_, end) in enumerate(nodes)
                 if i >= len(in_memory)) * self.kv_token_bytes  # fmt: skip
        if not self._make_room(kv + self.snapshot_bytes, in_memory):
            self.disk.clear_staged()
            return False
        node = in_memory[-1] if in_memory else self._root
        for key, end in missing:
            node = self._add_child(node, tuple(prompt[node.end : end]))
            assert node.key == key, "a disk node's tokens"
            self._loads.append(CacheLoad(node.node_id, key, kv=True, snapshot=False))
        node.snapshot = True
        self._snapshots[node.node_id] = node
        self._reserve(self.snapshot_bytes)
        self._loads.append(CacheLoad(node.node_id, node.key, kv=False, snapshot=True))
        return True

    def take_loads(self) -> tuple[CacheLoad, ...]:
        """The nodes loaded from disk since the last call (the next step's plan)."""
        loads, self._loads = tuple(self._loads), []
        return loads

    # -- insertion ----------------------------------------------------------------------
    def insert(self, row_id: str, prompt: Sequence[int], position: int) -> CacheSave | None:
        """Add a snapshot after `prompt[:position]`, creating the nodes whose KV is
        missing (full blocks, then a tail when `position` is not a block boundary).
        None when it exists already or finds no room."""
        assert 0 < position <= len(prompt), "a snapshot position inside the prompt"
        depth, tail = divmod(position, self.block)
        path = self._walk(prompt, depth)
        tail_tokens = tuple(prompt[depth * self.block : position])
        if len(path) == depth:
            parent = path[-1] if path else self._root
            existing = parent.tails.get(tail_tokens) if tail else parent
            if existing is not None and existing.snapshot:
                return None
        missing = depth - len(path)
        need = missing * self.kv_block_bytes + tail * self.kv_token_bytes + self.snapshot_bytes
        if not self._make_room(need, path):
            return None
        node, created = path[-1] if path else self._root, []
        for d in range(len(path), depth):
            node = self._add_child(node, self._block_of(prompt, d))
            created.append(node)
        if tail:
            node = self._add_child(node, tail_tokens)
            created.append(node)
        node.snapshot = True
        self._snapshots[node.node_id] = node
        self._reserve(self.snapshot_bytes)
        for n in [*path, *created]:
            n.last_used = self._clock
        blocks = tuple((n.node_id, n.start, n.end) for n in created)
        disk = (*(n.disk_node() for n in created), node.disk_node()) if self.disk else ()
        return CacheSave(row_id, blocks, node.node_id, position, disk=disk)

    @property
    def kv_block_bytes(self) -> int:
        return self.block * self.kv_token_bytes

    def _add_child(self, parent: _Node, tokens: tuple[int, ...]) -> _Node:
        kv_bytes = len(tokens) * self.kv_token_bytes
        node = _Node(self._next_id, parent, tokens, parent.end, kv_bytes)
        if self.disk is not None:
            node.key = node_key(parent.key, tokens)
        self._next_id += 1
        (parent.children if len(tokens) == self.block else parent.tails)[tokens] = node
        self._reserve(kv_bytes)
        return node

    def _reserve(self, nbytes: int) -> None:
        self.budget.reserve(nbytes)
        self.stats.nbytes += nbytes

    def _release(self, nbytes: int) -> None:
        self.budget.release(nbytes)
        self.stats.nbytes -= nbytes

    # -- eviction -----------------------------------------------------------------------
    def _make_room(self, nbytes: int, keep: Sequence[_Node] = ()) -> bool:
        """Evict LRU snapshots (never those on `keep`) until `nbytes` more fit both the
        cap and the budget; False (nothing evicted) when they cannot."""
        if nbytes > self.max_bytes:
            return False
        protected = {n.node_id for n in keep}
        victims = sorted(
            (n for n in self._snapshots.values() if n.node_id not in protected),
            key=lambda n: n.last_used,
        )
        freeable = sum(self._freed_by(n, protected) for n in victims)
        if not self._fits(nbytes, freeable):
            return False
        for victim in victims:
            if self._fits(nbytes, 0):
                break
            self._evict(victim, protected)
        return self._fits(nbytes, 0)

    def _fits(self, nbytes: int, freeable: int) -> bool:
        within_cap = self.stats.nbytes - freeable + nbytes <= self.max_bytes
        return within_cap and self.budget.can_reserve(nbytes - freeable)

    def _freed_by(self, node: _Node, protected: set[int]) -> int:
        """Bytes evicting `node`'s snapshot frees (only an upper bound is needed to
        decide whether eviction can help: its KV counts if it is a leaf)."""
        leaf = not node.children and node.node_id not in protected
        return self.snapshot_bytes + (self.kv_token_bytes * node.end if leaf else 0)

    def evict_for(self, nbytes: int) -> bool:
        """Free cached state until a row reservation of `nbytes` fits the budget (rows
        come before the cache). False when even an empty cache would not make it fit."""
        if self.budget.can_reserve(nbytes):
            return True
        if not self.budget.can_reserve(nbytes - self.stats.nbytes):
            return False
        for victim in sorted(self._snapshots.values(), key=lambda n: n.last_used):
            self._evict(victim, set())
            if self.budget.can_reserve(nbytes):
                return True
        return self.budget.can_reserve(nbytes)

    def _evict(self, node: _Node, protected: set[int]) -> None:
        node.snapshot = False
        del self._snapshots[node.node_id]
        self._dropped_snapshots.append(node.node_id)
        self._release(self.snapshot_bytes)
        self.stats.evictions += 1
        # Prune upwards: a node without a snapshot and without children resumes nothing.
        while node is not self._root and not (node.children or node.tails or node.snapshot):
            if node.node_id in protected:
                break
            assert node.parent is not None
            siblings = node.parent.children if len(node.tokens) == self.block else node.parent.tails
            del siblings[node.tokens]
            self._dropped_kv.append(node.node_id)
            self._release(node.kv_bytes)
            node = node.parent

    def take_drops(self) -> CacheDrop | None:
        """The arrays freed since the last call (the next step's output carries them)."""
        if not self._dropped_kv and not self._dropped_snapshots:
            return None
        drop = CacheDrop(tuple(self._dropped_kv), tuple(self._dropped_snapshots))
        self._dropped_kv, self._dropped_snapshots = [], []
        return drop

    def reset(self) -> None:
        """Forget everything and give its bytes back (the row states were lost: a step
        failed)."""
        self.budget.release(self.forget())

    def forget(self) -> int:
        """Forget every node; returns the bytes they held, for the caller to account
        (Scheduler.fail_all clears the whole budget instead)."""
        nbytes, self.stats.nbytes = self.stats.nbytes, 0
        self._root = _Node(-1, None, (), 0, 0)
        self._snapshots = {}
        self._dropped_kv, self._dropped_snapshots, self._loads = [], [], []
        if self.disk is not None:
            self.disk.clear_staged()
        return nbytes
