"""What an operator reads when `deltaserve serve` starts: the summary that says what runs
where in how much memory, and the one-line errors (model not found, port taken).

Pure formatting (no mlx), so each message is testable on its own.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Any

from deltaserve.engine.api import EngineSummary
from deltaserve.engine.config import KVCacheConfig
from deltaserve.server.settings import Settings

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


def port_taken_message(host: str, port: int, error: OSError) -> str:
    """One line for a port that cannot be bound (in use, or not allowed)."""
    taken = error.errno == errno.EADDRINUSE
    reason = "is already in use" if taken else f"cannot be bound ({error.strerror or error})"
    return (
        f"cannot listen on {host}:{port}: the port {reason}. "
        "Stop what holds it or pass --port N (0: any free port)."
    )


def resident_bytes() -> tuple[int, str]:
    """This process's resident memory and whether it is the current or the peak value
    (Linux reads the current one; elsewhere only the peak is portable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "now"
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * (1 if sys.platform == "darwin" else 1024), "at peak"


def size(nbytes: float) -> str:
    """Bytes in binary units a person reads at a glance: 272 MiB, 11.5 GiB."""
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**30:.1f} GiB"


def summary_lines(
    summary: EngineSummary,
    settings: Settings,
    url: str,
    resident: tuple[int, str],
) -> list[str]:
    """The start-up summary, printed once the port is bound: what is served where, and
    what the memory numbers mean. The row-state budget is a cap (rows are allocated as
    they join: engine/cache/budget.py), so it reads "up to", next to what is reserved
    and resident now; capacity is counted in rows of a typical chat and of the full
    context, and max_num_seqs says how many of them run at once."""
    auth = "on" if settings.server.api_key else "off"
    nbytes, when = resident
    # --engine-process: the weights are the engine's process's, not this one's
    where = "server process" if settings.server.engine_process else "process"
    configured = settings.engine.memory_budget_bytes
    source = "memory_budget_bytes" if configured else "half the memory left"
    lines = [
        f"ready: {settings.model.name} ({settings.model.path}) on {url} (api key {auth})",
        f"  {summary.platform.describe()}",
        f"  memory: weights {size(summary.weight_bytes)}, {where} resident {size(nbytes)} {when}",
        f"  row state: up to {size(summary.budget_bytes)} ({source}), allocated as requests "
        f"arrive ({size(summary.reserved_bytes)} reserved now): room for "
        f"{summary.chat_rows:,} chats of {summary.chat_tokens:,} tokens or "
        f"{summary.context_rows:,} of the full {summary.max_context:,}-token context; "
        f"{summary.max_num_seqs} run at once (max_num_seqs), the rest wait",
    ]
    if summary.prefix_cache_bytes:
        lines.append(
            f"  prefix cache: up to {size(summary.prefix_cache_bytes)}, inside the row-state "
            "budget (it gives way to running rows)"
        )
    else:
        lines.append("  prefix cache: off")
    lines.append(f"  {kv_cache_summary(settings.engine.kv_cache)}")
    return lines


def log_startup(engine: Any, settings: Settings, url: str) -> None:
    """Log the start-up summary (summary_lines) of `engine`, serving on `url`."""
    for line in summary_lines(engine.summary(), settings, url, resident_bytes()):
        logger.info("%s", line)
