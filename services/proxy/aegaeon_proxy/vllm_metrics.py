"""vLLM's metric families (``vllm:*``, labelled ``model_name``) beside the native ones.

Dashboards, autoscaler rules (KEDA, HPA) and the Gateway API Inference
Extension's endpoint picker read the names vLLM exports; this module exports
them from what Aegaeon measures, one series per served model. What each means
here, and where that differs from vLLM, is in ``docs/operations.md``.

* Request families (counters and histograms) are observed by the HTTP front,
  one :class:`VllmRequest` per generation (``aegaeon_proxy.generation``): the
  same code whichever backend serves, one proxy or many. The queue and prefill
  times come from the instances' own measurements (the finishing chunk's
  ``timings``); the rest from the times tokens reach the front.
* Gauges are read at scrape time (:class:`VllmGauges`): requests waiting and
  running from the front's counts, KV usage from the backend's
  :class:`~aegaeon_proxy.backend.EngineSnapshot` (``refresh`` before a scrape).
* ``vllm:iteration_tokens_total`` (tokens per engine step) comes from the
  instances' reports, so a backend feeds it (:class:`EngineSteps`).

Families vLLM exports only for features Aegaeon does not have (prefix caching,
preemption to the waiting queue) are exported at 0 so that queries over them
answer; those vLLM itself exports only when configured (speculative decoding,
detailed traces) are not. ``vllm:lora_requests_info`` is, as vLLM's, while LoRA
adapters are served: its labels name the adapters with requests running and
waiting, ``max_lora`` the adapters that may share a step (every served one).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

from aegaeon_common.messages.structs import RequestTimings
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.backend import EngineSnapshot

__all__ = ["FINISHED_REASONS", "EngineSteps", "VllmGauges", "VllmMetrics", "VllmRequest"]

LABEL = "model_name"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles read the same
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                           1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                             7680.0)  # fmt: skip
# vLLM's 1-2-5 series up to the model's window; one family serves every model here,
# so up to a million tokens
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

# metrics.OUTCOMES -> vLLM's finished_reason; rejected requests never started
FINISHED_REASONS: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "cancelled": "abort",
    "client_closed": "abort",
    "timeout": "abort",
    "error": "error",
}
COMPLETED = frozenset({"stop", "length"})


class VllmMetrics:
    """The request families; :meth:`request` makes one generation's recorder."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._per_model: list[Counter | Histogram] = []  # the families :meth:`serve` starts
        c, h = self._counter, self._histogram
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens",
                                   "Number of generation tokens processed.")  # fmt: skip
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (LABEL, "finished_reason"), registry=registry,
        )  # fmt: skip
        self.ttft = h("vllm:time_to_first_token_seconds",
                      "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)  # fmt: skip
        self.itl = h("vllm:inter_token_latency_seconds",
                     "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS_S)
        self.tpot = h("vllm:time_per_output_token_seconds",
                      "Histogram of time per output token in seconds (the inter-token latency).",
                      TOKEN_LATENCY_BUCKETS_S)  # fmt: skip
        self.request_tpot = h("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TOKEN_LATENCY_BUCKETS_S)  # fmt: skip
        self.e2e = h("vllm:e2e_request_latency_seconds",
                     "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS_S)
        self.queue = h("vllm:request_queue_time_seconds",
                       "Histogram of time spent in WAITING phase for request.",
                       REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.time_in_queue = h("vllm:time_in_queue_requests",
                               "Histogram of time the request spent in the queue in seconds.",
                               REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.inference = h("vllm:request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.",
                           REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.prefill = h("vllm:request_prefill_time_seconds",
                         "Histogram of time spent in PREFILL phase for request.",
                         REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.decode = h("vllm:request_decode_time_seconds",
                        "Histogram of time spent in DECODE phase for request.",
                        REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.prompt_len = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                            TOKEN_COUNT_BUCKETS)  # fmt: skip
        self.generation_len = h("vllm:request_generation_tokens",
                                "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS)
        self.max_generation_len = h("vllm:request_max_num_generation_tokens",
                                    "Histogram of maximum number of requested generation tokens.",
                                    TOKEN_COUNT_BUCKETS)  # fmt: skip
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.",
                          N_BUCKETS)  # fmt: skip
        self.params_max_tokens = h("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.",
                                   TOKEN_COUNT_BUCKETS)  # fmt: skip
        # generations open at the front, by model: [waiting for a first token, running]
        self.open: dict[str, list[int]] = {}
        self._served: set[str] = set()

    def _counter(self, name: str, doc: str) -> Counter:
        family = Counter(name, doc, (LABEL,), registry=self.registry)
        self._per_model.append(family)
        return family

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        family = Histogram(name, doc, (LABEL,), buckets=buckets, registry=self.registry)
        self._per_model.append(family)
        return family

    def serve(self, model: str) -> None:
        """Make ``model``'s series exist (at 0) before its first request."""
        if model in self._served:
            return
        self._served.add(model)
        for family in self._per_model:
            family.labels(model)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model, reason)

    def request(self, model: str, prompt_tokens: int, max_tokens: int, start: float
                ) -> VllmRequest:  # fmt: skip
        """A generation just submitted (``start``: its arrival, ``time.monotonic()``)."""
        self.serve(model)
        self.open.setdefault(model, [0, 0])[0] += 1
        return VllmRequest(self, model, prompt_tokens, max_tokens, start)


class VllmRequest:
    """One generation's observations (the front calls :meth:`tokens` as tokens
    arrive and :meth:`end` once, whatever way it ended)."""

    def __init__(self, metrics: VllmMetrics, model: str, prompt_tokens: int, max_tokens: int,
                 start: float) -> None:  # fmt: skip
        self._m = metrics
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.start = start
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.num_tokens = 0
        self._open = True

    def tokens(self, n: int, now: float) -> None:
        """``n`` tokens reached the front at ``now`` (monotonic)."""
        if n <= 0:
            return
        m, model = self._m, self.model
        if self.first_at is None:
            self.first_at = now
            m.ttft.labels(model).observe(now - self.start)
            m.prompt_tokens.labels(model).inc(self.prompt_tokens)  # its prefill is done
            if self._open:
                counts = m.open[model]
                counts[0] -= 1
                counts[1] += 1
        elif self.last_at is not None:
            per_token = (now - self.last_at) / n
            itl, tpot = m.itl.labels(model), m.tpot.labels(model)
            for _ in range(n):
                itl.observe(per_token)
                tpot.observe(per_token)
        self.last_at = now
        self.num_tokens += n
        m.generation_tokens.labels(model).inc(n)

    def end(self, outcome: str, now: float, timings: RequestTimings | None = None) -> None:
        """It ended (``outcome``: one of ``metrics.OUTCOMES``); idempotent."""
        if not self._open:
            return
        self._open = False
        m, model = self._m, self.model
        m.open[model][0 if self.first_at is None else 1] -= 1
        reason = FINISHED_REASONS.get(outcome)
        if reason is not None:
            m.success.labels(model, reason).inc()
        if outcome not in COMPLETED:
            return
        m.e2e.labels(model).observe(now - self.start)
        m.prompt_len.labels(model).observe(self.prompt_tokens)
        m.generation_len.labels(model).observe(self.num_tokens)
        m.max_generation_len.labels(model).observe(self.num_tokens)  # n is always 1
        m.params_n.labels(model).observe(1)
        m.params_max_tokens.labels(model).observe(self.max_tokens)
        first, last = self.first_at, self.last_at
        decode_s = last - first if first is not None and last is not None else 0.0
        m.decode.labels(model).observe(decode_s)
        if self.num_tokens > 1:
            m.request_tpot.labels(model).observe(decode_s / (self.num_tokens - 1))
        if timings is not None:  # the instances' measurements (arrival -> prefill start)
            m.queue.labels(model).observe(timings.prefill_wait_s)
            m.time_in_queue.labels(model).observe(timings.prefill_wait_s)
            m.prefill.labels(model).observe(timings.prefill_s)
            m.inference.labels(model).observe(timings.prefill_s + decode_s)


class EngineSteps:
    """``vllm:iteration_tokens_total``: tokens per engine step, fed by a backend from
    its instances' reports (a prefill is one step of the prompt's tokens, batch 1;
    a decode report of a batch that bundles k steps counts as k equal steps)."""

    def __init__(self) -> None:
        self.histogram = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            (LABEL,), buckets=ITERATION_BUCKETS, registry=None,
        )  # fmt: skip

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.histogram)

    def prefill(self, model: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self.histogram.labels(model).observe(num_tokens)

    def decode(self, model: str, tokens_per_request: Sequence[int]) -> None:
        """One report of a batch: each request's new tokens."""
        steps = max(tokens_per_request, default=0)
        if steps <= 0:
            return
        per_step = sum(tokens_per_request) / steps
        child = self.histogram.labels(model)
        for _ in range(steps):
            child.observe(per_step)


def _ratio(used: int | None, capacity: int | None) -> float | None:
    if used is None or not capacity:
        return None
    return min(1.0, max(0.0, used / capacity))


class VllmGauges(Collector):
    """The gauges (and the constant families), read at scrape time: requests by
    state from the front's counts, KV usage from the backend's last
    :class:`EngineSnapshot` (taken by :meth:`refresh` before each scrape)."""

    def __init__(self, metrics: VllmMetrics) -> None:
        self._m = metrics
        self._models: Callable[[], Iterable[str]] = tuple
        self._adapters: Callable[[], Iterable[str]] = tuple
        self._engine: Callable[[], Awaitable[EngineSnapshot | None]] | None = None
        self._cache_dtype = ""
        self.snapshot: EngineSnapshot | None = None

    def attach(self, models: Callable[[], Iterable[str]],
               engine: Callable[[], Awaitable[EngineSnapshot | None]], cache_dtype: str,
               adapters: Callable[[], Iterable[str]] = tuple) -> None:  # fmt: skip
        """Where to read from: the served models' names, the backend's snapshot of its
        instances' memory (None: not known), the dtype of the KV cache, the served LoRA
        adapters."""
        self._models = models
        self._adapters = adapters
        self._engine = engine
        self._cache_dtype = cache_dtype

    async def refresh(self) -> None:
        """Take the backend's snapshot; give every served model its series."""
        for model in self._models():
            self._m.serve(model)
        if self._engine is not None:
            self.snapshot = await self._engine()

    def collect(self) -> Iterator[Metric]:
        names = sorted(set(self._models()) | set(self._m.open))
        snap = self.snapshot

        def gauge(name: str, doc: str, value: Callable[[str], float | None]) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=[LABEL])
            for model in names:
                v = value(model)
                if v is not None:
                    family.add_metric([model], v)
            return family

        def counts(model: str) -> list[int]:
            return self._m.open.get(model, [0, 0])

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    lambda m: float(counts(m)[1]))  # fmt: skip
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    lambda m: float(counts(m)[0]))  # fmt: skip
        yield gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU (always 0).",
                    lambda m: 0.0)  # fmt: skip
        device = _ratio(snap.device_kv_used_bytes, snap.device_kv_capacity_bytes) if snap else None
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    lambda m: device)  # fmt: skip
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            lambda m: device,
        )
        host = _ratio(snap.host_kv_used_bytes, snap.host_kv_capacity_bytes) if snap else None
        yield gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.",
                    lambda m: host)  # fmt: skip
        for name in ("gpu", "cpu"):
            yield gauge(f"vllm:{name}_prefix_cache_hit_rate",
                        f"{name.upper()} prefix cache block hit rate (no prefix cache: 0).",
                        lambda m: 0.0)  # fmt: skip
        for name, doc in (
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
             "tokens."),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            ("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries. DEPRECATED: Use "
             "vllm:prefix_cache_queries instead."),
            ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits. DEPRECATED: Use "
             "vllm:prefix_cache_hits instead."),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=[LABEL])
            for model in names:
                family.add_metric([model], 0.0)
            yield family
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["cache_dtype", "enable_prefix_caching"],
        )
        info.add_metric([self._cache_dtype, "False"], 1.0)
        yield info
        adapters = sorted(self._adapters())
        if adapters:  # vLLM's, with LoRA enabled: the value is when it was read
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            waiting = ",".join(a for a in adapters if counts(a)[0] > 0)
            running = ",".join(a for a in adapters if counts(a)[1] > 0)
            lora.add_metric([str(len(adapters)), waiting, running], time.time())
            yield lora
