"""The server benchmark, the headline: `deltaserve serve` at its default config vs
`mlx_lm.server`, one after the other on one machine and one checkpoint.

CPU (both servers get a float32 copy of the checkpoint, OpenBLAS preloaded):

    python -m bench.serve --checkpoint small --clients 1 4 --requests-per-client 1 --max-tokens 32

GPU (mlx's default device is the GPU: both serve the checkpoint as it is, bf16 or
quantized; server wheels unpacked into /tmp/site as in ../shared/GPU.md):

    export PYTHONPATH=/tmp/site:$PWD DELTASERVE_TEST_CACHE=/tmp/ckpt
    python3 -m bench.serve --checkpoint 0.8B --log-dir $OUT/serve-0.8B --plot $OUT/serve-0.8B.png
    python3 -m bench.serve --checkpoint 9B --log-dir $OUT/serve-9B --plot $OUT/serve-9B.png

deltaserve gets only --model and --port (and --max-num-seqs when more clients than its
default of rows run at once; the `config` line says so), so it reads ./config.yaml like
a user's server; `--extra-args` adds flags. mlx_lm.server gets `--decode-concurrency C
--prompt-concurrency 8`, C the most clients. Each server is warmed up with one short
request, then per client count: every client sends `--requests-per-client` streaming
chats one after the other (greedy, thinking off, prompts of 32-400 words drawn with a
fixed seed, `--max-tokens` new tokens; with `--chat` they are the turns of one chat, each
resending the history and the answers so far, as a chat client does); client i starts at
i/C of `--ramp-s`, so requests arrive while others decode. deltaserve ignores EOS
(`ignore_eos`); mlx_lm.server has no such field, and its one way to force the length, a
`logit_bias` on the EOS ids (`--peer-eos-bias`), puts every row through its per-row
logits-processor path. So tok/s counts the completion tokens each server reports, and
`short` counts requests that stopped before `--max-tokens`.

Prints a `config` line, then one JSON line per (server, clients): tok/s (completion
tokens / wall of the phase), TTFT p50/p99, the gap between a stream's text chunks
p50/p99, failures and the first error, the text chunks a second while at least 90% of
the clients streamed at once (the phase's steady state, which `bench.gpu` measures
in-process; a chunk is a token unless a server merges them), and for deltaserve what
its engine did in the phase (`steps`, from /metrics before and after: each kind of
step's count, mean and those over 0.1 / 0.25 s, steps that traced a compiled shape,
full GC collections), so a p99 gap says where it came from; per server its exit code
after SIGINT and whether its log has "terminate called"; the ratios ours/peer per client
count; then markdown tables. Each phase's chunk arrival times (Unix seconds, a stream a
line) go to `<log-dir>/<server>_streams_<clients>.jsonl`: `bench.step_log --streams`
sets a stream's long gaps beside the steps the server logged in them.

`--inproc` then runs `bench.gpu`'s engine in-process (a process of its own, after the
servers stopped) at B = each client count with the phase's median prompt tokens, and
prints the server's tok/s as a share of it (issue 30 asks >= 80% at 64 clients). With
`--ramp-s 0 --requests-per-client 1 --prompt-words N` the server serves the in-process
run's workload (every row at once, one prompt length), so the share is what HTTP and the
server cost; with the headline's workload it also holds the ramp and the tail.

On a GPU each server first serves an unmeasured warm-up phase (`--warm-up-clients`: the
most clients, one chat each of other prompts, WARM_UP_TOKENS tokens): MLX builds each
kernel (NVRTC on CUDA) the first time a shape needs it, and a fresh machine's first
phase measured that instead of serving (H100, 0.8B, a fresh machine: single steps of 4-18
s in the first 16-client phase, none in the 64-client phase after it). A server that has
run a while has them; the warm-up gives both servers that state. The CPU has no such
cost by default, so there it is off.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_vs_mlxlm import (
    WORDS,
    _f32_copy,
    _free_port,
    _one,
    _pct,
    _stop,
    _wait_ready,
    launch,
    served_name,
    server_command,
)
from deltaserve.engine.api import HOST_PARTS

SERVERS = ("deltaserve", "mlx_lm")
FULL_SHARE = 0.9  # of the clients streaming at once: the phase's steady state
FULL_MIN_S = 0.5  # seconds of it, at least, for a rate
Row = dict[str, Any]


def _checkpoint(name: str, dtype: str) -> tuple[Path, bool]:
    """The directory both servers load, and whether they run on the CPU: there a
    float32 copy (mlx-lm computes in the checkpoint's dtype, we in float32 on the CPU)."""
    import mlx.core as mx

    from deltaserve.models.testing import cached_checkpoint

    src = Path(name) if "/" in name or Path(name).is_dir() else cached_checkpoint(name)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    use_f32 = dtype == "float32" or (dtype == "auto" and on_cpu)
    return (_f32_copy(src) if use_f32 else src), on_cpu


def _eos_ids(model: Path) -> list[int]:
    """EOS token ids from config.json (or its text_config) and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        for value in (
            config.get("eos_token_id"),
            config.get("text_config", {}).get("eos_token_id"),
        ):
            ids.update([value] if isinstance(value, int) else value or [])
    return sorted(ids)


def _request_fields(kind: str, model: Path, peer_eos_bias: bool) -> dict:
    """Body fields beside the prompt: usage in the stream, thinking off, and what keeps a
    request going to max_tokens where the server has it."""
    fields: dict = {
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if kind == "deltaserve":
        fields["ignore_eos"] = True
    elif peer_eos_bias:
        fields["logit_bias"] = {str(i): -1e9 for i in _eos_ids(model)}
    return fields


def _commands(model: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    """Both servers' command lines, each on a free port."""
    from deltaserve.engine.config import EngineConfig

    rows = max(args.clients)
    ours_rows = rows if rows > EngineConfig.max_num_seqs else None
    ours_extra = tuple(shlex.split(args.extra_args))
    peer_extra = ("--decode-concurrency", str(rows), "--prompt-concurrency", "8")
    return {
        "deltaserve": server_command(
            "deltaserve", model, _free_port(), None, ours_extra, ours_rows
        ),
        "mlx_lm": server_command("mlx_lm", model, _free_port(), None, peer_extra),
    }


WARM_UP_TOKENS = 16  # each warm-up chat's completion: its decode shapes, not a phase's


def _prompts(
    clients: int, per_client: int, seed: str = "serve", words: int | None = None
) -> list[list[str]]:
    """Each client's prompts, 32-400 words (`words` each when given); the same for both
    servers."""
    rng = random.Random(f"{seed}-{clients}")
    return [
        [" ".join(rng.choices(WORDS, k=words or rng.randint(32, 400))) for _ in range(per_client)]
        for _ in range(clients)
    ]


async def _phase(
    base: str,
    model: str,
    clients: int,
    fields: dict,
    args: argparse.Namespace,
    warm_up: bool = False,
    streams: Path | None = None,
) -> Row:
    """Every client's chats, client i starting at i/clients of the ramp; the summary.
    warm_up: one chat per client, other prompts, WARM_UP_TOKENS each (`_measure`).
    streams: where to write each stream's chunk times as Unix seconds, one JSON list a
    line, for `bench.step_log --streams` to set beside the server's steps."""
    chats = 1 if warm_up else args.requests_per_client  # per client
    max_tokens = WARM_UP_TOKENS if warm_up else args.max_tokens
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:

        async def run(i: int, prompts: list[str]) -> list[dict]:
            await asyncio.sleep(args.ramp_s * i / clients)
            results, history = [], []
            for p in prompts:
                messages = [*history, {"role": "user", "content": p}]
                extra = {**fields, "messages": messages} if args.chat else fields
                result = await _one(client, base, model, p, max_tokens, extra)
                results.append(result)
                answer = result.get("text", "")
                history = [*messages, {"role": "assistant", "content": answer}]
            return results

        start = time.perf_counter()
        prompts = _prompts(clients, chats, "warm" if warm_up else "serve", args.prompt_words)
        per_client = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    results = [r for rs in per_client for r in rs]
    ok = [r for r in results if r["ok"]]
    if streams is not None:
        epoch = time.time() - time.perf_counter()  # the server log's clock
        streams.write_text("".join(json.dumps([epoch + t for t in r["stamps"]]) + "\n" for r in ok))
    errors = [r["error"] for r in results if not r["ok"]]
    ttft = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    full_s, full_chunks = _at_full_concurrency([r["stamps"] for r in ok], clients)
    return {
        "clients": clients,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "chunks": sum(r["chunks"] for r in ok),  # the gaps are between these
        "short": sum(r["tokens"] < max_tokens for r in ok),
        "prompt_tokens_p50": int(_pct(prompt_tokens, 0.5)) if prompt_tokens else None,
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_s": round(_pct(ttft, 0.5), 4),
        "ttft_p99_s": round(_pct(ttft, 0.99), 4),
        "gap_p50_ms": round(1e3 * _pct(gaps, 0.5), 2),
        "gap_p99_ms": round(1e3 * _pct(gaps, 0.99), 2),
        # chunks a second while >= 90% of the clients streamed (bench.gpu's steady state)
        "full_s": round(full_s, 3),
        "full_chunks_s": round(full_chunks / full_s, 2) if full_s >= FULL_MIN_S else None,
        "failures": len(errors),
        "first_error": errors[0] if errors else None,
    }


def _at_full_concurrency(streams: list[list[float]], clients: int) -> tuple[float, int]:
    """(seconds, text chunks in them) while at least FULL_SHARE of the clients had a
    stream between its first and last chunk: the phase's steady state, every row
    decoding, which `bench.gpu` measures in-process (issue 30 compares the two), without
    the ramp, the prefill waves and the tail."""
    need = max(1, math.ceil(FULL_SHARE * clients))
    events = sorted((t, d) for st in streams for t, d in ((st[0], 1), (st[-1], -1)))
    spans, live, since = [], 0, 0.0
    for t, d in events:
        was_full = live >= need
        live += d
        if live >= need and not was_full:
            since = t
        elif was_full and live < need:
            spans.append((since, t))
    seconds = sum(b - a for a, b in spans)
    chunks = sum(
        bisect.bisect_right(st, b) - bisect.bisect_left(st, a) for st in streams for a, b in spans
    )
    return seconds, chunks


async def _measure(
    kind: str,
    model: Path,
    base: str,
    proc: subprocess.Popen,
    args: argparse.Namespace,
    rows: list[Row],
) -> None:
    """Wait for the server, warm it up, then append one row per client count to `rows`."""
    await _wait_ready(base, proc, args.start_timeout_s)
    name = await served_name(kind, base, model)
    fields = _request_fields(kind, model, args.peer_eos_bias)
    async with httpx.AsyncClient() as client:
        warm = await _one(client, base, name, "Say hello.", 8, fields)
    if not warm["ok"]:
        print(json.dumps({"server": kind, "warmup_error": warm["error"]}), flush=True)
    if args.warm_up_clients:
        row = await _phase(base, name, args.warm_up_clients, fields, args, warm_up=True)
        print(json.dumps({"server": kind, "warm_up": True, **row}), flush=True)
    for clients in args.clients:
        before = await _engine_counts(kind, base)
        streams = args.log_dir / f"{kind}_streams_{clients}.jsonl"
        row = {"server": kind, **await _phase(base, name, clients, fields, args, streams=streams)}
        if before is not None:
            row["steps"] = _steps_between(before, await _engine_counts(kind, base))
        print(json.dumps(row), flush=True)
        rows.append(row)


async def _engine_counts(kind: str, base: str) -> dict[tuple[str, str], float] | None:
    """deltaserve's step-time histogram, traced steps and GC pauses from /metrics, as
    {(sample name, label value): value}; None for the peer (it has no such metrics)."""
    if kind != "deltaserve":
        return None
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base}/metrics", timeout=30)).text
    wanted = (
        "deltaserve_step_seconds",
        "deltaserve_step_host_seconds",
        "deltaserve_step_host_part_seconds",
        "deltaserve_traced_steps",
        "deltaserve_gc_pause_seconds",
    )
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            for sample in family.samples:
                label = sample.labels.get("kind", sample.labels.get("generation", ""))
                if "part" in sample.labels:
                    label += ":" + sample.labels["part"]
                le = sample.labels.get("le", "")
                counts[(sample.name, f"{label}/{le}")] = sample.value
    return counts


