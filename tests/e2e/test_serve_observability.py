"""Every service's /health, /ready and /metrics through `aegaeon serve`, and a rolling
restart of each worker kind under a steady stream of requests that loses nothing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

from http_support import get_text, metric_samples, sample_sum
from serve_harness import Served, until

IN_FLIGHT = 32  # the rolling restart's load: requests at once, at most


def _services(served: Served) -> dict[str, dict[str, str]]:
    data = served.get_json("/v1/aegaeon/services")
    return {s["name"]: s for s in data["services"]}  # type: ignore[union-attr,index]


def _models(served: Served) -> list[str]:
    return [m.id for m in served.client().models.list().data][:3]


def test_services_list_every_service_with_working_urls(served: Served) -> None:
    services = _services(served)
    assert list(services) == ["proxy", "cachemgr", "prefill-0", "decode-0"]
    for name, service in services.items():
        assert set(service) == {"name", "role", "health_url", "ready_url", "metrics_url"}
        assert service["role"] == name.split("-")[0]
        status, body = get_text(service["health_url"])
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert get_text(service["ready_url"])[0] == 200
        samples = metric_samples(service["metrics_url"])
        assert ("process_resident_memory_bytes", ()) in samples, name
        assert ("process_open_fds", ()) in samples, name
    assert "metrics http://" in served.log_path.read_text()  # serve printed them


def test_request_counters_equal_the_requests_sent(served: Served) -> None:
    services = _services(served)
    urls = {name: s["metrics_url"] for name, s in services.items()}
    before = {name: metric_samples(url) for name, url in urls.items()}
    models = _models(served)
    sent = Counter(m for m in models for _ in range(2))
    client = served.client()
    threads = [
        threading.Thread(target=client.completions.create, kwargs={
            "model": m, "prompt": "Count with me", "max_tokens": 6, "temperature": 0,
            "extra_body": {"ignore_eos": True}})
        for m in sent.elements()
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    total = sum(sent.values())

    def delta(name: str, metric: str, **labels: str) -> float:
        return sample_sum(metric_samples(urls[name]), metric, **labels) - sample_sum(
            before[name], metric, **labels
        )

    for model, count in sent.items():
        assert delta("proxy", "aegaeon_requests_total", model=model, outcome="length") == count
        assert delta("proxy", "aegaeon_requests_total", model=model) == count
    workers = ["prefill-0", "decode-0"]
    # each request is prefilled once and decoded to its length once, on some instance
    deadline = time.monotonic() + 10
    while True:
        prefilled = sum(delta(w, "aegaeon_instance_requests_total", stage="prefill",
                              outcome="ok") for w in workers)  # fmt: skip
        decoded = sum(delta(w, "aegaeon_instance_requests_total", stage="decode",
                            outcome="length") for w in workers)  # fmt: skip
        if (prefilled, decoded) == (total, total) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (prefilled, decoded) == (total, total)
    # every decoded request's KV blocks moved to its decode instance: the instance
    # takes them over itself when it accepts the request (the proxy never does)
    claims = delta("cachemgr", "aegaeon_cachemgr_requests_total",
                   type="cache.reassign_blocks", outcome="ok")  # fmt: skip
    assert claims == total
    proxy = metric_samples(urls["proxy"])
    for model in sent:
        assert sample_sum(proxy, "aegaeon_ttft_seconds_count", model=model) >= sent[model]
        assert 0.0 <= sample_sum(proxy, "aegaeon_slo_attainment_ratio", model=model) <= 1.0
    assert sample_sum(proxy, "aegaeon_instance_up") == 2
    # no prompt text (nor the client's API key) in any service's log
    for log in served.run_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Count with me" not in text and "Bearer" not in text, log.name


# vLLM's families the proxy exports beside its own (docs/operations.md), by type
VLLM_COUNTERS = (
    "prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "gpu_prefix_cache_queries",
    "gpu_prefix_cache_hits",
)  # fmt: skip
VLLM_GAUGES = (
    "num_requests_running", "num_requests_waiting", "num_requests_swapped",
    "kv_cache_usage_perc", "gpu_cache_usage_perc", "cpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate", "cpu_prefix_cache_hit_rate",
)  # fmt: skip
# histograms every completed request is observed in, once
VLLM_REQUEST_HISTOGRAMS = (
    "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "time_in_queue_requests", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n",
    "request_params_max_tokens",
)  # fmt: skip
# histograms observed per token or per engine step
VLLM_STEP_HISTOGRAMS = (
    "inter_token_latency_seconds", "time_per_output_token_seconds", "iteration_tokens_total",
)  # fmt: skip


def test_vllm_families_after_traffic(served: Served) -> None:
    """Every vllm:* family on the proxy's /metrics, one series per served model
    (model_name), moved by the traffic sent and with sane values."""
    url = _services(served)["proxy"]["metrics_url"]
    before = metric_samples(url)
    models = _models(served)[:2]
    client = served.client()
    max_tokens = 5
    for model in models:  # one streamed, one not, per model
        client.completions.create(model=model, prompt="Count with me", max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        chunks = client.completions.create(
            model=model, prompt="Count with me too", max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert sum(1 for _ in chunks) >= max_tokens
    after = metric_samples(url)

    def delta(name: str, **labels: str) -> float:
        return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)

    served_models = _models(served)
    for model in served_models:  # one series per served model, traffic or not
        for name in VLLM_GAUGES:
            assert (f"vllm:{name}", (("model_name", model),)) in after, (name, model)
        for name in VLLM_COUNTERS:
            assert sample_sum(after, f"vllm:{name}_total", model_name=model) >= 0, (name, model)
            assert any(n == f"vllm:{name}_total" and dict(lbl).get("model_name") == model
                       for n, lbl in after), (name, model)  # fmt: skip
    for model in models:
        sent = 2
        assert delta("vllm:request_success_total", model_name=model, finished_reason="length") \
            == sent
        assert delta("vllm:generation_tokens_total", model_name=model) == sent * max_tokens
        assert delta("vllm:prompt_tokens_total", model_name=model) >= sent
        for name in VLLM_REQUEST_HISTOGRAMS:
            assert delta(f"vllm:{name}_count", model_name=model) == sent, (name, model)
            assert delta(f"vllm:{name}_sum", model_name=model) >= 0, (name, model)
        for name in VLLM_STEP_HISTOGRAMS:
            assert delta(f"vllm:{name}_count", model_name=model) >= sent, (name, model)
        assert delta("vllm:request_generation_tokens_sum", model_name=model) == sent * max_tokens
        assert delta("vllm:request_params_max_tokens_sum", model_name=model) == sent * max_tokens
        # a latency is within the request's: queue + prefill <= TTFT <= e2e
        e2e = delta("vllm:e2e_request_latency_seconds_sum", model_name=model)
        ttft = delta("vllm:time_to_first_token_seconds_sum", model_name=model)
        queue = delta("vllm:request_queue_time_seconds_sum", model_name=model)
        prefill = delta("vllm:request_prefill_time_seconds_sum", model_name=model)
        assert 0 < ttft <= e2e
        assert prefill > 0 and queue + prefill <= ttft + 0.05 * sent  # wall vs monotonic clocks
        # every request finished: nothing running or waiting
        assert sample_sum(after, "vllm:num_requests_running", model_name=model) == 0
        assert sample_sum(after, "vllm:num_requests_waiting", model_name=model) == 0
    for model in served_models:
        for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc", "cpu_cache_usage_perc"):
            assert 0.0 <= after[(f"vllm:{name}", (("model_name", model),))] <= 1.0
    assert sample_sum(after, "vllm:cache_config_info") == 1


def _instance_pid(served: Served, name: str) -> int | None:
    health = served.get_json("/health")
    return health["backend"]["instances"][name]["pid"]  # type: ignore[index,no-any-return]


def _service_pids(served: Served) -> dict[str, int]:
    """Each service's pid, from its own /health."""
    out = {}
    for name, service in _services(served).items():
        status, body = get_text(service["health_url"])
        assert status == 200
        out[name] = int(json.loads(body)["pid"])
    return out


