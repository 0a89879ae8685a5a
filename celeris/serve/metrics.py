"""Prometheus metrics of one server, in its own CollectorRegistry (so several apps can live in one process).

Names follow vLLM's where one exists: time to first token, end-to-end latency, output tokens,
waiting and running requests. ``celeris_request_nfe`` counts forward passes per answer (a CFG step
counts 2), the cost measure of a diffusion model.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
NFE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Paths that get their own label; anything else is "other", so scanners cannot blow up cardinality.
KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServerMetrics:
    """The server's counters, histograms and gauges (all thread-safe; the engine thread sets the gauges)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("celeris_http_requests", "HTTP requests by path and status code",
                                ["path", "status"], registry=r)
        self.ttft = Histogram("celeris_time_to_first_token_seconds", "Arrival to the first final answer text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("celeris_e2e_request_latency_seconds", "Arrival to the full answer (successful requests)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.output_tokens = Counter("celeris_output_tokens", "Answer tokens returned to clients", registry=r)
        self.prompt_tokens = Counter("celeris_prompt_tokens", "Prompt (and suffix) tokens of finished requests",
                                     registry=r)
        self.nfe = Histogram("celeris_request_nfe", "Forward passes per answer (a CFG step counts 2)",
                             buckets=NFE_BUCKETS, registry=r)
        self.waiting = Gauge("celeris_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.running = Gauge("celeris_num_requests_running", "Requests being denoised", registry=r)
        self.rejected = Counter("celeris_rejected_requests", "Requests refused with 429 (queue full)", registry=r)
        self.failed = Counter("celeris_failed_requests", "Engine requests ended with an error, by code "
                              "(no_progress: a denoising step committed nothing; engine_error)", ["code"],
                              registry=r)
        self.aborted = Counter("celeris_aborted_requests", "Engine requests aborted, by reason", ["reason"],
                               registry=r)

    def watch_drafts(self, engine) -> None:
        """Expose the engine's verified-decoding counters (read at scrape time), as vLLM reports speculative
        decoding: drafts checked and accepted in total and per draft position (1 = the first drafted token)."""
        self.registry.register(_DraftCollector(engine))

    def set_queue_stats(self, num_waiting: int, num_running: int) -> None:
        self.waiting.set(num_waiting)
        self.running.set(num_running)

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DraftCollector:
    """Prometheus collector over ``engine.drafter`` (``celeris.sampling.verified.VerifiedDecoder``)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []  # registered without a description: read only at collect time

    def collect(self):
        drafter = self.engine.drafter
        drafted = list(drafter.drafted) if drafter else []
        accepted = list(drafter.accepted) if drafter else []
        total_d = CounterMetricFamily("celeris_spec_decode_num_draft_tokens", "Draft tokens checked (verified decoding)")
        total_a = CounterMetricFamily("celeris_spec_decode_num_accepted_tokens",
                                      "Draft tokens accepted (verified decoding)")
        per_pos = CounterMetricFamily("celeris_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position", labels=["position"])
        total_d.add_metric([], sum(drafted))
        total_a.add_metric([], sum(accepted))
        for j, a in enumerate(accepted):
            per_pos.add_metric([str(j + 1)], a)
        yield from (total_d, total_a, per_pos)


class MetricsMiddleware:
    """Pure ASGI middleware counting responses by path and status (no buffering, so streams and
    disconnect detection are untouched). A request whose client left before a response is counted
    as status 499."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
        status: list[int] = []

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(path=label, status=str(status[0] if status else 499)).inc()