def _steps_between(before: dict, after: dict) -> dict:
    """What deltaserve's engine did during one phase (from two /metrics scrapes): per kind
    of step its count, mean and how many took over 0.1 / 0.25 s (a stall of every
    stream); steps that traced a compiled shape; full (generation 2) GC collections."""

    def delta(name: str, label: str) -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    out: dict = {}
    for kind in ("decode", "mixed", "prefill", "verify"):
        n = delta("deltaserve_step_seconds_count", f"{kind}/")
        if not n:
            continue
        seconds = delta("deltaserve_step_seconds_sum", f"{kind}/")
        out[kind] = {
            "n": int(n),
            "mean_ms": round(1e3 * seconds / n, 2),
            "host_ms": round(1e3 * delta("deltaserve_step_host_seconds_total", f"{kind}/") / n, 2),
            "host_parts_ms": {
                part: round(
                    1e3 * delta("deltaserve_step_host_part_seconds_total", f"{kind}:{part}/") / n, 2
                )
                for part in HOST_PARTS
            },
            "over_100ms": int(n - delta("deltaserve_step_seconds_bucket", f"{kind}/0.1")),
            "over_250ms": int(n - delta("deltaserve_step_seconds_bucket", f"{kind}/0.25")),
        }
    out["traced"] = int(delta("deltaserve_traced_steps_total", "/"))
    out["gc_full"] = int(delta("deltaserve_gc_pause_seconds_count", "2/"))
    out["gc_full_s"] = round(delta("deltaserve_gc_pause_seconds_sum", "2/"), 4)
    return out


