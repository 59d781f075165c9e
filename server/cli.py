"""`deltaserve serve`: settings → model location → engine → tokenizer → app → uvicorn.

Mistakes an operator makes at start-up (bad config, no model, a model that cannot be
found) end in one `deltaserve: error: ...` line on stderr and exit status 2, before
anything slow (OpenBLAS re-exec, MLX) runs; so does a port that cannot be bound (probed
there, then bound for real before the model loads and handed to uvicorn). Loading says
what it is doing, and the start-up summary (server/startup.py) comes once the port is
bound.

Ctrl-C (SIGINT) or SIGTERM: uvicorn stops accepting, every open generation ends at once
with a 503 "shutting down" error (streams: an error event, then [DONE]; see
deltaserve.server.app.begin_shutdown), the app's lifespan calls engine.shutdown(), and the process
exits 0. GRACEFUL_SHUTDOWN_S only bounds requests that are not generating yet. A device
failure (a GPU fault no later step survives: engine/errors.py is_device_fault) fails the
requests in flight, turns /health 503, stops the server the same way and exits 1, for a
supervisor to restart it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from deltaserve.kernels.cpu import reexec_with_openblas
from deltaserve.server import heap
from deltaserve.server.flags import Shown, add_arguments, effective_defaults
from deltaserve.server.settings import ConfigError, ServerSettings, Settings, load_settings
from deltaserve.server.startup import (
    ModelNotFound,
    log_startup,
    missing_model_message,
    not_a_checkpoint_message,
    port_taken_message,
    size,
)

if TYPE_CHECKING:  # imported in serve(): mlx loads only after the checks above
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.engine_process import EngineProcess
    from deltaserve.engine.parallel.tensor_parallel import TensorParallel

GRACEFUL_SHUTDOWN_S = 1
logger = logging.getLogger("deltaserve")


def build_parser(shown: Shown | None = None) -> argparse.ArgumentParser:
    """The CLI: one subcommand so far, whose flags come from the config dataclasses.

    `shown` holds the config-file / env values that --help reports as each flag's default.
    """
    parser = argparse.ArgumentParser(prog="deltaserve")
    parser.add_argument("--version", action="version", version=f"deltaserve {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a Qwen3.5 checkpoint over an OpenAI-compatible HTTP API. "
        "Precedence: flag > DELTASERVE_* env > config file > built-in.",
    )
    add_arguments(serve, shown)
    return parser


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, through its metadata)."""
    try:
        return metadata.version("deltaserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deltaserve` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(effective_defaults(argv, os.environ)).parse_args(argv)
    try:
        settings = load_settings(args)
    except ConfigError as e:
        print(f"deltaserve: config error: {e}", file=sys.stderr)
        return 2
    try:
        checkpoint = locate_model(settings.model.path)
    except ModelNotFound as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    # A taken port fails now, not after the OpenBLAS re-exec and MLX's import; serve()
    # binds for real (under mlx.launch, rank 0 only: a follower's host may use the port).
    if "MLX_RANK" not in os.environ:
        probe = _bind(settings.server)
        if probe is None:
            return 2
        probe.close()
    # Before anything imports mlx: on Linux CPU this may re-exec us with OpenBLAS.
    reexec_with_openblas()
    quiet_third_party_logs()
    level = "DEBUG" if settings.server.log_level == "trace" else settings.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (docker stop, systemd) ends the server like Ctrl-C: uvicorn restores this
    # handler and re-raises the signal after its graceful shutdown, and the default
    # action would then kill us with status 143 instead of exiting 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        return serve(settings, checkpoint)
    return 0


def locate_model(path_or_id: str) -> Path:
    """The local checkpoint directory (hub ids are downloaded), or ModelNotFound."""
    # The cli is the composition root, so it may reach models/ directly; hub.py imports
    # neither mlx nor the engine, which keeps this check fast.
    from deltaserve.models.hub import CheckpointNotFoundError, resolve_checkpoint

    if not path_or_id:
        raise ModelNotFound(missing_model_message("", None))
    try:
        checkpoint = resolve_checkpoint(path_or_id)
    except CheckpointNotFoundError as e:
        raise ModelNotFound(missing_model_message(path_or_id, e)) from None
    if not (checkpoint / "config.json").is_file():
        raise ModelNotFound(not_a_checkpoint_message(path_or_id, checkpoint))
    return checkpoint


def quiet_third_party_logs() -> None:
    """Silence start-up noise that is not ours; call before transformers is imported.

    transformers warns "PyTorch was not found..." on import: the server only uses its
    tokenizers, so that advice is noise. An explicit user setting wins.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def serve(settings: Settings, checkpoint: Path) -> int:
    """Load the model, start the engine thread and serve until a shutdown signal.

    Started by `mlx.launch` on several processes: tensor parallel. Rank 0 serves HTTP and
    schedules; the other ranks follow its steps (engine/parallel/tensor_parallel.py) and exit
    when it stops. Returns the exit status (2: the ranks were started differently)."""
    from deltaserve.engine.errors import SetupMismatchError
    from deltaserve.server.app import begin_shutdown, create_app
    from deltaserve.server.frontend.tokenizer import TextTokenizer

    parallel = _join_group(settings)
    try:
        if parallel is not None:
            from deltaserve.engine.parallel.tensor_parallel import follow, start_engine

            logger.info("tensor parallel: rank %d of %d", parallel.rank, parallel.size)
            if parallel.rank > 0:
                # A signal ends a follower at once (it may be blocked in a collective,
                # where Python handlers never run); rank 0 then ends too (lost rank).
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                follow(start_engine(str(checkpoint), settings.engine, parallel))
                return 0
        sock = _bind(settings.server)  # rank 0 only: the others serve no HTTP
        if sock is None:
            return 2
        engine = _load(settings, checkpoint, parallel)
    except SetupMismatchError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    # The app's lifespan stops the engine; this `finally` covers the other ways out (a
    # Ctrl-C while the tokenizer loads, uvicorn failing to start): the engine thread must
    # be joined before the interpreter finalizes (AsyncEngine.shutdown says why).
    try:
        tokenizer = TextTokenizer(engine.model_path, engine.eos_token_ids)
        host, port = sock.getsockname()[:2]  # port 0 binds a free one: name it
        log_startup(engine, settings, f"http://{_url_host(host)}:{port}")
        app = create_app(engine, tokenizer, settings)
        frozen, seconds = heap.freeze_startup()
        heap.PAUSES.install()  # after the deliberate collection: it is logged below
        logger.info(
            "  heap: %s start-up objects frozen out of garbage collection (a full "
            "collection over them took %.0f ms, a pause of every stream)",
            f"{frozen:,}",
            seconds * 1e3,
        )
        config = uvicorn.Config(
            app,
            host=settings.server.host,
            port=port,
            log_level=settings.server.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = StreamEndingServer(config, lambda: begin_shutdown(app))
        # a failed device ends the engine (AsyncEngine._fault): stop serving too, and exit
        # non-zero below, so that a supervisor restarts the process
        engine.on_fault = lambda reason: setattr(server, "should_exit", True)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if engine.fault is not None:
        logger.error("exiting after the device failed: %s", engine.fault)
        return 1
    return 0


# What a distributed launch (mlx.launch's backends, mpirun) sets in each rank's environment
GROUP_ENVIRONMENT = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _join_group(settings: Settings) -> TensorParallel | None:
    """This process's tensor-parallel group, None when it runs alone. With
    --engine-process and no distributed launch in the environment it is alone without
    asking MLX: this process then never loads MLX (the engine's process does; on CUDA a
    process that loads MLX holds a device context of its own)."""
    if settings.server.engine_process and not any(v in os.environ for v in GROUP_ENVIRONMENT):
        return None
    from deltaserve.engine.parallel.tensor_parallel import join_group

    return join_group(settings.engine.distributed_backend)


def _load(
    settings: Settings, checkpoint: Path, parallel: TensorParallel | None
) -> AsyncEngine | EngineProcess:
    """Start the engine (in this process, or in its own: --engine-process), saying what it
    loads and how long that took."""
    # only the branch taken is imported: with --engine-process this process never loads
    # MLX (the engine process does)
    on_disk = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    logger.info("loading %s (%s of weights on disk) ...", settings.model.path, size(on_disk))
    started = time.monotonic()
    name = settings.model.name
    if settings.server.engine_process and parallel is None:
        from deltaserve.engine.engine_process import EngineProcess

        logger.info("  the engine runs in a process of its own (--engine-process)")
        engine = EngineProcess.start(str(checkpoint), settings.engine, name=name)
    else:
        if settings.server.engine_process:
            logger.warning("--engine-process is off under tensor parallelism: rank 0's "
                           "engine is the group's member, in this process")  # fmt: skip
        from deltaserve.engine.async_engine import AsyncEngine

        engine = AsyncEngine.start(str(checkpoint), settings.engine, name=name, parallel=parallel)
    logger.info("model loaded in %.1f s; loading the tokenizer ...", time.monotonic() - started)
    return engine


def bind_socket(server: ServerSettings) -> socket.socket:
    """The server's TCP socket, bound now (uvicorn listens on it later), so that a port
    that is taken fails in a second instead of after the model has loaded. As uvicorn
    binds: IPv6 when the host has a colon, SO_REUSEADDR (a restart need not wait out
    TIME_WAIT; a port another process listens on still fails)."""
    host, port = server.host, server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as asyncio's own listeners have: asyncio sets TCP_NODELAY only on
    # connections whose socket says TCP, and without it Nagle's algorithm held each
    # stream's small SSE writes for a delayed ACK (a chat's warm first token took ~40 ms
    # longer: bench.prefix_cache alone 0.128x a cold prompt against 0.078x)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _bind(server: ServerSettings) -> socket.socket | None:
    """bind_socket, or None after printing why the port cannot be bound."""
    try:
        return bind_socket(server)
    except OSError as e:
        message = port_taken_message(server.host, server.port, e)
        print(f"deltaserve: error: {message}", file=sys.stderr)
        return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class StreamEndingServer(uvicorn.Server):
    """uvicorn.Server that ends open generations as soon as shutdown starts.

    Plain uvicorn waits for in-flight requests (up to the graceful timeout), then cancels
    them, which logs a CancelledError traceback and cuts streams without an ending. A
    token stream may run for minutes, so waiting helps no one: end them now, cleanly.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


if __name__ == "__main__":
    sys.exit(main())
