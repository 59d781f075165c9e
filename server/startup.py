"""What an operator reads when `deltaserve serve` starts: the log lines that say what runs
where, and the one-line error when the model cannot be found.

Pure formatting (no mlx, no engine imports), so each message is testable on its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engine.config import KVCacheConfig
from kernels.blas import blas_summary
from server.settings import Settings

logger = logging.getLogger("deltaserve")

NEXT_STEP = "Pass --model /path/to/checkpoint or run scripts/setup for a demo."


class ModelNotFound(Exception):
    """The model to serve is unset or cannot be found; the message is one line."""


def missing_model_message(path_or_id: str, error: BaseException | None) -> str:
    """One actionable line for an unset model, or for the loader's not-found `error`."""
    if not path_or_id:
        return f"no model given (--model, $DELTASERVE_MODEL or model.path). {NEXT_STEP}"
    return f"model {path_or_id!r} not found: {_reason(path_or_id, error)}. {NEXT_STEP}"


def not_a_checkpoint_message(path_or_id: str, directory: Path) -> str:
    """One line for a directory that exists but holds no checkpoint."""
    where = "" if str(directory) == path_or_id else f" ({directory})"
    return f"model {path_or_id!r}{where} is not a checkpoint: no config.json. {NEXT_STEP}"


def _reason(path_or_id: str, error: BaseException | None) -> str:
    # models/hub.py raises CheckpointNotFoundError for every case; the hub's own error,
    # when there is one, is its __cause__ and tells the cases apart.
    from huggingface_hub import errors as hub

    cause = getattr(error, "__cause__", None)
    local = Path(path_or_id).expanduser()
    if cause is None:
        if local.is_file():
            return "it is a file; expected a checkpoint directory"
        return "no such directory"
    if isinstance(cause, hub.HFValidationError):
        return "no such directory, and not a valid Hugging Face hub id"
    if isinstance(cause, hub.GatedRepoError):  # before its base, RepositoryNotFoundError
        return "the Hugging Face hub repo is gated or private (log in with `hf auth login`)"
    if isinstance(cause, hub.RepositoryNotFoundError):
        return "not a local directory, and no such repo on the Hugging Face hub"
    if isinstance(cause, hub.LocalEntryNotFoundError | hub.OfflineModeIsEnabled):
        return "not a local directory and the Hugging Face hub is unreachable (offline?)"
    return f"not a local directory, and the hub download failed ({type(cause).__name__})"


def kv_cache_summary(kv: KVCacheConfig) -> str:
    """The kv cache log line: the kind, plus only the settings that kind reads."""
    if kv.kind == "affine":
        return f"kv cache: affine ({kv.bits} bits, group size {kv.group_size}, start {kv.start})"
    if kv.kind == "turboquant":
        bits = f"key/value bits {kv.key_bits}/{kv.value_bits}"
        return f"kv cache: turboquant ({bits}, start {kv.start})"
    return f"kv cache: {kv.kind}"


def log_startup(engine: Any, settings: Settings) -> None:
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
    logger.info("%s", kv_cache_summary(settings.engine.kv_cache))
    auth = "on" if settings.server.api_key else "off"
    logger.info(
        "listening on http://%s:%d (api key %s)", settings.server.host, settings.server.port, auth
    )
