"""bench/node_cost.py measures what it says: each chain holds exactly its nodes of its kind."""

from __future__ import annotations

import collections
import io
import re

import mlx.core as mx
import pytest

from bench.node_cost import ROWS, WIDTH, chains

PRIMITIVE = {
    "transpose (view)": "Transpose",
    "reshape (view)": "Reshape",
    "slice (view)": "Slice",
    "add (elementwise)": "Add",
    "matmul [64, 1024] x [1024, 1024]": "Matmul",
    "compiled (8 ops fused)": "Compiled",
    "custom kernel": "CustomKernel",
}


def _labels(out: mx.array) -> collections.Counter:
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


@pytest.mark.parametrize("kind", list(chains()))
def test_each_chain_is_its_nodes_of_its_kind(kind: str) -> None:
    """A chain of n holds n primitives of its kind and nothing else; its output has the
    input's size."""
    x = mx.zeros((ROWS, WIDTH), mx.bfloat16)
    mx.eval(x)
    n = 7
    out = chains()[kind](x, n)
    labels = _labels(out)
    mine = sum(c for name, c in labels.items() if name.startswith(PRIMITIVE[kind]))
    assert mine == n, labels
    assert sum(labels.values()) == mine, labels
    assert out.size == ROWS * WIDTH