def _bench(
    kind: str, model: Path, cmd: list[str], args: argparse.Namespace
) -> tuple[list[Row], Row]:
    """Start one server, measure every client count, stop it with SIGINT: its rows and
    its `stopped` line (exit code, "terminate called" in its log, a start or run error)."""
    port = int(cmd[cmd.index("--port") + 1])
    log = args.log_dir / f"{kind}.log"
    proc = launch(cmd, log, preload_blas=args.on_cpu)
    rows: list[Row] = []
    error = None
    try:
        asyncio.run(_measure(kind, model, f"http://127.0.0.1:{port}", proc, args, rows))
    except Exception as exc:  # a server that failed: report it, keep its rows, run the other
        error = f"{type(exc).__name__}: {exc}"
    finally:
        exit_code = proc.returncode if proc.poll() is not None else _stop(proc, signal.SIGINT, 60)
    stopped = {
        "server": kind,
        "stopped": True,
        "exit_code": exit_code,
        "terminate_called": "terminate called" in log.read_text(errors="replace"),
        "error": error,
        "log": str(log),
    }
    print(json.dumps(stopped), flush=True)
    return rows, stopped


def _inproc(model: Path, rows: list[Row], args: argparse.Namespace) -> list[Row]:
    """`bench.gpu`'s in-process engine, in a process of its own after the servers stopped,
    at B = each client count deltaserve served, with that phase's median prompt tokens
    and --max-tokens each: the server's tok/s as a share of its tok/s (issue 30 asks >=
    80% at 64 clients), and the server's steady chunks/s as a share of its decode rate.
    With --ramp-s 0 --requests-per-client 1 --prompt-words N the server's phase is the
    in-process run's workload (all rows at once, one length), so the share is what HTTP
    and the server cost; with the headline's workload it also holds the ramp and the tail."""
    out = []
    for row in sorted((r for r in rows if r["server"] == "deltaserve"), key=lambda r: r["clients"]):
        clients, prompt = row["clients"], row["prompt_tokens_p50"] or 128
        stem = args.log_dir / f"inproc_{clients}"
        cmd = [sys.executable, "-m", "bench.gpu", "--shape", str(model), "--batches"]
        cmd += [str(clients), "--prompt", str(prompt), "--gen", str(args.max_tokens)]
        cmd += ["--only", "deltaserve", "--no-check", "--out", f"{stem}.jsonl"]
        code = launch(cmd, stem.with_suffix(".log"), preload_blas=args.on_cpu).wait()
        runs = []
        if code == 0:
            lines = Path(f"{stem}.jsonl").read_text().splitlines()
            runs = [r for r in map(json.loads, lines) if r.get("impl") == "deltaserve"]
        if not runs:
            tail = stem.with_suffix(".log").read_text(errors="replace")[-300:]
            out.append({"inproc": True, "clients": clients, "error": f"exit {code}: {tail}"})
            continue
        run = runs[0]
        steady = row.get("full_chunks_s")
        ceiling = schedule_ceiling(
            clients, args.ramp_s, args.requests_per_client, args.max_tokens, run["decode_tok_s"]
        )
        out.append(
            {
                "inproc": True,
                "clients": clients,
                "prompt_tokens": prompt,
                "inproc_tok_s": round(run["tok_s"], 2),
                "inproc_decode_tok_s": round(run["decode_tok_s"], 2),
                # bench.gpu's runs to a measured run that traced nothing, and what it traced
                "inproc_runs": run.get("runs"),
                "inproc_traced": run.get("traced"),
                "server_tok_s": row["tok_s"],
                "share": round(row["tok_s"] / run["tok_s"], 3),
                "steady_share": round(steady / run["decode_tok_s"], 3) if steady else None,
                "schedule_tok_s": round(ceiling, 2),
                "schedule_share": round(ceiling / run["tok_s"], 3),
            }
        )
    return out


