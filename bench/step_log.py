"""The engine's steps from a `deltaserve serve --log-level debug` log: which ones are slow.

    python -m bench.step_log SERVER_LOG [--over 3]

A stream's gap between tokens is the step its row was in, so the streams' p99 gap is set
by the slowest few percent of steps. The debug log says, for every step, what it held
(the scheduler's line: decode rows, prompt tokens and chunks, its wall time), which
forwards ran (the runner's line) and where its host time went (the engine's line: host
parts, the wait on the device, MLX's memory). This joins the three by step number and
prints the wall-time percentiles of decode-only and mixed steps; then the decode-only
steps by what came before them (rows steady, a row gone since the step before: a
request ended and, in a server under load, its client's next one arrived; a mixed step
before), with the time each passed outside the engine's step call (wall less host
time less the device wait: the engine thread's loop, or waiting for the GIL while the
HTTP side works); then every step over `--over` x the median decode-only step, with
what it held: the steps to look at when the p99 gap is more than 3x its p50. Stdlib
only: it runs on the GPU machine too.
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

_SCHEDULED = re.compile(
    r"scheduler: step (\d+): (\d+) decode rows, (\d+) prompt tokens in (\d+) chunks "
    r"\((\d+) later, longest (\d+)\), (\d+) tower units: ([\d.]+) s"
)
_FORWARDS = re.compile(r"runner: step (\d+) forwards: (.*)$")
_HOST = re.compile(
    r"engine: step (\d+) host ([\d.]+) ms \(schedule / build / submit / sample / update: "
    r"([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+)\), waited ([\d.]+) ms; "
    r"MLX active (\d+) MiB, cache (\d+) MiB"
)


@dataclass
class Step:
    number: int
    decode_rows: int
    prompt_tokens: int
    chunks: int
    wall_ms: float
    forwards: str = ""
    host_ms: float | None = None
    build_ms: float | None = None
    submit_ms: float | None = None
    waited_ms: float | None = None
    cache_mib: int | None = None

    @property
    def outside_ms(self) -> float | None:
        """Wall time the step's own call did not account for (host, device wait)."""
        if self.host_ms is None or self.waited_ms is None:
            return None
        return max(self.wall_ms - self.host_ms - self.waited_ms, 0.0)

    @property
    def kind(self) -> str:
        if self.prompt_tokens == 0:
            return "decode"
        return "mixed" if self.decode_rows else "prefill"


def parse(lines: list[str]) -> list[Step]:
    """The log's steps in order, each with what its three debug lines said."""
    steps: dict[int, Step] = {}
    forwards: dict[int, str] = {}
    hosts: dict[int, tuple[str, ...]] = {}
    for line in lines:
        if m := _SCHEDULED.search(line):
            n, d, p, c = (int(x) for x in m.group(1, 2, 3, 4))
            steps[n] = Step(n, d, p, c, 1e3 * float(m.group(8)))
        elif m := _FORWARDS.search(line):
            forwards[int(m.group(1))] = m.group(2).strip()
        elif m := _HOST.search(line):
            hosts[int(m.group(1))] = m.groups()[1:]
    for n, step in steps.items():
        step.forwards = forwards.get(n, "")
        if n in hosts:
            host, _, build, submit, _, _, waited, _, cache = hosts[n]
            step.host_ms, step.build_ms, step.submit_ms = float(host), float(build), float(submit)
            step.waited_ms, step.cache_mib = float(waited), int(cache)
    return [steps[n] for n in sorted(steps)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(steps: list[Step], over: float) -> list[str]:
    """Markdown: wall-time percentiles by kind, then the steps over `over` x the median
    decode-only step."""
    out = ["| kind | steps | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    for kind in ("decode", "mixed", "prefill"):
        walls = [s.wall_ms for s in steps if s.kind == kind]
        if walls:
            p50, p90, p99 = (_percentile(walls, q) for q in (0.5, 0.9, 0.99))
            out.append(
                f"| {kind} | {len(walls)} | {p50:.1f} | {p90:.1f} | {p99:.1f} | {max(walls):.1f} |"
            )
    decode = [s.wall_ms for s in steps if s.kind == "decode"]
    if not decode:
        return out
    out += ["", *_decode_context(steps)]
    bound = over * statistics.median(decode)
    slow = [s for s in steps if s.wall_ms > bound]
    out += [
        "",
        f"{len(slow)} of {len(steps)} steps over {over:g}x the median decode step "
        f"({bound:.1f} ms):",
        "",
        "| step | wall ms | decode rows | prompt tokens | chunks | host ms | build / submit | "
        "waited ms | MLX cache MiB | forwards |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in slow:
        host = f"{s.host_ms:.1f}" if s.host_ms is not None else "-"
        parts = f"{s.build_ms:.1f} / {s.submit_ms:.1f}" if s.build_ms is not None else "-"
        waited = f"{s.waited_ms:.1f}" if s.waited_ms is not None else "-"
        cache = s.cache_mib if s.cache_mib is not None else "-"
        out.append(
            f"| {s.number} | {s.wall_ms:.1f} | {s.decode_rows} | {s.prompt_tokens} | "
            f"{s.chunks} | {host} | {parts} | {waited} | {cache} | {s.forwards} |"
        )
    return out


def _decode_context(steps: list[Step]) -> list[str]:
    """Markdown: decode-only steps by what came before them, wall and outside time."""
    groups: dict[str, list[Step]] = {"rows steady": [], "a row gone": [], "after a mixed step": []}
    for before, step in zip(steps, steps[1:], strict=False):
        if step.kind != "decode" or before.number != step.number - 1:
            continue
        if before.kind == "mixed":
            groups["after a mixed step"].append(step)
        elif step.decode_rows < before.decode_rows:
            groups["a row gone"].append(step)
        else:
            groups["rows steady"].append(step)
    out = [
        "| decode steps | count | wall p50 / p90 ms | host p50 ms | waited p50 ms | "
        "outside p50 / p90 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, group in groups.items():
        timed = [s for s in group if s.outside_ms is not None]
        if not timed:
            continue
        walls = [s.wall_ms for s in timed]
        outside = [s.outside_ms for s in timed if s.outside_ms is not None]
        host = statistics.median(s.host_ms for s in timed if s.host_ms is not None)
        waited = statistics.median(s.waited_ms for s in timed if s.waited_ms is not None)
        out.append(
            f"| {name} | {len(timed)} | {_percentile(walls, 0.5):.1f} / "
            f"{_percentile(walls, 0.9):.1f} | {host:.1f} | {waited:.1f} | "
            f"{_percentile(outside, 0.5):.1f} / {_percentile(outside, 0.9):.1f} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="a deltaserve server log at --log-level debug")
    ap.add_argument("--over", type=float, default=3.0, help="x the median decode step")
    args = ap.parse_args()
    steps = parse(args.log.read_text(errors="replace").splitlines())
    if not steps:
        raise SystemExit(f"{args.log}: no step lines (was the server at --log-level debug?)")
    print("\n".join(report(steps, args.over)))


if __name__ == "__main__":
    main()
