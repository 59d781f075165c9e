"""The prefix cache's disk tier: cached nodes' arrays in files that a restarted server reads.

Write-through: every node the memory tier stores (a KV block, a snapshot) is also written
here, once, off the step loop. Writing at eviction instead would miss what is still in
memory when the server stops (the blocks a live prefix shares are never evicted), and the
arrays of a save are copied to host one flush later anyway (PrefixStore.write_back).

A node is keyed by its token-prefix hash chain (PrefixIndex: sha256 of the parent's key
and the block's tokens), one file per node and kind (`<key>.kv`, `<key>.snap`) under a
subdirectory named by the checkpoint's identity, dtype, KV store and block size
(`checkpoint_identity`): another model or setting never reads them. `index.json` lists
the files with their sha256, size and last use; a file is written to a temporary name and
renamed, the index likewise, so a crash leaves at worst files the index does not list
(removed at start). A file whose checksum does not match is skipped with a warning and
removed, never served. The directory is held under `max_bytes`, least recently used first.
Any OSError turns the tier off (memory only) with a warning.

Threads: the engine thread looks up, reads and queues writes (numpy arrays, already
copied to host); one writer thread writes files, evicts and rewrites the index. The
index dict is shared under a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
INDEX = "index.json"
_HEADER = struct.Struct("<Q")  # byte length of the JSON header that follows
MAX_QUEUED = 1024  # host copies waiting for the writer; more are not written (slow disk)


@dataclass(frozen=True)
class DiskNode:
    """Where a node sits in the trie, as the disk index keeps it. Written by PrefixIndex."""

    key: str  # hash chain of the tokens from the root to the node's end
    parent: str  # the parent's key ("" = the root)
    start: int  # prompt position of its first token
    end: int


def node_key(parent: str, tokens: tuple[int, ...]) -> str:
    """The hash chain: a node's key from its parent's key and its block's tokens."""
    data = parent.encode() + np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def checkpoint_identity(path: Path, dtype: str, settings: str) -> str:
    """A name for what the cached arrays depend on: config.json, the weight files' names,
    sizes and mtimes, the compute dtype and `settings` (KV store, block size)."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors*")):
        st = file.stat()
        digest.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    digest.update(f"{dtype};{settings}".encode())
    return digest.hexdigest()[:16]


def encode(arrays: list[np.ndarray], dtypes: list[str]) -> bytes:
    """One file's bytes: a length-prefixed JSON header (dtype and shape of each array),
    then the arrays' raw bytes."""
    pairs = zip(arrays, dtypes, strict=True)
    meta = [{"dtype": d, "np": a.dtype.str, "shape": a.shape} for a, d in pairs]
    header = json.dumps(meta).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return _HEADER.pack(len(header)) + header + body


def decode(data: bytes) -> tuple[list[np.ndarray], list[str]]:
    (size,) = _HEADER.unpack_from(data)
    meta = json.loads(data[_HEADER.size : _HEADER.size + size])
    offset, arrays = _HEADER.size + size, []
    for m in meta:
        dtype = np.dtype(m["np"])
        count = int(np.prod(m["shape"], dtype=np.int64))
        a = np.frombuffer(data, dtype, count, offset).reshape(m["shape"])
        arrays.append(a)
        offset += count * dtype.itemsize
    return arrays, [m["dtype"] for m in meta]


@dataclass
class _Entry:
    node: DiskNode
    kind: str  # "kv" or "snap"
    sha256: str
    nbytes: int
    used: float


