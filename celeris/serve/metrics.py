"""Prometheus metrics of one server, in its own CollectorRegistry (so several apps can live in one process).

Names follow vLLM's where one exists: time to first token, end-to-end latency, output tokens,
waiting and running requests. ``celeris_request_nfe`` counts forward passes per answer (a CFG step
counts 2), the cost measure of a diffusion model.
"""

from __future__ import annotations

import copy

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
NFE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Paths that get their own label; anything else is "other", so scanners cannot blow up cardinality.
KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/responses",
               "/api/generate", "/api/chat", "/api/tags", "/api/show", "/api/ps", "/api/version")
KNOWN_PREFIXES = {"/v1/responses/": "/v1/responses/{response_id}"}  # one label for every id


class _Labelled:
    """A labelled metric with its ``model`` label bound: ``labels(code=...)`` adds the other labels."""

    def __init__(self, parent, model: str) -> None:
        self.parent, self.model = parent, model

    def labels(self, **labels: str):
        return self.parent.labels(model=self.model, **labels)


class ServerMetrics:
    """The server's counters, histograms and gauges (all thread-safe; the engine thread sets the gauges).

    Every per-model series carries a ``model`` label (the served model name): one registry serves all the
    models of a server (``celeris serve --also-serve``); ``for_model(name)`` is a view whose attributes record
    into that model's series. HTTP request counts (``celeris_http_requests``) are per server, without it.
    """

    def __init__(self, registry: CollectorRegistry | None = None, model: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        m = ["model"]
        self.requests = Counter("celeris_http_requests", "HTTP requests by path and status code",
                                ["path", "status"], registry=r)
        self._ttft = Histogram("celeris_time_to_first_token_seconds", "Arrival to the first final answer text", m,
                               buckets=LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("celeris_e2e_request_latency_seconds", "Arrival to the full answer (successful requests)",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self._output_tokens = Counter("celeris_output_tokens", "Answer tokens returned to clients", m, registry=r)
        self._prompt_tokens = Counter("celeris_prompt_tokens", "Prompt (and suffix) tokens of finished requests", m,
                                      registry=r)
        self._nfe = Histogram("celeris_request_nfe", "Forward passes per answer (a CFG step counts 2)", m,
                              buckets=NFE_BUCKETS, registry=r)
        self._waiting = Gauge("celeris_num_requests_waiting", "Requests queued in the engine", m, registry=r)
        self._running = Gauge("celeris_num_requests_running", "Requests being denoised", m, registry=r)
        self._rejected = Counter("celeris_rejected_requests", "Requests refused with 429 (queue full)", m, registry=r)
        self._failed = Counter("celeris_failed_requests", "Engine requests ended with an error, by code "
                               "(no_progress: a denoising step committed nothing; invalid_output: a constrained "
                               "answer ended without validating; engine_error)", ["code", *m],
                               registry=r)
        self._aborted = Counter("celeris_aborted_requests", "Engine requests aborted, by reason", ["reason", *m],
                                registry=r)
        self._drafts = _DraftCollector()
        r.register(self._drafts)
        if model is not None:  # else only the HTTP counts until for_model (no empty-named series)
            self._bind(model)

    def _bind(self, model: str) -> None:
        self.model = model
        self.ttft, self.e2e = self._ttft.labels(model=model), self._e2e.labels(model=model)
        self.output_tokens = self._output_tokens.labels(model=model)
        self.prompt_tokens = self._prompt_tokens.labels(model=model)
        self.nfe = self._nfe.labels(model=model)
        self.waiting, self.running = self._waiting.labels(model=model), self._running.labels(model=model)
        self.rejected = self._rejected.labels(model=model)
        self.failed, self.aborted = _Labelled(self._failed, model), _Labelled(self._aborted, model)

    def for_model(self, model: str) -> ServerMetrics:
        """A view on the same registry whose per-model series carry ``model="<model>"``."""
        view = copy.copy(self)
        view._bind(model)
        return view

    def watch_drafts(self, engine) -> None:
        """Expose the engine's verified-decoding counters (read at scrape time), as vLLM reports speculative
        decoding: drafts checked and accepted in total and per draft position (1 = the first drafted token)."""
        self._drafts.engines[self.model] = engine

    def set_queue_stats(self, num_waiting: int, num_running: int) -> None:
        self.waiting.set(num_waiting)
        self.running.set(num_running)

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DraftCollector:
    """Prometheus collector over each model's ``engine.stats()`` (``celeris.engine.engine.EngineStats``): the
    verified path's draft counters and the engine prefix cache's counters."""

    def __init__(self) -> None:
        self.engines: dict[str, object] = {}  # model name -> engine

    def describe(self) -> list:
        return []  # registered without a description: read only at collect time

    def collect(self):
        total_d = CounterMetricFamily("celeris_spec_decode_num_draft_tokens", "Draft tokens checked (verified decoding)",
                                      labels=["model"])
        total_a = CounterMetricFamily("celeris_spec_decode_num_accepted_tokens",
                                      "Draft tokens accepted (verified decoding)", labels=["model"])
        per_pos = CounterMetricFamily("celeris_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position", labels=["position", "model"])
        queries = CounterMetricFamily("celeris_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(vLLM's prefix_cache_queries)", labels=["model"])
        hits = CounterMetricFamily("celeris_prefix_cache_hits", "Prompt tokens whose keys/values came from the prefix "
                                   "cache (vLLM's prefix_cache_hits)", labels=["model"])
        for model, engine in list(self.engines.items()):
            stats = engine.stats()  # celeris.engine.engine.EngineStats
            queries.add_metric([model], stats.prefix_cache_queries)
            hits.add_metric([model], stats.prefix_cache_hits)
            total_d.add_metric([model], sum(stats.drafted))
            total_a.add_metric([model], sum(stats.accepted))
            for j, a in enumerate(stats.accepted):
                per_pos.add_metric([str(j + 1), model], a)
        yield from (total_d, total_a, per_pos, queries, hits)


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
        label = path if path in KNOWN_PATHS else next(
            (name for prefix, name in KNOWN_PREFIXES.items() if path.startswith(prefix)), "other")
        status: list[int] = []

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(path=label, status=str(status[0] if status else 499)).inc()
