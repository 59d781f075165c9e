"""Stop `deltaserve serve` N times with token streams open; does each exit cleanly?

    python -m bench.stop_check --model DIR [--stops 10] [--streams 4] [-- SERVE ARGS...]

Each round starts a server on a free port, waits for /health, opens `--streams` long chat
streams, waits until each has produced a token, then sends SIGINT or SIGTERM (they
alternate; `--signal` picks one) and waits for the process to end. One JSON line per
stop: the signal, the exit status, seconds to exit, and whether stderr holds C++'s
"terminate called" line (std::terminate: exit 134, SIGABRT) or a Python traceback. A
stop is clean when the status is 0 and neither appears. Exits 1 unless every stop was
clean; the stderr of the first unclean stop is printed in full. `--group`: the signal goes
to the server's whole process group, as a terminal's Ctrl-C does (with --engine-process,
its engine's process too).

Needs only what the server needs (httpx, and the repository's bench/ for a free port),
so it runs where the server runs (e.g. the GPU machine). Arguments after `--` go to
`deltaserve serve` (e.g. `-- --served-model-name deltaserve-demo`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.server_vs_mlxlm import _free_port

REPO = Path(__file__).resolve().parent.parent
ABORT_LINE = "terminate called"
LONG_CHAT = {
    "max_tokens": 100_000,
    "ignore_eos": True,
    "stream": True,
    "messages": [{"role": "user", "content": "Count forever."}],
}


@dataclass
class StopResult:
    """One stop: how the process ended. `stderr` is left out of the JSON line."""

    signal: str
    status: int | None  # None: still running after the timeout (then killed)
    exit_s: float
    streams_started: int
    aborted: bool  # stderr has "terminate called"
    traceback: bool
    stderr: str

    @property
    def clean(self) -> bool:
        return self.status == 0 and not self.aborted and not self.traceback

    def summary(self) -> dict:
        row = asdict(self)
        del row["stderr"]
        return {**row, "clean": self.clean}


def serve_command(model: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    command = [sys.executable, "-m", "deltaserve.server.cli", "serve", "--config", "/dev/null"]
    return [*command, "--model", model, "--port", str(port), *extra]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not answer /health within {timeout_s:g} s")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"the server exited early with status {proc.returncode}")


def _stream(url: str, body: dict, started: threading.Event) -> None:
    """Read one stream to its end (or until the server goes); `started` once a chunk
    after the role chunk came."""
    chunks = 0
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 2:
                    started.set()
    except httpx.HTTPError:
        pass  # the server went away: what this checks is how it exited


def open_streams(url: str, num_streams: int, timeout_s: float) -> int:
    """Start `num_streams` long streams; returns how many produced a token in time. (No
    "model" in the body: the server takes its one model.)"""
    body = LONG_CHAT
    events = [threading.Event() for _ in range(num_streams)]
    for started in events:
        threading.Thread(target=_stream, args=(url, body, started), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    return sum(started.wait(max(0.0, deadline - time.monotonic())) for started in events)


def stop_once(
    model: str,
    signum: int,
    num_streams: int = 4,
    extra: Sequence[str] = (),
    startup_timeout_s: float = 600,
    exit_timeout_s: float = 30,
    group: bool = False,
) -> StopResult:
    """Start a server, open streams, send `signum`, and report how the process ended.
    `group`: the server leads a process group of its own and the signal goes to all of
    it, as a terminal's Ctrl-C does (an engine process gets it too)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            serve_command(model, port, extra),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=group,
        )
        try:
            wait_healthy(url, proc, startup_timeout_s)
            num_started = open_streams(url, num_streams, startup_timeout_s)
            time.sleep(0.2)  # a few more steps: every row is decoding
            sent = time.monotonic()
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            try:
                status: int | None = proc.wait(exit_timeout_s)
            except subprocess.TimeoutExpired:
                status = None
            exit_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if group:  # whatever of the group outlived the server
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        stderr.seek(0)
        text = stderr.read()
    return StopResult(
        signal.Signals(signum).name,
        status,
        round(exit_s, 2),
        num_started,
        ABORT_LINE in text,
        "Traceback" in text,
        text,
    )


def signals(which: str, count: int) -> list[int]:
    """`count` signals: alternating SIGINT/SIGTERM, or one kind."""
    if which == "int":
        return [signal.SIGINT] * count
    if which == "term":
        return [signal.SIGTERM] * count
    return [(signal.SIGINT, signal.SIGTERM)[i % 2] for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m bench.stop_check", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory (or hub id)")
    parser.add_argument("--stops", type=int, default=10)
    parser.add_argument("--streams", type=int, default=4, help="streams open at each stop")
    parser.add_argument("--signal", choices=["alternate", "int", "term"], default="alternate")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds")
    parser.add_argument("--exit-timeout", type=float, default=30, help="seconds")
    parser.add_argument(
        "--group", action="store_true", help="signal the server's whole process group"
    )
    args = parser.parse_args(argv)
    results = []
    for i, signum in enumerate(signals(args.signal, args.stops)):
        result = stop_once(
            args.model,
            signum,
            args.streams,
            extra,
            args.startup_timeout,
            args.exit_timeout,
            args.group,
        )
        print(json.dumps({"stop": i + 1, **result.summary()}), flush=True)
        results.append(result)
    unclean = [r for r in results if not r.clean]
    print(json.dumps({"stops": len(results), "clean": len(results) - len(unclean)}))
    if unclean:
        print(f"--- stderr of the first unclean stop ({unclean[0].signal}) ---", file=sys.stderr)
        print(unclean[0].stderr, file=sys.stderr)
    return 1 if unclean else 0


if __name__ == "__main__":
    sys.exit(main())