def schedule_ceiling(
    clients: int, ramp_s: float, requests_per_client: int, max_tokens: int, decode_tok_s: float
) -> float:
    """The most tok/s a phase's arrival schedule allows a server whose rows decode at
    `decode_tok_s` / clients tokens a second each (the in-process run's decode rate):
    the last client starts ramp_s x (clients - 1) / clients in and sends its requests one
    after another, each at least max_tokens steps, so the phase lasts at least that long
    whatever the prefill costs. Against the in-process figure (all rows at once, one
    request each) it says how much of the share the workload itself leaves."""
    per_request = max_tokens * clients / decode_tok_s
    wall = ramp_s * (clients - 1) / clients + requests_per_client * per_request
    return clients * requests_per_client * max_tokens / wall


def _ratios(rows: list[Row]) -> list[Row]:
    """ours/peer per client count run by both (tok/s: higher is better; the rest lower)."""
    by = {(r["server"], r["clients"]): r for r in rows}
    out = []
    for clients in sorted({r["clients"] for r in rows}):
        ours, peer = by.get(("deltaserve", clients)), by.get(("mlx_lm", clients))
        if ours is None or peer is None:
            continue
        ratio = {"clients": clients}
        for key in ("tok_s", "ttft_p50_s", "gap_p99_ms"):
            ratio[f"ratio_{key}"] = round(ours[key] / peer[key], 3) if peer[key] else None
        out.append(ratio)
    return out


