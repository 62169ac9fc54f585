"""Prometheus metrics for ``GET /metrics``, with prometheus_client and one registry per app.

Names follow llama-server's ``/metrics`` where they mean the same (``llamacpp:prompt_tokens_total`` counts
prompt tokens computed, cached ones apart; ``llamacpp:tokens_predicted_total``; ``llamacpp:n_decode_total``;
``llamacpp:requests_processing`` / ``requests_deferred``; ...), so dashboards made for llama-server work.
Flux's own are ``flux_*``: requests by outcome, error responses by status, time to first token and request duration (histograms),
worker restarts, the journal, refused connections.

Counters of finished requests are recorded as each request ends (:meth:`Metrics.finished`); gauges are
read when scraped from the service (:class:`_ServiceCollector`), with the worker's counters fetched once
per scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.generation import FinishStats
from server.kv_pages import PoolUse
from server.transport import Refusal

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Snapshot:
    """What the service reports at scrape time."""

    processing: int
    deferred: int
    worker_up: bool
    restarts: int
    journal_bytes: int
    journal_requests: int
    requests: Mapping[str, int]
    errors: Mapping[str, int]  # error responses by HTTP status
    worker: Mapping[str, Any] | None  # the worker's serve_stats (None while it is down)
    routing: Mapping[str, Any] | None = None  # server.routing_watch.RoutingWatch.report()
    pages: Sequence[PoolUse] = ()  # the KV page pools (server.kv_pages)


class _ServiceCollector(Collector):
    """Gauges and worker counters, read from the latest snapshot."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.snapshot: Snapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s, t = self.snapshot, self.totals
        if s is None:
            return
        w = s.worker or {}
        yield _counter("llamacpp:n_decode", "Total number of llama_decode() calls", w.get("steps", 0))
        yield _gauge("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)",
                     t["n_tokens_max"])
        yield _gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                     t["prompt_tokens"] / t["prompt_seconds"] if t["prompt_seconds"] else 0.0)
        yield _gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
                     t["predicted_tokens"] / t["predicted_seconds"] if t["predicted_seconds"] else 0.0)
        yield _gauge("llamacpp:requests_processing", "Number of requests processing", s.processing)
        yield _gauge("llamacpp:requests_deferred", "Number of requests deferred (waiting for a sequence)",
                     s.deferred)
        yield _gauge("flux_worker_up", "1 while the engine worker runs with the model loaded", int(s.worker_up))
        yield _counter("flux_worker_restarts", "Engine worker restarts", s.restarts)
        yield _gauge("flux_journal_bytes", "Bytes of journaled events (for resume)", s.journal_bytes)
        yield _gauge("flux_journal_requests", "Requests whose events are journaled", s.journal_requests)
        yield _gauge("flux_kv_bytes", "Bytes of KV cache the worker's sequences hold", w.get("kv_bytes", 0))
        parked = w.get("parked") or {}
        yield _gauge("flux_parked_bytes", "Bytes of conversation states parked in RAM", parked.get("bytes", 0))
        fam = CounterMetricFamily("flux_requests", "Requests by outcome", labels=["outcome"])
        for outcome, n in sorted(s.requests.items()):
            fam.add_metric([outcome], n)
        yield fam
        errors = CounterMetricFamily("flux_error_responses", "Error responses sent, by HTTP status", labels=["status"])
        for status, n in sorted(s.errors.items()):
            errors.add_metric([status], n)
        yield errors
        yield from _routing(s.routing or {})
        pages = GaugeMetricFamily("flux_kv_pages", "KV pages by pool and state (total, used, free)",
                                  labels=["pool", "state"])
        for u in s.pages:
            for state, n in (("total", u.pages_total), ("used", u.pages_used), ("free", u.pages_free)):
                pages.add_metric([u.name, state], n)
        yield pages


def _routing(r: Mapping[str, Any]) -> Iterator[Metric]:
    """The routing watch's gauges: shares only where the plan has per-expert GPU copies (else no series)."""
    if "sampled_tokens" in r:
        yield _counter("flux_routing_sampled_tokens", "Decode tokens whose expert picks were counted",
                       r["sampled_tokens"])
    shares = GaugeMetricFamily("flux_routing_hot_share", "Share of expert picks served by the plan's GPU copies: "
                               "the plan's (its planning trace), live (every counted pick), window (recent)",
                               labels=["source"])
    for source in ("plan", "live", "window"):
        value = r.get(f"{source}_share")
        if isinstance(value, float):
            shares.add_metric([source], value)
    yield shares


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The app's metrics: per-request counters and histograms, plus the service's gauges at scrape time."""

    def __init__(self, on_refused: Callable[[Refusal], None] | None = None) -> None:
        """A fresh registry (each app has its own: no module globals); ``on_refused`` is also told of each
        connection the transport answered or closed itself (the service counts and logs those)."""
        self._on_refused = on_refused
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding "
                                     "cached tokens", registry=r)
        self.prompt_cached = Counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the "
                                     "cache", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Total time spent processing prompts", registry=r)
        self.predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Total time spent generating tokens",
                                         registry=r)
        self.ttft = Histogram("flux_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("flux_request_duration_seconds", "From a request's arrival to its last token",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.refused_connections = Counter("flux_connections_refused", "Connections closed by a read timeout, "
                                           "malformed headers or the connection limit", ["reason"], registry=r)
        self._totals = {"prompt_tokens": 0.0, "prompt_seconds": 0.0, "predicted_tokens": 0.0,
                        "predicted_seconds": 0.0, "n_tokens_max": 0.0}
        self._service = _ServiceCollector(self._totals)
        r.register(self._service)

    def finished(self, s: FinishStats) -> None:
        """Record one finished generation."""
        computed = max(0, s.prompt_tokens - s.cached_tokens)
        self.prompt_tokens.inc(computed)
        self.prompt_cached.inc(s.cached_tokens)
        self.prompt_seconds.inc(s.prefill_s)
        self.predicted.inc(s.completion_tokens)
        self.predicted_seconds.inc(s.decode_s)
        t = self._totals
        t["prompt_tokens"] += computed
        t["prompt_seconds"] += s.prefill_s
        t["predicted_tokens"] += s.completion_tokens
        t["predicted_seconds"] += s.decode_s
        t["n_tokens_max"] = max(t["n_tokens_max"], s.prompt_tokens + s.completion_tokens)
        if s.ttft_s is not None:
            self.ttft.observe(s.ttft_s)
        self.duration.observe(s.duration_s)

    def refused(self, refusal: Refusal) -> None:
        """Count a connection the transport answered or closed itself (the ``on_refused`` hook of
        :func:`server.transport.guarded_protocol`), by its reason (``timeout``, ``malformed``,
        ``connections``)."""
        self.refused_connections.labels(reason=refusal.reason).inc()
        if self._on_refused is not None:
            self._on_refused(refusal)

    def render(self, snapshot: Snapshot) -> bytes:
        """The Prometheus text exposition, with ``snapshot``'s gauges."""
        self._service.snapshot = snapshot
        return generate_latest(self.registry)

