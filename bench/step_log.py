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

    python -m bench.step_log SERVER_LOG --streams LOG_DIR/deltaserve_streams_16.jsonl

adds the streams' own long gaps (over `--over` x their median; the chunk times
`bench.serve --log-dir` writes) set beside the steps: how many steps the server
finished inside each gap (its scheduler line's time stamp, when the step's tokens were
published), what kind they were, and how long after the last of them the chunk reached
the client. One step inside: the gap is that step's cycle (a slow step); two or more:
the stream missed a step (a token held back, or a step its row was not in); a long lag:
the token waited on the HTTP side. Then every chunk's lag after the last step before it,
by that step's kind: whether the steps of one kind take longer to reach the clients.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from dataclasses import dataclass
from datetime import datetime
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


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Step:
    number: int
    decode_rows: int
    prompt_tokens: int
    chunks: int
    wall_ms: float
    done_s: float | None = None  # Unix time of its scheduler line: its tokens published
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
            steps[n] = Step(n, d, p, c, 1e3 * float(m.group(8)), _unix(line))
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


def _unix(line: str) -> float | None:
    """The log line's time stamp (logging's default format, this machine's local time)
    as Unix seconds, the clock `bench.serve` writes the streams' chunk times in."""
    m = _STAMP.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


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


def _after(before: Step | None, step: Step) -> str | None:
    """What came before a decode-only step (`before`: the step numbered just before it,
    None if not logged): "after a mixed step" (a new row joins), "a row gone" (a request
    ended; in a server under load its client's next one arrived) or "rows steady"; None
    for a step of another kind or without its predecessor."""
    if step.kind != "decode" or before is None or before.number != step.number - 1:
        return None
    if before.kind == "mixed":
        return "after a mixed step"
    return "a row gone" if step.decode_rows < before.decode_rows else "rows steady"


def _published(steps: list[Step]) -> tuple[list[float], list[Step]]:
    """The time-stamped steps in log order, and their scheduler lines' times (when each
    step's tokens were published)."""
    timed = [s for s in steps if s.done_s is not None]
    return [s.done_s for s in timed if s.done_s is not None], timed


def _decode_context(steps: list[Step]) -> list[str]:
    """Markdown: decode-only steps by what came before them, wall and outside time."""
    groups: dict[str, list[Step]] = {"rows steady": [], "a row gone": [], "after a mixed step": []}
    for before, step in zip(steps, steps[1:], strict=False):
        context = _after(before, step)
        if context is not None:
            groups[context].append(step)
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


def stream_gaps(steps: list[Step], streams: list[list[float]], over: float) -> list[str]:
    """Markdown: the streams' gaps over `over` x their median, grouped by how many steps
    the server finished inside each, with the kinds of those steps and the lag from the
    last one to the chunk's arrival."""
    times, done = _published(steps)
    gaps = [(a, b) for st in streams for a, b in zip(st, st[1:], strict=False)]
    if not gaps or not done:
        return ["(no stream gaps or no time-stamped steps)"]
    median = statistics.median(b - a for a, b in gaps)
    long = sorted((g for g in gaps if g[1] - g[0] > over * median), key=lambda g: g[0] - g[1])
    p99 = _percentile([b - a for a, b in gaps], 0.99)
    groups: dict[str, list[tuple[float, float, list[Step]]]] = {}
    for a, b in long:
        # a step published just before a chunk came is the step that sent it: the
        # client's clock reads the chunk a little after the server's log line
        inside = done[bisect.bisect_right(times, a) : bisect.bisect_right(times, b)]
        kinds = "+".join(s.kind for s in inside) if len(inside) <= 3 else f"{len(inside)} steps"
        groups.setdefault(f"{len(inside) if len(inside) < 3 else '3+'} / {kinds}", []).append(
            (a, b, inside)
        )
    out = [
        f"{len(long)} of {len(gaps)} stream gaps over {over:g}x their median "
        f"({1e3 * median:.1f} ms; p99 {1e3 * p99:.1f} ms), by the steps finished inside:",
        "",
        "| steps inside / kinds | gaps | gap p50 / max ms | steps' wall p50 ms | "
        "lag after the last step p50 / p90 ms | gaps over the p99 |",
        "|---|---|---|---|---|---|",
    ]
    for name, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        spans = [1e3 * (b - a) for a, b, _ in group]
        walls = [s.wall_ms for _, _, inside in group for s in inside] or [0.0]
        lags = [1e3 * (b - inside[-1].done_s) for _, b, inside in group if inside]
        lag = f"{_percentile(lags, 0.5):.1f} / {_percentile(lags, 0.9):.1f}" if lags else "-"
        out.append(
            f"| {name} | {len(group)} | {_percentile(spans, 0.5):.1f} / {max(spans):.1f} | "
            f"{_percentile(walls, 0.5):.1f} | {lag} | "
            f"{sum(b - a >= p99 for a, b, _ in group)} |"
        )
    return out


def chunk_lags(steps: list[Step], streams: list[list[float]]) -> list[str]:
    """Markdown: every chunk's lag after the last step the server finished before it
    reached the client (its scheduler line, where the step's tokens are published), by
    that step's kind, decode steps by what came before them (`_after`: after a mixed
    step, the new row joins the batch): how long a step's tokens take to reach the
    clients, for every chunk, not only the long gaps' (`stream_gaps`). A stream's first
    chunk (its first token, TTFT) is left out. A chunk that came after a later step than
    its own counts to that one: long lags are then cut short, not lost (its gap holds
    both steps)."""
    times, done = _published(steps)
    numbered = {s.number: s for s in done}
    groups: dict[str, list[float]] = {}
    for stream in streams:
        for arrival in stream[1:]:
            i = bisect.bisect_right(times, arrival)
            if not i:
                continue
            step = done[i - 1]
            context = _after(numbered.get(step.number - 1), step)
            kind = step.kind if context is None else f"decode, {context}"
            groups.setdefault(kind, []).append(1e3 * (arrival - times[i - 1]))
    if not groups:
        return ["(no chunks after a time-stamped step)"]
    out = [
        "| last step before the chunk | chunks | lag after it p50 / p90 / p99 ms |",
        "|---|---|---|",
    ]
    for kind, lags in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        quantiles = " / ".join(f"{_percentile(lags, q):.1f}" for q in (0.5, 0.9, 0.99))
        out.append(f"| {kind} | {len(lags)} | {quantiles} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="a deltaserve server log at --log-level debug")
    ap.add_argument("--over", type=float, default=3.0, help="x the median decode step")
    ap.add_argument(
        "--streams", type=Path, default=None, help="bench.serve's <server>_streams_<clients>.jsonl"
    )
    args = ap.parse_args()
    steps = parse(args.log.read_text(errors="replace").splitlines())
    if not steps:
        raise SystemExit(f"{args.log}: no step lines (was the server at --log-level debug?)")
    print("\n".join(report(steps, args.over)))
    if args.streams is not None:
        streams = [json.loads(ln) for ln in args.streams.read_text().splitlines() if ln]
        print("\n".join(["", *stream_gaps(steps, streams, args.over)]))
        print("\n".join(["", *chunk_lags(steps, streams)]))


if __name__ == "__main__":
    main()
