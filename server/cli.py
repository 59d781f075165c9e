"""`deltaserve serve`: settings → engine → tokenizer → app → uvicorn.

Ctrl-C (SIGINT) or SIGTERM: uvicorn stops accepting, lets in-flight requests finish for
up to GRACEFUL_SHUTDOWN_S (then cancels them, which aborts their engine requests), the
app's lifespan calls engine.shutdown(), and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kernels.blas import blas_summary, ensure_openblas
from server.settings import ConfigError, Settings, add_arguments, load_settings

GRACEFUL_SHUTDOWN_S = 10.0
logger = logging.getLogger("deltaserve")


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one subcommand so far, whose flags come from the config dataclasses."""
    parser = argparse.ArgumentParser(prog="deltaserve")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_arguments(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deltaserve` console script."""
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ConfigError as e:
        print(f"deltaserve: config error: {e}", file=sys.stderr)
        return 2
    if not settings.model.path:
        print(
            "deltaserve: no model: pass --model PATH_OR_HUB_ID (or set model.path)", file=sys.stderr
        )
        return 2
    # Before anything imports mlx: on Linux CPU this may re-exec us with OpenBLAS.
    ensure_openblas()
    level = "DEBUG" if settings.server.log_level == "trace" else settings.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn re-raises the captured SIGINT once it has shut down cleanly: that is exit 0.
    with contextlib.suppress(KeyboardInterrupt):
        serve(settings)
    return 0


def serve(settings: Settings) -> None:
    """Load the model, start the engine thread and serve until a shutdown signal."""
    import uvicorn

    from engine.async_engine import AsyncEngine
    from server.app import create_app
    from server.frontend.tokenizer import TextTokenizer

    logger.info("model: %s (served as %s)", settings.model.path, settings.model.name)
    engine = AsyncEngine.start(settings.model.path, settings.engine, name=settings.model.name)
    tokenizer = TextTokenizer(engine.model_path)
    _log_startup(engine, settings)
    app = create_app(engine, tokenizer, settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
    )
    uvicorn.Server(config).run()


def _log_startup(engine: Any, settings: Settings) -> None:
    """The lines an operator checks first: what runs where, how fast, in how much memory."""
    stats = engine.stats()
    # dtype lives on the loaded model inside the engine; read it without importing mlx.
    loaded = getattr(getattr(engine, "engine", None), "loaded", None)
    logger.info("checkpoint: %s", engine.model_path)
    logger.info("dtype: %s", getattr(loaded, "dtype", "unknown"))
    logger.info("%s", blas_summary())  # backend + measured GEMM throughput
    logger.info(
        "memory budget for row state: %.2f GiB (%d KV bytes/token); max context %d",
        stats.state_bytes_budget / 2**30,
        stats.kv_bytes_per_token,
        engine.max_context,
    )
    kv = settings.engine.kv_cache
    logger.info(
        "kv cache: %s (bits %d, key/value bits %d/%d, start %d)",
        kv.kind,
        kv.bits,
        kv.key_bits,
        kv.value_bits,
        kv.start,
    )
    auth = "on" if settings.server.api_key else "off"
    logger.info(
        "listening on http://%s:%d (api key %s)", settings.server.host, settings.server.port, auth
    )


if __name__ == "__main__":
    sys.exit(main())
