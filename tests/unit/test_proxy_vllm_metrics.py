"""vLLM's metric families (``vllm:*``): what a generation observes, the gauges a scrape
reads, the engine steps a backend reports; and through the HTTP front."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aegaeon_common.messages.structs import RequestTimings, SamplingParams
from aegaeon_proxy.backend import (
    EngineSnapshot,
    GenerationRequest,
    TokenChunk,
    TokenQueue,
)
from aegaeon_proxy.cluster.tracked import Tracked, deliver
from aegaeon_proxy.metrics import ProxyMetrics
from aegaeon_sched import Request
from http_support import Samples, samples_of
from prometheus_client import CollectorRegistry, generate_latest
from proxy_support import MODEL, ScriptedBackend, front, scripted_config


def _of(samples: Samples, name: str, model: str = "m", **labels: str) -> float:
    key = tuple(sorted({"model_name": model, **labels}.items()))
    return samples[(name, key)]


def _scrape(metrics: ProxyMetrics) -> Samples:
    return samples_of(generate_latest(metrics.registry).decode())


def test_a_generation_moves_from_waiting_to_running_and_is_observed_once() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    vllm = metrics.vllm
    rec = vllm.request("m", prompt_tokens=7, max_tokens=16, start=100.0)
    s = _scrape(metrics)
    assert _of(s, "vllm:num_requests_waiting") == 1
    assert _of(s, "vllm:num_requests_running") == 0
    rec.tokens(1, 100.5)  # first token: TTFT 0.5 s, its prompt counted
    rec.tokens(2, 100.7)  # two more: 0.1 s apart each
    s = _scrape(metrics)
    assert (_of(s, "vllm:num_requests_waiting"), _of(s, "vllm:num_requests_running")) == (0, 1)
    assert _of(s, "vllm:prompt_tokens_total") == 7
    assert _of(s, "vllm:generation_tokens_total") == 3
    assert _of(s, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert _of(s, "vllm:inter_token_latency_seconds_count") == 2
    assert abs(_of(s, "vllm:inter_token_latency_seconds_sum") - 0.2) < 1e-9
    assert _of(s, "vllm:time_per_output_token_seconds_count") == 2
    timings = RequestTimings(prefill_wait_s=0.3, prefill_s=0.15)
    rec.end("length", 100.8, timings)
    rec.end("length", 101.0, timings)  # idempotent
    s = _scrape(metrics)
    assert (_of(s, "vllm:num_requests_waiting"), _of(s, "vllm:num_requests_running")) == (0, 0)
    assert _of(s, "vllm:request_success_total", finished_reason="length") == 1
    assert _of(s, "vllm:request_success_total", finished_reason="stop") == 0
    assert abs(_of(s, "vllm:e2e_request_latency_seconds_sum") - 0.8) < 1e-9
    assert _of(s, "vllm:request_queue_time_seconds_sum") == 0.3
    assert _of(s, "vllm:time_in_queue_requests_sum") == 0.3
    assert _of(s, "vllm:request_prefill_time_seconds_sum") == 0.15
    assert abs(_of(s, "vllm:request_decode_time_seconds_sum") - 0.2) < 1e-9
    assert abs(_of(s, "vllm:request_inference_time_seconds_sum") - 0.35) < 1e-9
    assert abs(_of(s, "vllm:request_time_per_output_token_seconds_sum") - 0.1) < 1e-9
    assert _of(s, "vllm:request_prompt_tokens_sum") == 7
    assert _of(s, "vllm:request_generation_tokens_sum") == 3
    assert _of(s, "vllm:request_max_num_generation_tokens_sum") == 3
    assert _of(s, "vllm:request_params_n_sum") == 1
    assert _of(s, "vllm:request_params_max_tokens_sum") == 16
    assert _of(s, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert _of(s, "vllm:request_prompt_tokens_bucket", le="5.0") == 0


def test_endings_map_to_vllm_finished_reasons_and_only_completions_are_timed() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    for outcome in ("stop", "client_closed", "timeout", "cancelled", "error"):
        rec = metrics.vllm.request("m", 3, 4, start=0.0)
        rec.tokens(1, 1.0)
        rec.end(outcome, 2.0)
    never = metrics.vllm.request("m", 3, 4, start=0.0)  # ended before any token
    never.end("client_closed", 1.0)
    s = _scrape(metrics)
    reasons = {r: _of(s, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error")}  # fmt: skip
    assert reasons == {"stop": 1, "length": 0, "abort": 4, "error": 1}
    assert _of(s, "vllm:e2e_request_latency_seconds_count") == 1
    assert _of(s, "vllm:request_queue_time_seconds_count") == 0  # no instance timings
    assert (_of(s, "vllm:num_requests_waiting"), _of(s, "vllm:num_requests_running")) == (0, 0)


def test_gauges_cover_every_served_model_and_read_the_engine_snapshot() -> None:
    metrics = ProxyMetrics(CollectorRegistry())

    class Engine:
        async def engine_snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(device_kv_used_bytes=25, device_kv_capacity_bytes=100,
                                  host_kv_used_bytes=1, host_kv_capacity_bytes=4)  # fmt: skip

    gauges = metrics.vllm_gauges
    s = _scrape(metrics)  # before any refresh: no KV usage known, nothing served
    assert not [k for k in s if k[0] == "vllm:kv_cache_usage_perc"]
    gauges.attach(lambda: ["a", "b"], Engine().engine_snapshot, "bfloat16")
    asyncio.run(gauges.refresh())
    s = _scrape(metrics)
    for model in ("a", "b"):
        assert _of(s, "vllm:kv_cache_usage_perc", model) == 0.25
        assert _of(s, "vllm:gpu_cache_usage_perc", model) == 0.25
        assert _of(s, "vllm:cpu_cache_usage_perc", model) == 0.25
        assert _of(s, "vllm:num_requests_waiting", model) == 0
        assert _of(s, "vllm:num_requests_swapped", model) == 0
        assert _of(s, "vllm:num_preemptions_total", model) == 0
        assert _of(s, "vllm:prefix_cache_queries_total", model) == 0
        assert _of(s, "vllm:gpu_prefix_cache_hit_rate", model) == 0
        assert _of(s, "vllm:time_to_first_token_seconds_count", model) == 0  # served: at 0
        assert _of(s, "vllm:request_success_total", model, finished_reason="stop") == 0
    key = ("vllm:cache_config_info", (("cache_dtype", "bfloat16"),
                                      ("enable_prefix_caching", "False")))  # fmt: skip
    assert s[key] == 1


def _tracked(request_id: str, model: str, prompt_len: int, queue: TokenQueue) -> Tracked:
    gen = GenerationRequest(request_id, model, tuple(range(prompt_len)),
                            SamplingParams(max_tokens=8), 0.0)
    sched = Request(request_id, model, 0.0, prompt_len, 8)
    return Tracked(gen, sched, queue)


async def test_the_finishing_chunk_carries_the_merged_timings() -> None:
    tracked = _tracked("r", "m", 3, TokenQueue())
    tracked.prefill_timings = RequestTimings(prefill_wait_s=0.2, prefill_s=0.1)
    deliver(tracked, [1, 2], None)
    deliver(tracked, [3, 4], "stop", RequestTimings(decode_s=0.5))
    chunks = [c async for c in tracked.queue]
    assert [c.token_ids for c in chunks] == [(1, 2), (3, 4)]  # as the instance sent them
    assert chunks[0].timings is None
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.timings is not None
    assert (last.timings.prefill_wait_s, last.timings.prefill_s) == (0.2, 0.1)
    assert last.timings.decode_s == 0.5


async def test_vllm_families_through_the_http_front(proxy_market: Path) -> None:
    """A completion through the front (a scripted backend whose last chunk carries the
    instances' timings), then /metrics: every request family of the model moved."""

    class Timed(ScriptedBackend):
        async def _play(self, queue: TokenQueue, req: GenerationRequest) -> None:
            timings = RequestTimings(prefill_wait_s=0.01, prefill_s=0.02)
            for i, token_id in enumerate(self.token_ids):
                await asyncio.sleep(0.001)
                last = i == len(self.token_ids) - 1
                queue.push(TokenChunk((token_id,), self.finish if last else None,
                                      timings=timings if last else None))  # fmt: skip

        async def engine_snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(device_kv_used_bytes=1, device_kv_capacity_bytes=2)

    backend = Timed()
    backend.token_ids = [5, 6, 7, 8]
    async with front(scripted_config(proxy_market), backend) as client:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        assert (await client.post("/v1/completions", json=body)).status == 200
        s = samples_of(await (await client.get("/metrics")).text())
    assert _of(s, "vllm:request_success_total", MODEL, finished_reason="length") == 1
    assert _of(s, "vllm:generation_tokens_total", MODEL) == 4
    assert _of(s, "vllm:prompt_tokens_total", MODEL) > 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_max_tokens"):  # fmt: skip
        assert _of(s, f"vllm:{name}_count", MODEL) == 1, name
    assert _of(s, "vllm:inter_token_latency_seconds_count", MODEL) == 3
    assert _of(s, "vllm:request_queue_time_seconds_sum", MODEL) == 0.01
    assert _of(s, "vllm:kv_cache_usage_perc", MODEL) == 0.5
    assert _of(s, "vllm:num_requests_running", MODEL) == 0