def test_rolling_restart_of_each_worker_kind_loses_nothing(served: Served) -> None:
    models = _models(served)
    client = served.client()
    results: list[tuple[str, object]] = []
    stop = threading.Event()
    # a new request every 0.1 s, at most IN_FLIGHT at once: while an instance restarts
    # on a slow machine the backlog stays bounded (not the node's admission limit)
    slots = threading.BoundedSemaphore(IN_FLIGHT)

    def one(i: int) -> None:
        try:
            reply = client.completions.create(
                model=models[i % len(models)], prompt=f"Request {i}", max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            choice = reply.choices[0]
            assert reply.usage is not None
            results.append((choice.finish_reason or "", reply.usage.completion_tokens))
        except Exception as exc:  # the test's point: count every failure
            results.append(("error", repr(exc)))
        finally:
            slots.release()

    def stream() -> None:
        workers: list[threading.Thread] = []
        i = 0
        while not stop.is_set():
            if not slots.acquire(timeout=0.1):
                continue
            t = threading.Thread(target=one, args=(i,))
            t.start()
            workers.append(t)
            i += 1
            time.sleep(0.1)
        for t in workers:
            t.join(timeout=180)

    feeder = threading.Thread(target=stream)
    feeder.start()
    try:
        for name in ("prefill-0", "decode-0"):
            time.sleep(1.5)  # requests in every stage when the signal comes
            pids = _service_pids(served)
            old = _instance_pid(served, name)
            assert old is not None and old == pids[name]
            os.kill(old, signal.SIGTERM)
            until(f"{name} came back",
                  lambda n=name, o=old: _instance_pid(served, n) not in (o, None), 120)
            ready = _services(served)[name]["ready_url"]  # its new address works
            until(f"{ready} ready", lambda u=ready: get_text(u)[0] == 200, 60)
            after = _service_pids(served)
            assert after[name] != old
            # it rejoined alone: no other service restarted
            assert {n: p for n, p in after.items() if n != name} == {
                n: p for n, p in pids.items() if n != name
            }
        time.sleep(1.5)
    finally:
        stop.set()
        feeder.join(timeout=240)
    errors = [r for r in results if r != ("length", 12)]
    assert len(results) > 30
    assert errors == []
    log = served.log_path.read_text()
    assert "child exited" in log  # drained and exited 0, then restarted
    assert "child died" not in log
