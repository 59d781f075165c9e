"""The status page's data: one JSON snapshot of what the server is doing now and did in
the last minutes, served by GET /dashboard/data (server/routes_status.py).

It reads the sources that exist already: the EngineStats snapshot the engine thread
publishes after each step (what /metrics reads: running and queued rows, row-state bytes
against the budget, prefix-cache counters, the generated-token total, step times), the
request log's records (server/request_log.py), EngineInfo and the Settings, and the
StatusHistory (server/status_history.py): EngineStats sampled over the last minutes.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

from deltaserve.engine.api import STEP_KINDS, StepTimes
from deltaserve.server.routes_common import ServerState


def step_summary(times: StepTimes) -> dict[str, Any]:
    """Engine steps since start by kind (count, mean ms, the engine thread's own share of
    it; /metrics has the histogram) and
    how many traced a compiled shape: where the running streams' waits went."""
    kinds = {
        kind: {
            "count": n,
            "mean_ms": 1e3 * total / n if n else None,
            "host_mean_ms": 1e3 * host / n if n else None,
        }
        for kind, (*_, n), total, host in zip(
            STEP_KINDS, times.counts, times.seconds, times.host_seconds, strict=True
        )
    }
    return {"kinds": kinds, "traced": times.traced}


def status_snapshot(state: ServerState, now: float) -> dict[str, Any]:
    """Everything the status page shows, as one JSON-ready dict."""
    stats = state.engine.stats()
    info = state.engine.info
    records = state.requests.recent()
    since = now - state.history.window_s
    lookups = stats.prefix_cache_lookup_tokens_total
    return {
        "time": now,
        "model": state.model_name,
        "engine": {
            "alive": stats.is_alive,
            "running": stats.num_running,
            "queued": stats.num_waiting,
            "state_bytes_in_use": stats.state_bytes_in_use,
            "state_bytes_budget": stats.state_bytes_budget,
            "mlx_active_bytes": stats.mlx_active_bytes,
            "mlx_peak_bytes": stats.mlx_peak_bytes,
        },
        "totals": {
            "finished_requests": state.requests.num_finished,
            "prompt_tokens": stats.prompt_tokens_total,
            "generated_tokens": stats.generated_tokens_total,
        },
        "prefix_cache": {
            "enabled": info.prefix_cache_max_bytes > 0,
            "bytes": stats.prefix_cache_bytes,
            "max_bytes": info.prefix_cache_max_bytes,
            "lookup_tokens": lookups,
            "hit_tokens": stats.prefix_cache_hit_tokens_total,
            "hit_rate": stats.prefix_cache_hit_tokens_total / lookups if lookups else None,
            "evictions": stats.prefix_cache_evictions_total,
        },
        "steps": step_summary(stats.step_times),
        "history": state.history.series(),
        "ttft": [[r.finished_at, r.ttft_s] for r in reversed(records) if r.finished_at >= since],
        "requests": [record.as_json() for record in records],
        "platform": platform_facts(state),
        "settings": settings_in_force(state),
    }


def platform_facts(state: ServerState) -> dict[str, Any]:
    """The host and what the engine computes with."""
    info = state.engine.info
    profile = info.platform
    return {
        "host": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": profile.mlx_version,
        "device": profile.device,
        "device_name": profile.device_name or "-",
        "dtype": profile.dtype,
        "blas": profile.blas or "-",
        "fast_paths_on": ", ".join(k for k, on in profile.switches().items() if on) or "none",
        "tensor_parallel_ranks": info.num_ranks,
        "max_context": state.engine.max_context,
    }


def settings_in_force(state: ServerState) -> dict[str, Any]:
    """The settings as flat `section.key` pairs (None: the engine picks per platform);
    the API key itself is never shown, only whether one is set."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for item in dataclasses.fields(node):
            value = getattr(node, item.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{item.name}.")
            else:
                flat[prefix + item.name] = list(value) if isinstance(value, tuple) else value

    walk(state.settings, "")
    flat["server.api_key"] = "set" if state.settings.server.api_key else None
    info = state.engine.info
    for key in ("max_num_batched_tokens", "max_prefill_chunk"):  # 0: the device's choice
        if not flat.get(f"engine.{key}") and getattr(info, key):
            flat[f"engine.{key}"] = f"{getattr(info, key)} (this device's default)"
    return flat
