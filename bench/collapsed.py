"""Where a sampled profile's time went: collapsed stacks (py-spy's `--format raw`, one
`frame;frame;... count` a line, outermost first) summed by function.

    python -m bench.collapsed prof.txt --top 25 [--under "ModelRunner.execute ("]

Prints two markdown tables: each function's inclusive share of the samples (a function
counted once per stack, however deep it recurs) and its self share (the innermost frame).
`--under NAME` keeps only the stacks through a frame containing NAME and reports shares of
those, so one call's children stand out (a prompt step's graph building, say). Written
here because py-spy's own outputs are a flame graph or a speedscope file, neither of which
a device call's short log can show.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# py-spy names a frame "function (path/to/file.py:line)"; the line varies inside one function
_LINE = re.compile(r":\d+\)$")


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """(frames outermost first, sample count) of each line; lines without a count skipped."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        frames = [_LINE.sub(")", frame.strip()) for frame in head.split(";") if frame.strip()]
        stacks.append((frames, int(count)))
    return stacks


def shares(
    stacks: list[tuple[list[str], int]], under: str | None = None
) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, inclusive counts, self counts) over the stacks through `under` (all if None)."""
    total, inclusive, own = 0, Counter(), Counter()
    for frames, count in stacks:
        if under is not None:
            hits = [i for i, frame in enumerate(frames) if under in frame]
            if not hits:
                continue
            frames = frames[hits[0] :]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            own[frames[-1]] += count
    return total, inclusive, own


def table(title: str, counts: Counter[str], total: int, top: int) -> str:
    """A markdown table of the `top` largest counts as shares of `total`."""
    lines = [f"| {title} | samples | share |", "|---|---|---|"]
    for frame, count in counts.most_common(top):
        lines.append(f"| {frame} | {count} | {100 * count / max(total, 1):.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--under", default=None, help="only stacks through a frame containing this")
    args = ap.parse_args()
    total, inclusive, own = shares(read_stacks(args.path), args.under)
    scope = f" under {args.under}" if args.under else ""
    print(f"{total} samples{scope}\n")
    print(table("inclusive", inclusive, total, args.top) + "\n")
    print(table("self", own, total, args.top))


if __name__ == "__main__":
    main()
