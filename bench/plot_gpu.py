"""Plot bench/gpu.py results (JSON lines) as a PNG: tok/s and TTFT p50, ours vs mlx-lm.

    python -m bench.plot_gpu bench/results/h200_0.8B.jsonl bench/results/h200_9B.jsonl \\
        bench/results/h200_35B-A3B-4bit.jsonl \\
        --out bench/results/h200.png

Needs matplotlib (`pip install matplotlib`; not a dependency of deltaserve).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _runs(path: Path) -> tuple[str, dict[str, list[dict]]]:
    """(shape, impl -> results sorted by batch) from one bench/gpu.py --out file."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    shape = next(line["shape"] for line in lines if "shape" in line)
    runs: dict[str, list[dict]] = {}
    for line in lines:
        if "impl" in line:
            runs.setdefault(line["impl"], []).append(line)
    return shape, {impl: sorted(rows, key=lambda r: r["batch"]) for impl, rows in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(args.results), figsize=(5 * len(args.results), 7))
    axes = axes.reshape(2, -1)
    for col, path in enumerate(args.results):
        shape, runs = _runs(path)
        for row, (key, label) in enumerate((("tok_s", "tok/s"), ("ttft_p50_s", "TTFT p50 (s)"))):
            ax = axes[row, col]
            for impl, rows in runs.items():
                batches = [r["batch"] for r in rows]
                ax.plot(batches, [r[key] for r in rows], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (concurrent requests)")
            ax.set_ylabel(label)
            ax.set_title(f"{shape}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle("H200, random weights (bf16; 35B-A3B 4-bit): deltaserve vs mlx-lm BatchGenerator")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