def _table(
    rows: list[Row], ratios: list[Row], stopped: list[Row], max_tokens: int, inproc: list[Row]
) -> str:
    head = "| clients | server | tok/s | TTFT p50 s | TTFT p99 s | gap p50 ms | gap p99 ms |"
    lines = [
        head + f" tokens (short of {max_tokens}) | failures | chunks/s at >= 90% streaming |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["clients"], r["server"])):
        full = r.get("full_chunks_s")
        steady = f"{full:.1f} ({r['full_s']:.1f} s)" if full is not None else "n/a"
        lines.append(
            f"| {r['clients']} | {r['server']} | {r['tok_s']:.1f} | {r['ttft_p50_s']:.3f}"
            f" | {r['ttft_p99_s']:.3f} | {r['gap_p50_ms']:.1f} | {r['gap_p99_ms']:.1f}"
            f" | {r['completion_tokens']} ({r['short']}) | {r['failures']} | {steady} |"
        )
    if ratios:
        lines += ["", "| clients | tok/s ours/peer | TTFT p50 ours/peer | gap p99 ours/peer |"]
        lines.append("|---|---|---|---|")
        for r in ratios:
            cells = [r["ratio_tok_s"], r["ratio_ttft_p50_s"], r["ratio_gap_p99_ms"]]
            text = ["n/a" if c is None else f"{c:.2f}x" for c in cells]
            lines.append(f"| {r['clients']} | " + " | ".join(text) + " |")
    if inproc:
        lines += [
            "",
            "deltaserve against its engine in-process (bench.gpu, B = clients, the phase's "
            "median prompt tokens)",
            "",
            "| clients | prompt tokens | server tok/s | in-process tok/s | share "
            "| steady chunks/s share of in-process decode | the arrival schedule's ceiling "
            "(share) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in inproc:
            if "error" in r:
                lines.append(f"| {r['clients']} | in-process run failed: {r['error']!r} |")
                continue
            steady = "n/a" if r["steady_share"] is None else f"{100 * r['steady_share']:.0f}%"
            ceiling = f"{r['schedule_tok_s']:.1f} ({100 * r['schedule_share']:.0f}%)"
            lines.append(
                f"| {r['clients']} | {r['prompt_tokens']} | {r['server_tok_s']:.1f}"
                f" | {r['inproc_tok_s']:.1f} | {100 * r['share']:.0f}% | {steady} | {ceiling} |"
            )
    steps = [r for r in sorted(rows, key=lambda r: r["clients"]) if "steps" in r]
    if steps:
        lines += [
            "",
            "deltaserve's engine steps in each phase (/metrics): count, mean (of it the engine "
            "thread's own time), over 0.1 / 0.25 s",
            "",
            "| clients | decode | mixed | prefill | verify | traced | full GCs |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            st = r["steps"]
            cells = [
                f"{st[k]['n']}, {st[k]['mean_ms']:.1f} ms ({st[k]['host_ms']:.1f}), "
                f"{st[k]['over_100ms']} / "
                f"{st[k]['over_250ms']}"
                if k in st
                else "0"
                for k in ("decode", "mixed", "prefill", "verify")
            ]
            gc = f"{st['gc_full']} ({st['gc_full_s']:.3f} s)"
            lines.append(f"| {r['clients']} | " + " | ".join(cells) + f" | {st['traced']} | {gc} |")
        lines += [
            "",
            "where a step's host time went, ms a step: " + " / ".join(HOST_PARTS),
            "",
            "| clients | decode | mixed |",
            "|---|---|---|",
        ]
        for r in steps:
            st = r["steps"]
            cells = [
                " / ".join(f"{st[k]['host_parts_ms'][p]:.1f}" for p in HOST_PARTS)
                if k in st
                else "-"
                for k in ("decode", "mixed")
            ]
            lines.append(f"| {r['clients']} | " + " | ".join(cells) + " |")
    lines.append("")
    for s in stopped:
        said = "yes" if s["terminate_called"] else "no"
        error = f", error: {s['error']}" if s["error"] else ""
        lines.append(
            f"- {s['server']}: exit code {s['exit_code']}, 'terminate called': {said}{error}"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path, title: str) -> None:
    """tok/s and TTFT p50 against clients, one line per server (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {path}: matplotlib is not importable (pip install matplotlib); no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    metrics = (("tok_s", "tok/s"), ("ttft_p50_s", "TTFT p50 (s)"))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for kind in SERVERS:
            mine = sorted((r for r in rows if r["server"] == kind), key=lambda r: r["clients"])
            if mine:
                ax.plot(
                    [r["clients"] for r in mine], [r[key] for r in mine], marker="o", label=kind
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients (streaming chats)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _replot(log: Path, path: Path) -> None:
    """--plot from a run's printed JSON lines (its rows and its config line)."""
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    records = [json.loads(ln) for ln in lines]
    rows = [r for r in records if "server" in r and "tok_s" in r and not r.get("warm_up")]
    model = next((Path(r["model"]).name for r in records if r.get("config")), log.stem)
    _plot(rows, path, f"{model}: deltaserve (default config) vs mlx_lm.server")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint", default="small", help="deltaserve.models.testing name, or a path"
    )
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ramp-s", type=float, default=2.0, help="clients start over this")
    ap.add_argument(
        "--prompt-words",
        type=int,
        default=None,
        help="every prompt this many words (default: 32-400 words, drawn)",
    )
    ap.add_argument(
        "--inproc",
        action="store_true",
        help="then run bench.gpu's engine in-process at B = each client count (the phase's "
        "median prompt tokens) and print the server's tok/s as a share of it",
    )
    ap.add_argument(
        "--chat",
        action="store_true",
        help="each client's requests are the turns of one chat (each resends the history "
        "and the answers so far): a prefix cache's next-turn path under load",
    )
    ap.add_argument("--only", choices=SERVERS, default=None)
    ap.add_argument("--extra-args", default="", help="more deltaserve flags, one string")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "checkpoint"],
        default="auto",
        help="auto: a float32 copy on the CPU, the checkpoint as is on the GPU",
    )
    ap.add_argument(
        "--peer-eos-bias",
        action="store_true",
        help="force mlx_lm.server's length with a logit_bias on the EOS ids (slows its rows)",
    )
    ap.add_argument(
        "--warm-up-clients",
        type=int,
        default=None,
        help="before the measured phases, each server serves this many clients one short "
        "chat each, not measured (default: the most --clients on a GPU, 0 on the CPU)",
    )
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tok/s and TTFT vs clients")
    ap.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="only draw --plot from an earlier run's printed output (a machine without "
        "matplotlib ran it: the lent GPU)",
    )
    args = ap.parse_args()
    if args.replot is not None:
        _replot(args.replot, args.plot or args.replot.with_suffix(".png"))
        return
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model, args.on_cpu = _checkpoint(args.checkpoint, args.dtype)
    if args.warm_up_clients is None:
        args.warm_up_clients = 0 if args.on_cpu else max(args.clients)
    commands = _commands(model, args)
    kinds = [k for k in SERVERS if args.only in (None, k)]
    ours = commands["deltaserve"]
    config = {
        "config": True,
        "model": str(model),
        "on_cpu": args.on_cpu,
        "log_dir": str(args.log_dir),
        "chat": args.chat,
        "warm_up_clients": args.warm_up_clients,
        "deltaserve_flags_beyond_model_port": ours[ours.index("--port") + 2 :],
        "commands": {k: commands[k] for k in kinds},
    }
    print(json.dumps(config), flush=True)
    rows: list[Row] = []
    stopped: list[Row] = []
    for kind in kinds:
        server_rows, server_stopped = _bench(kind, model, commands[kind], args)
        rows += server_rows
        stopped.append(server_stopped)
    ratios = _ratios(rows)
    for ratio in ratios:
        print(json.dumps({"ratio": True, **ratio}), flush=True)
    inproc = _inproc(model, rows, args) if args.inproc else []
    for line in inproc:
        print(json.dumps(line), flush=True)
    print()
    print(_table(rows, ratios, stopped, args.max_tokens, inproc))
    flags = " ".join(config["deltaserve_flags_beyond_model_port"]) or "none"
    print(f"- deltaserve flags beyond --model/--port: {flags}")
    if args.plot is not None:
        _plot(rows, args.plot, f"{model.name}: deltaserve (default config) vs mlx_lm.server")


if __name__ == "__main__":
    main()
