"""The HTTP server's own CPU per streamed token, against a bare Starlette SSE endpoint.

    python -m bench.server_overhead [--streams 64] [--tokens 300]

The engine thread and the HTTP side share one interpreter (and its GIL): every
microsecond the server spends per streamed chunk (chat template out, detokenizer, stop
strings, JSON, SSE, metrics) is taken from the engine's step building on a GPU, where a
step is CPU-bound. Here the server runs on tests/fake_engine.py's FakeEngine (tokens at
once, no model: needs the test extras), N streaming chat clients read every chunk, and
the server process reports its CPU time (time.process_time) before and after. The peer is
the floor: a plain Starlette endpoint streaming the same number of SSE chunks of the same
size per request, on the same uvicorn. Prints JSON lines and our ratio against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.server_vs_mlxlm import _free_port

ROOT = Path(__file__).resolve().parent.parent

_SERVER = r"""
import sys, time
sys.path.insert(0, {tests!r})
import uvicorn
kind, port, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind == "deltaserve":
    from fake_engine import FakeEngine, real_tokenizer
    from deltaserve.server.app import create_app
    from deltaserve.server.settings import ModelSettings, Settings
    tok = real_tokenizer()
    engine = FakeEngine(tok, max_context=8192)
    text = " ".join(f"w{{i}}" for i in range(tokens))
    engine.script = lambda request: text
    app = create_app(engine, tok, Settings(model=ModelSettings(path="unused", served_name="m")))
else:
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route
    chunk = (b'data: {{"id":"chatcmpl-0123456789","object":"chat.completion.chunk",'
             b'"created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":" w1"}},'
             b'"finish_reason":null}}]}}\n\n')
    async def chat(request):
        await request.json()
        async def body():
            for _ in range(tokens):
                yield chunk
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")
    async def health(request):
        return StreamingResponse(iter([b"ok"]))
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", health)])
from starlette.responses import JSONResponse
from starlette.routing import Route
app.router.routes.append(Route("/_cpu", lambda request: JSONResponse(time.process_time())))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


async def _stream(client: httpx.AsyncClient, i: int, tokens: int) -> int:
    body = {
        "model": "m", "stream": True, "max_tokens": tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"stream {i}"}],
    }  # fmt: skip
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


async def _measure(port: int, streams: int, tokens: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        for _ in range(600):
            try:
                if (await client.get("/_cpu", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                await asyncio.sleep(0.5)
        await asyncio.gather(*[_stream(client, i, 8) for i in range(4)])  # warm
        cpu0 = (await client.get("/_cpu")).json()
        start = time.perf_counter()
        chunks = sum(await asyncio.gather(*[_stream(client, i, tokens) for i in range(streams)]))
        wall = time.perf_counter() - start
        cpu = (await client.get("/_cpu")).json() - cpu0
    return {"chunks": chunks, "wall_s": round(wall, 2), "server_cpu_s": round(cpu, 3),
            "us_per_chunk": round(1e6 * cpu / max(chunks, 1), 1)}  # fmt: skip


def run(kind: str, streams: int, tokens: int) -> dict:
    port = _free_port()
    code = _SERVER.format(tests=str(ROOT / "tests"))
    proc = subprocess.Popen([sys.executable, "-c", code, kind, str(port), str(tokens)], cwd=ROOT)
    try:
        line = {"server": kind, "streams": streams, **asyncio.run(_measure(port, streams, tokens))}
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(line), flush=True)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=300, help="chunks per stream")
    args = ap.parse_args()
    ours = run("deltaserve", args.streams, args.tokens)
    floor = run("starlette", args.streams, args.tokens)
    ratio = ours["us_per_chunk"] / max(floor["us_per_chunk"], 1e-9)
    print(json.dumps({"us_per_chunk_vs_bare_starlette": round(ratio, 2)}), flush=True)


if __name__ == "__main__":
    main()
