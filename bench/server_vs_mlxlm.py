"""Streaming chat load test: deltaserve vs mlx_lm.server on the same checkpoint and machine.

    python -m bench.server_vs_mlxlm --checkpoint small --concurrency 1 8 32 --requests 32

Both servers get the same float32 copy of the checkpoint (mlx_lm.server computes in the
checkpoint's dtype; ours computes in float32 on CPU), with OpenBLAS preloaded for both.
Clients stream chat completions (greedy, prompt 64–1,024 tokens, 64–128 new tokens) and
record TTFT, inter-token latency, output tokens and failures. Prints JSON lines and the
ratios ours/peer for each concurrency, then a 128-connection burst per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deltaserve.kernels.cpu.blas import openblas_path

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "music",
    "paper",
    "light",
    "green",
    "quiet",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _f32_copy(src: Path) -> Path:
    """The checkpoint with float32 tensors (same values), for both servers."""
    import mlx.core as mx

    dst = src.parent / f"{src.name}-f32"
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = mx.load(str(f))
            floats = {
                k: v.astype(mx.float32) if v.dtype == mx.bfloat16 else v for k, v in tensors.items()
            }
            mx.save_safetensors(str(tmp / f.name), floats, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def server_command(
    kind: str,
    model: Path,
    port: int,
    log_level: str | None = "warning",
    extra: tuple[str, ...] = (),
    max_num_seqs: int | None = 64,
) -> list[str]:
    """The command line of one server. `log_level` None leaves each server at its own
    default; ours gets `--max-num-seqs` unless None, then `extra` after its own
    arguments; mlx_lm.server gets `extra` too."""
    if kind == "deltaserve":
        cmd = [sys.executable, "-m", "deltaserve.server.cli", "serve", "--model", str(model)]
        cmd += ["--port", str(port)]
        if max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        if log_level is not None:
            cmd += ["--log-level", log_level]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
        cmd += ["--port", str(port)]
        if log_level is not None:
            cmd += ["--log-level", log_level.upper()]
    return [*cmd, *extra]


def launch(cmd: list[str], log: Path, preload_blas: bool = True) -> subprocess.Popen:
    """Start a server command, stdout and stderr into `log`; OpenBLAS preloaded (the
    CPU's BLAS) when asked and found."""
    env = dict(os.environ)
    lib = openblas_path() if preload_blas else None
    if lib is not None:
        env["LD_PRELOAD"] = str(lib)
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _start(
    kind: str,
    model: Path,
    port: int,
    log: Path,
    log_level: str = "warning",
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start one server with OpenBLAS preloaded; ours logs at `log_level` (debug: each
    step's size and time), runs 64 rows and gets `extra` arguments after its own."""
    if kind == "deltaserve":
        return launch(server_command(kind, model, port, log_level, extra), log)
    return launch(server_command(kind, model, port, "warning"), log)


async def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if (await client.get(f"{base}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError("server did not become ready")


async def served_name(kind: str, base: str, model: Path) -> str:
    """The model name requests must carry: ours lists it; mlx_lm.server lists hub-cache
    models, not the one it serves, so that one is named by its path."""
    if kind != "deltaserve":
        return str(model)
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]


def _workload(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.randint(64, 1024) * 3 // 4  # ~0.75 words per token of these words
        out.append((" ".join(rng.choice(WORDS) for _ in range(words)), rng.randint(64, 128)))
    return out


async def _one(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    extra: dict | None = None,
) -> dict:
    """One streamed chat (greedy; `extra` fields added to the body): TTFT, the gaps
    between chunks that carry text, and its tokens: the usage's completion_tokens when
    the server reports them (`stream_options.include_usage`), else the chunks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        **(extra or {}),
    }
    start = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    usage_tokens = prompt_tokens = None
    try:
        async with client.stream(
            "POST", f"{base}/v1/chat/completions", json=body, timeout=600
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                return {"ok": False, "error": f"HTTP {r.status_code}: {text}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": f"stream error: {chunk['error']}"[:300]}
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                    prompt_tokens = chunk["usage"].get("prompt_tokens")
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    ):
                        stamps.append(time.perf_counter())
                        pieces.append(delta.get("content") or "")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if not stamps:
        return {"ok": False, "error": "no tokens"}
    return {
        "ok": True,
        "ttft": stamps[0] - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": len(stamps) if usage_tokens is None else usage_tokens,
        "chunks": len(stamps),
        "prompt_tokens": prompt_tokens,  # the usage's, None where the server reports none
        "stamps": stamps,  # when each text chunk came (time.perf_counter)
        "text": "".join(pieces),  # the answer (content only)
    }


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _load(base: str, model: str, concurrency: int, requests: int) -> dict:
    work = _workload(requests, seed=concurrency)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(limits=limits) as client:

        async def run(item: tuple[str, int]) -> dict:
            async with sem:
                return await _one(client, base, model, *item)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(w) for w in work))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "failed": len(results) - len(ok),
        "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * _pct(itl, 0.5),
        "itl_p99_ms": 1e3 * _pct(itl, 0.99),
        "errors": sorted({r["error"] for r in results if not r["ok"]}),
    }


async def _bench(kind: str, model: Path, args: argparse.Namespace) -> list[dict]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(kind, model, port, Path(args.logdir) / f"{kind}.log")
    try:
        await _wait_ready(base, proc)
        served = await served_name(kind, base, model)
        await _load(base, served, 2, 2)  # warm-up
        rows = []
        for conc in args.concurrency:
            row = {"impl": kind, **await _load(base, served, conc, max(args.requests, conc))}
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.burst:
            row = {"impl": kind, "burst": True, **await _load(base, served, args.burst, args.burst)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30) -> int:
    """Send `sig`, then SIGKILL after `wait_s` seconds: a server left behind would share
    the cores with the next benchmark. Returns the exit code (negative: killed by that
    signal)."""
    proc.send_signal(sig)
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument(
        "--burst", type=int, default=128, help="connections in the burst test (0: skip)"
    )
    ap.add_argument("--only", choices=["deltaserve", "mlx_lm"], default=None)
    ap.add_argument("--logdir", default="/tmp")
    args = ap.parse_args()
    from deltaserve.models.testing import cached_checkpoint

    src = Path(args.checkpoint) if "/" in args.checkpoint else cached_checkpoint(args.checkpoint)
    model = _f32_copy(src)
    results = {}
    for kind in ("deltaserve", "mlx_lm"):
        if args.only in (None, kind):
            results[kind] = asyncio.run(_bench(kind, model, args))
    if len(results) == 2:
        for ours, peer in zip(results["deltaserve"], results["mlx_lm"], strict=True):
            print(
                json.dumps(
                    {
                        "concurrency": ours["concurrency"],
                        "burst": ours.get("burst", False),
                        "ratio_output_tok_s": ours["output_tok_s"] / peer["output_tok_s"],
                        "ratio_ttft_p50": ours["ttft_p50_s"] / peer["ttft_p50_s"],
                        "failed_ours": ours["failed"],
                        "failed_peer": peer["failed"],
                    }
                )
            )


if __name__ == "__main__":
    main()