class PrefixDisk:
    """The directory's index, reads on the engine thread, writes on a writer thread."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        """Raises OSError when the directory cannot be made or written (see open)."""
        self.directory = directory
        self.max_bytes = max_bytes
        self.enabled = True
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".probe"
        probe.write_bytes(b"")
        probe.unlink()
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = self._read_index()  # file name -> entry
        self._tails: dict[str, set[int]] = {}  # parent key -> token counts of its tails
        for entry in self._entries.values():
            self._note_tail(entry.node)
        self._staged: dict[tuple[str, str], tuple[list[np.ndarray], list[str]]] = {}
        self._queue: queue.Queue[tuple[DiskNode, str, list[np.ndarray], list[str]] | None]
        self._queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    @classmethod
    def open(cls, root: str, identity: str, max_bytes: int) -> PrefixDisk | None:
        """The tier for `identity` under `root`; None (memory only) when it cannot be used."""
        try:
            return cls(Path(root) / identity, max_bytes)
        except OSError as e:
            log.warning("prefix cache disk tier is off (memory only): %s", e)
            return None

    # -- lookup and read (engine thread) ----------------------------------------------
    def has(self, key: str, kind: str) -> bool:
        return self.enabled and f"{key}.{kind}" in self._entries

    def tail_lengths(self, parent: str) -> set[int]:
        """Token counts of the tails on disk below `parent` (a copy: the writer adds)."""
        if not self.enabled:
            return set()
        with self._lock:
            return set(self._tails.get(parent, ()))

    def read(self, key: str, kind: str) -> tuple[list[np.ndarray], list[str]] | None:
        """A node's arrays and their MLX dtypes; None (with a warning, and the file
        dropped) when it is missing or its checksum does not match."""
        name = f"{key}.{kind}"
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            return None
        try:
            data = (self.directory / name).read_bytes()
        except OSError as e:
            log.warning("prefix cache file %s unreadable, skipped: %s", name, e)
            self._forget(name)
            return None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            log.warning("prefix cache file %s is corrupt (checksum), skipped", name)
            self._forget(name)
            return None
        with self._lock:
            entry.used = time.time()
        return decode(data)

    def stage(self, key: str, kind: str) -> bool:
        """Read and check a node's file now (the scheduler decides on what it finds) and
        hold its arrays until the runner takes them (take)."""
        found = self.read(key, kind)
        if found is not None:
            self._staged[(key, kind)] = found
        return found is not None

    def take(self, key: str, kind: str) -> tuple[list[np.ndarray], list[str]]:
        return self._staged.pop((key, kind))

    def clear_staged(self) -> None:
        self._staged = {}

    def _forget(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)
        self._queue.put((DiskNode("", "", 0, 0), name, [], []))  # no arrays: remove `name`

    # -- writes -------------------------------------------------------------------------
    def put(self, node: DiskNode, kind: str, arrays: list[np.ndarray], dtypes: list[str]) -> None:
        """Queue a node's host copies for writing (engine thread)."""
        if self._queue.qsize() >= MAX_QUEUED:
            log.debug("prefix cache disk writes behind: %s.%s not written", node.key, kind)
        elif self.enabled and f"{node.key}.{kind}" not in self._entries:
            self._queue.put((node, kind, arrays, dtypes))

    def close(self) -> None:
        """Write what is queued and the index, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
                if self._queue.empty():
                    self._save_index()
            except OSError as e:
                log.warning("prefix cache disk tier is off (memory only): %s", e)
                self.enabled = False
        if self.enabled:
            try:
                self._save_index()
            except OSError as e:
                log.warning("prefix cache index not written: %s", e)

    def _write(
        self, node: DiskNode, kind: str, arrays: list[np.ndarray], dtypes: list[str]
    ) -> None:
        if not arrays:  # a dropped (corrupt) file: `kind` is its name (_forget)
            (self.directory / kind).unlink(missing_ok=True)
            return
        if not self.enabled:
            return
        name = f"{node.key}.{kind}"
        data = encode(arrays, dtypes)
        self._replace(name, data)
        entry = _Entry(node, kind, hashlib.sha256(data).hexdigest(), len(data), time.time())
        with self._lock:
            self._entries[name] = entry
            self._note_tail(node)
        self._evict()

    def _note_tail(self, node: DiskNode) -> None:
        self._tails.setdefault(node.parent, set()).add(node.end - node.start)

    def _replace(self, name: str, data: bytes) -> None:
        """Write `data` to `name` atomically (a temporary file renamed over it)."""
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)

    def _evict(self) -> None:
        """Remove least recently used files until the directory fits max_bytes."""
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            victims = sorted(self._entries.items(), key=lambda item: item[1].used)
            gone = []
            for name, entry in victims:
                if total <= self.max_bytes:
                    break
                del self._entries[name]
                total -= entry.nbytes
                gone.append(name)
        for name in gone:
            (self.directory / name).unlink(missing_ok=True)

    def _save_index(self) -> None:
        with self._lock:
            entries = {
                name: {**vars(e.node), "kind": e.kind, "sha256": e.sha256,
                       "nbytes": e.nbytes, "used": e.used}
                for name, e in self._entries.items()
            }  # fmt: skip
        self._replace(INDEX, json.dumps({"version": 1, "entries": entries}).encode())

    def _read_index(self) -> dict[str, _Entry]:
        """The entries of index.json whose files are there at their size; files it does
        not list (a write the index never recorded) are removed."""
        entries: dict[str, _Entry] = {}
        try:
            raw = json.loads((self.directory / INDEX).read_text())["entries"]
        except FileNotFoundError:
            raw = {}
        except (ValueError, KeyError, TypeError) as e:
            log.warning("prefix cache index unreadable, starting empty: %s", e)
            raw = {}
        for name, e in raw.items():
            path = self.directory / name
            if not path.is_file() or path.stat().st_size != e["nbytes"]:
                continue
            node = DiskNode(e["key"], e["parent"], e["start"], e["end"])
            entries[name] = _Entry(node, e["kind"], e["sha256"], e["nbytes"], e["used"])
        for path in self.directory.iterdir():
            if path.name != INDEX and path.name not in entries:
                path.unlink(missing_ok=True)
        return entries
