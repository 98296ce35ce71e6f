"""The proxy's metrics (``GET /metrics``): HTTP, requests, latency, SLO attainment.

Everything lives in the proxy's own registry (:func:`aegaeon_common.metrics.new_registry`);
the backend adds its collectors to it (``Backend.register_metrics``). vLLM's
families (``vllm:*``) are beside these (:mod:`aegaeon_proxy.vllm_metrics`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial

from aegaeon_common.metrics import E2E_BUCKETS_S, TBT_BUCKETS_S, TTFT_BUCKETS_S, new_registry
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.vllm_metrics import VllmGauges, VllmMetrics

__all__ = ["OUTCOMES", "ProxyMetrics", "UnavailableModels"]

# aegaeon_requests_total{outcome}: how a request accepted by the HTTP front ended.
OUTCOMES = (
    "stop",  # a stop token or string
    "length",  # max_tokens
    "rejected",  # refused at submit (429 overloaded, 503 unavailable or draining)
    "timeout",  # the request deadline (504)
    "error",  # the backend failed it
    "cancelled",  # cancelled by the server (shutdown)
    "client_closed",  # the client went away first
)


class ProxyMetrics:
    """Counters and histograms the HTTP front updates; read by a scrape."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        histogram = partial(Histogram, registry=r)
        self.http_requests = counter("aegaeon_proxy_http_requests",
                                     "HTTP requests by endpoint and status", ("endpoint", "status"))
        self.requests = counter("aegaeon_requests", "Generation requests by model and outcome",
                                ("model", "outcome"))  # fmt: skip
        self.prompt_tokens = counter("aegaeon_prompt_tokens", "Prompt tokens of accepted requests",
                                     ("model",))  # fmt: skip
        self.generation_tokens = counter("aegaeon_generation_tokens", "Generated tokens received",
                                         ("model",))  # fmt: skip
        self.in_flight = gauge("aegaeon_requests_in_flight",
                               "Generations submitted and not finished", ("model",))  # fmt: skip
        self.ttft = histogram("aegaeon_ttft_seconds", "Time to first token", ("model",),
                              buckets=TTFT_BUCKETS_S)  # fmt: skip
        self.tbt = histogram("aegaeon_tbt_seconds", "Time between tokens", ("model",),
                             buckets=TBT_BUCKETS_S)  # fmt: skip
        self.e2e = histogram("aegaeon_request_duration_seconds",
                             "Request latency, arrival to last token", ("model",),
                             buckets=E2E_BUCKETS_S)  # fmt: skip
        self.slo_tokens = counter(
            "aegaeon_slo_tokens",
            "Tokens by whether they met their deadline (arrival + TTFT + k x TBT); the "
            "tokens a failed request never produced count as missed", ("model", "met"),
        )  # fmt: skip
        self.attainment = gauge("aegaeon_slo_attainment_ratio",
                                "Share of tokens that met their deadlines, since start",
                                ("model",))  # fmt: skip
        # vLLM's families (vllm:*, by model_name), for dashboards and autoscalers made for it
        self.vllm = VllmMetrics(r)
        self.vllm_gauges = VllmGauges(self.vllm)
        r.register(self.vllm_gauges)
        self.num_open = 0  # generations submitted and not ended (the drain waits for 0)
        self._slo_counts: dict[str, list[int]] = {}  # model -> [met, total]
        self._lock = threading.Lock()

    def observe_slo(self, model: str, met: int, missed: int) -> None:
        """Count ``met`` and ``missed`` token deadlines of ``model``; update its attainment."""
        if met:
            self.slo_tokens.labels(model, "true").inc(met)
        if missed:
            self.slo_tokens.labels(model, "false").inc(missed)
        with self._lock:
            counts = self._slo_counts.setdefault(model, [0, 0])
            counts[0] += met
            counts[1] += met + missed
            if counts[1]:
                self.attainment.labels(model).set(counts[0] / counts[1])


class UnavailableModels(Collector):
    """``aegaeon_models_unavailable``: served models whose checkpoint cannot be read
    (their requests answered 503 ``model_unavailable``), read from the model table."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "aegaeon_models_unavailable",
            "Served models whose checkpoint cannot be read (503 model_unavailable until "
            "reloaded)", value=float(self._count()),
        )  # fmt: skip
