"""Prometheus metrics for GET /metrics.

Two kinds: what the server observes per request (status codes, token counts, time to
first token, inter-token latency), recorded as requests run; and the engine's figures
(queue depth, running rows, state and MLX memory, step times), read from EngineStats at
scrape time so they are never stale. Each app gets its own registry: tests build many
apps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.engine.api import (
    HOST_PARTS,
    STEP_KINDS,
    STEP_SECONDS_BUCKETS,
    EngineClient,
    StepTimes,
)
from deltaserve.server.heap import GcPauseCollector

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector(Collector):
    """Engine gauges, read when Prometheus scrapes."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._engine.stats()
        except Exception:  # a dead engine must not break the scrape; /health reports it
            return
        gauges = {
            "engine_alive": ("1 while the engine thread runs", int(stats.is_alive)),
            "queue_depth": ("requests waiting for a row", stats.num_waiting),
            "running_rows": ("rows generating (or prefilling)", stats.num_running),
            "state_bytes_in_use": ("KV + DeltaNet state of all rows", stats.state_bytes_in_use),
            "state_bytes_budget": ("row-state memory budget", stats.state_bytes_budget),
            "mlx_active_bytes": ("MLX active memory", stats.mlx_active_bytes),
            "mlx_peak_bytes": ("MLX peak memory", stats.mlx_peak_bytes),
            "prefix_cache_bytes": (
                "prefix cache: KV blocks + DeltaNet snapshots held (part of state bytes)",
                stats.prefix_cache_bytes,
            ),
            "speculative_break_even_drafts": (
                "accepted drafts a verify must average to beat plain decoding, measured on "
                "this device; rows below it pause drafting (-1: not measured yet, or off)",
                stats.speculative_break_even_drafts,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"deltaserve_{name}", doc, value=value)
        counters = {
            "prefix_cache_lookup_tokens": (
                "prompt tokens looked up in the prefix cache",
                stats.prefix_cache_lookup_tokens_total,
            ),
            "prefix_cache_hit_tokens": (
                "prompt tokens restored from the prefix cache (hit rate: over lookups)",
                stats.prefix_cache_hit_tokens_total,
            ),
            "prefix_cache_evictions": (
                "prefix-cache snapshots evicted",
                stats.prefix_cache_evictions_total,
            ),
            "speculative_drafted_tokens": (
                "draft tokens the MTP head proposed and the model verified",
                stats.speculative_drafted_tokens_total,
            ),
            "speculative_accepted_tokens": (
                "verified drafts accepted (acceptance rate: over drafted)",
                stats.speculative_accepted_tokens_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"deltaserve_{name}", doc, value=value)
        yield from _step_metrics(stats.step_times)


def _step_metrics(times: StepTimes) -> Iterator[Metric]:
    """`deltaserve_step_seconds{kind}` (every engine step's wall time: what each running
    stream waited for it), `deltaserve_step_host_seconds{kind}` (the part of it the
    engine's Python took) and `deltaserve_traced_steps` (steps that traced a compiled
    shape, a stall of every stream)."""
    family = HistogramMetricFamily(
        "deltaserve_step_seconds",
        "engine steps' wall time by kind: decode (decode rows only), mixed (decode rows "
        "and prompt work), prefill (prompt work only), verify (speculative drafts)",
        labels=["kind"],
    )
    bounds = (*map(str, STEP_SECONDS_BUCKETS), "+Inf")
    for kind, counts, total in zip(STEP_KINDS, times.counts, times.seconds, strict=True):
        family.add_metric([kind], list(zip(bounds, counts, strict=True)), total)
    yield family
    host = CounterMetricFamily(
        "deltaserve_step_host_seconds",
        "the engine thread's own time on steps of each kind (scheduling, building and "
        "queueing the forward, applying the tokens), less its waits on the device",
        labels=["kind"],
    )
    for kind, total in zip(STEP_KINDS, times.host_seconds, strict=True):
        host.add_metric([kind], total)
    yield host
    parts = CounterMetricFamily(
        "deltaserve_step_host_part_seconds",
        "where the engine thread's time on steps of each kind went: schedule (the plan), "
        "build (the forward's graph), submit (MLX encoding its kernels), sample, update "
        "(applying the tokens)",
        labels=["kind", "part"],
    )
    for kind, by_part in zip(STEP_KINDS, times.host_parts, strict=True):
        for part, total in zip(HOST_PARTS, by_part, strict=True):
            parts.add_metric([kind, part], total)
    yield parts
    yield CounterMetricFamily(
        "deltaserve_traced_steps",
        "engine steps that traced a compiled shape (each a stall of every stream)",
        value=times.traced,
    )


class ServerMetrics:
    """The metric objects of one app, and its registry."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "deltaserve_http_requests", "HTTP responses", ["route", "status"], registry=reg
        )
        self.prompt_tokens = Counter(
            "deltaserve_prompt_tokens", "prompt tokens of accepted requests", registry=reg
        )
        self.images = Counter(
            "deltaserve_images", "images of chat requests, decoded and preprocessed", registry=reg
        )
        self.generated_tokens = Counter(
            "deltaserve_generation_tokens", "tokens generated", registry=reg
        )
        self.ttft = Histogram(
            "deltaserve_time_to_first_token_seconds",
            "request arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "deltaserve_inter_token_latency_seconds",
            "gap between successive tokens of one choice",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        reg.register(_EngineCollector(engine))
        reg.register(GcPauseCollector())

    def timer(self, start: float) -> RequestTimer:
        """Latency bookkeeping for one request that arrived at `start` (monotonic)."""
        return RequestTimer(self, start)

    @property
    def content_type(self) -> str:
        """The exposition format's content type."""
        return CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes TTFT once per request and the inter-token gaps of each choice; keeps the
    request's own figures for its record (server/request_log.py)."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self._metrics = metrics
        self.start = start  # arrival (time.monotonic())
        self._last: dict[int, float] = {}  # choice index -> time of its latest token
        self._first_at: float | None = None  # the request's first token
        self._last_at: float | None = None  # its latest token, any choice
        self._num_after_first = 0  # tokens that came after the first delivery

    def on_tokens(self, index: int, num_tokens: int) -> None:
        """Record that choice `index` just received `num_tokens` tokens."""
        if num_tokens == 0:
            return
        now = time.monotonic()
        if not self._last:
            self._metrics.ttft.observe(now - self.start)
            self._first_at = now
        else:
            self._num_after_first += num_tokens
        if index in self._last:
            # A delta may carry several tokens (e.g. after a slow step): spread the gap.
            gap = (now - self._last[index]) / num_tokens
            for _ in range(num_tokens):
                self._metrics.itl.observe(gap)
        self._last[index] = now
        self._last_at = now

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token; None while no token came."""
        return None if self._first_at is None else self._first_at - self.start

    @property
    def tokens_per_s(self) -> float | None:
        """Generation speed after the first token (prefill and queueing are TTFT's part):
        tokens since the first delivery over the time since it; None before two."""
        if self._first_at is None or self._last_at is None or self._last_at <= self._first_at:
            return None
        return self._num_after_first / (self._last_at - self._first_at)


def route_label(scope: Scope) -> str:
    """The `route` label of a request: the path template of the route that matched it
    (`/v1/models/{model_id:path}`, so ids never become labels), "other" when none did
    (404 probes, typos, CORS preflights that the CORS middleware answers itself).

    Read when the response starts: the router has written the matched route into the
    scope by then (Starlette's `scope["route"]`), so every route, present or future, gets
    its own label without a list to keep in step."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "other"


class StatusCounterMiddleware:
    """Pure ASGI middleware counting responses by route and status code.

    Pure ASGI (not BaseHTTPMiddleware) so that streaming responses and client
    disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                label = route_label(scope)
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
