"""The proxy's own metrics (``GET /metrics``), before the backend's."""

from __future__ import annotations

from aegaeon_proxy.prom import Counter, Gauge, Histogram, Metric

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TBT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    """Counters and histograms updated by the handlers; rendered as Prometheus text."""

    def __init__(self) -> None:
        self.requests = Counter(
            "aegaeon_proxy_requests_total",
            "HTTP requests by endpoint and status",
            ("endpoint", "status"),
        )
        self.finished = Counter(
            "aegaeon_proxy_finished_total",
            "Generations by model and finish reason",
            ("model", "reason"),
        )
        self.prompt_tokens = Counter(
            "aegaeon_proxy_prompt_tokens_total", "Prompt tokens of accepted requests", ("model",)
        )
        self.generation_tokens = Counter(
            "aegaeon_proxy_generation_tokens_total", "Generated tokens received", ("model",)
        )
        self.in_flight = Gauge(
            "aegaeon_proxy_requests_in_flight", "Generations submitted and not finished", ("model",)
        )
        self.ttft = Histogram(
            "aegaeon_proxy_ttft_seconds", "Time to first token", TTFT_BUCKETS_S, ("model",)
        )
        self.tbt = Histogram(
            "aegaeon_proxy_tbt_seconds", "Time between tokens", TBT_BUCKETS_S, ("model",)
        )
        self.e2e = Histogram(
            "aegaeon_proxy_e2e_seconds", "Request latency, arrival to last token", E2E_BUCKETS_S,
            ("model",),
        )  # fmt: skip

    def all(self) -> list[Metric]:
        return [
            self.requests, self.finished, self.prompt_tokens, self.generation_tokens,
            self.in_flight, self.ttft, self.tbt, self.e2e,
        ]  # fmt: skip

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
