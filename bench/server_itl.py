"""Stream stalls over HTTP while a long prompt prefills: deltaserve vs mlx_lm.server.

    python -m bench.server_itl --checkpoint small --long 3000
    python -m bench.server_itl --checkpoint 0.8B --long 20 --image 1024x1024

Per server (default settings, started as in bench.server_vs_mlxlm): 8 chat streams
decode; after `--arrival` seconds a ~`--long`-token chat arrives (one token wanted, so
its stream's end is its first token). With `--image WxH` that chat also carries one
image of that size (random pixels; deltaserve only: mlx_lm.server takes no images),
whose vision-tower pass and tokens prefill next to the streams. Gaps between the 8
streams' chunks are split into before the long prompt arrived and while it prefilled
(arrival to its first token); then the long prompt runs again alone. Prints JSON lines:
p50/p99 gaps before and during, their p99 ratio (the issue's target: <= 2), the long
prompt's TTFT under load and alone (target: <= 3x), and the ratios ours/peer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shlex
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench.prefix_cache import _history
from bench.server_vs_mlxlm import (
    _f32_copy,
    _free_port,
    _pct,
    _start,
    _stop,
    _wait_ready,
    served_name,
)
from deltaserve.models.testing import cached_checkpoint


def _image_url(size: str, seed: int) -> str:
    """A PNG data URL of random pixels, `size` "WxH" (noise: a fair worst case)."""
    width, height = (int(v) for v in size.split("x"))
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def _stream(
    base: str, model: str, words: int, seed: int, max_tokens: int, image: str | None = None
) -> list[float]:
    """One chat stream: the arrival time of every chunk that carries text."""
    content: str | list = _history(words, seed)
    if image is not None:
        url = {"url": _image_url(image, seed)}
        content = [{"type": "image_url", "image_url": url}, {"type": "text", "text": content}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    stamps = [time.perf_counter()]
    url = f"{base}/v1/chat/completions"
    async with (
        httpx.AsyncClient(timeout=None) as client,
        client.stream("POST", url, json=body) as r,
    ):
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("content") or delta.get("reasoning_content"):
                        stamps.append(time.perf_counter())
    stamps.append(time.perf_counter())
    return stamps


async def _scenario(base: str, model: str, args: argparse.Namespace) -> dict:
    streams = [
        asyncio.ensure_future(_stream(base, model, 100, seed=i, max_tokens=args.gen))
        for i in range(8)
    ]
    await asyncio.sleep(args.arrival)
    arrived = time.perf_counter()
    long_stamps = await _stream(base, model, args.long, 99, 1, args.image)
    first = long_stamps[-1]
    stamps = await asyncio.gather(*streams)
    all_decoding = max(ts[2] for ts in stamps if len(ts) > 2)
    before, during = [], []
    for ts in stamps:
        for a, b in zip(ts[1:-1], ts[2:-1], strict=False):
            if a >= all_decoding and b <= arrived:
                before.append(b - a)
            elif b > arrived and a < first:
                during.append(b - a)
    alone = await _stream(base, model, args.long, 98, 1, args.image)
    p99_before, p99_during = _pct(before, 0.99), _pct(during, 0.99)
    return {
        "gap_before_p50_ms": round(1e3 * _pct(before, 0.5), 1),
        "gap_before_p99_ms": round(1e3 * p99_before, 1),
        "gap_during_p50_ms": round(1e3 * _pct(during, 0.5), 1),
        "gap_during_p99_ms": round(1e3 * p99_during, 1),
        "p99_during_over_before": round(p99_during / p99_before, 2),
        "long_ttft_loaded_s": round(first - arrived, 2),
        "long_ttft_alone_s": round(alone[-1] - alone[0], 2),
        "long_ttft_loaded_over_alone": round((first - arrived) / (alone[-1] - alone[0]), 2),
        "gaps": [len(before), len(during)],
    }


async def _bench(kind: str, model: Path, args: argparse.Namespace) -> dict:
    port = _free_port()
    extra = tuple(shlex.split(args.ours)) if kind == "deltaserve" else ()
    proc = _start(kind, model, port, Path(f"/tmp/bench-itl-{kind}.log"), args.log_level, extra)
    base = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(base, proc)
        name = await served_name(kind, base, model)
        await _stream(base, name, args.long, 97, 4, args.image)  # first-use costs
        row = {"server": kind, "long_prompt_words": args.long, "image": args.image}
        row.update(await _scenario(base, name, args))
        print(json.dumps(row), flush=True)
        return row
    finally:
        _stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="small")
    parser.add_argument("--long", type=int, default=3000, help="words (~tokens) of the long chat")
    parser.add_argument("--gen", type=int, default=400, help="tokens per decoding stream")
    parser.add_argument("--arrival", type=float, default=8.0, help="seconds before it arrives")
    parser.add_argument("--only", choices=["deltaserve", "mlx_lm"])
    parser.add_argument("--image", help="WxH: the arriving chat carries one image instead")
    parser.add_argument(
        "--log-level", default="warning", help="ours: debug logs each step (/tmp/bench-itl-*.log)"
    )
    parser.add_argument(
        "--ours", default="", help='more arguments for our server, e.g. "--max-stall-factor 3"'
    )
    args = parser.parse_args()
    if args.image:
        args.only = "deltaserve"  # mlx_lm.server takes no images
    model = _f32_copy(cached_checkpoint(args.checkpoint))
    rows = {
        kind: asyncio.run(_bench(kind, model, args))
        for kind in ("deltaserve", "mlx_lm")
        if args.only in (None, kind)
    }
    if len(rows) == 2:
        ours, peer = rows["deltaserve"], rows["mlx_lm"]
        keys = ("p99_during_over_before", "long_ttft_loaded_s", "long_ttft_alone_s")
        print(json.dumps({f"{k}_ours_over_peer": round(ours[k] / peer[k], 2) for k in keys}))


if __name__ == "__main__":
    main()
