"""A real Prometheus scrapes a live node with the project's scrape config; after
traffic, every panel query of the project's Grafana dashboard and of vLLM's example
dashboard returns data (marked ``prometheus``: needs Debian's package, which
``scripts/prometheus --install-only`` installs; not in CI)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from aegaeon_bench.serve.prometheus import (
    DASHBOARD,
    Prometheus,
    dashboard_queries,
    fetch_services,
    finite_values,
    instantiate,
    running,
    write_targets,
)
from serve_harness import Served, free_port, until

pytestmark = pytest.mark.prometheus

VLLM_QUERIES = Path(__file__).resolve().parents[1] / "data" / "vllm-dashboard-queries.json"
RATE_INTERVAL = "5m"  # covers the whole test: every rate sees all of its traffic
SCRAPE_INTERVAL = "1s"


@pytest.fixture(scope="module")
def prometheus(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    directory = tmp_path_factory.mktemp("prometheus")
    write_targets(directory, fetch_services(served.url))
    with running(directory, free_port(), SCRAPE_INTERVAL) as server:
        yield server


def _traffic(served: Served, scraped: Callable[[list[str]], None]) -> str:
    """Completed and streamed requests to every model, one its client leaves, one past
    its deadline (the dashboard's error panel); returns the model they all reached."""
    client = served.client()
    models = [m.id for m in client.models.list().data]

    def one(model: str, i: int) -> None:
        client.completions.create(model=model, prompt=f"count {i}:", max_tokens=8 + i)
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=12, stream=True,
        )  # fmt: skip
        for _ in stream:
            pass

    # every model's series exist before most of the traffic: a rate needs the counters
    # to rise between two scrapes, not to appear with their final values
    for model in models:
        one(model, 0)
    scraped(models)
    threads = [threading.Thread(target=one, args=(m, i)) for i in range(1, 3) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # one request cancelled by its client after its first token
    stream = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "a long story"}],
        max_tokens=200, stream=True,
    )  # fmt: skip
    next(iter(stream))
    stream.close()
    # one past its deadline (504): an error the dashboard shows
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=models[0], prompt="slowly", max_tokens=200,
                                  extra_body={"timeout": 0.001})  # fmt: skip
    assert info.value.status_code == 504
    return models[0]


def _wait_scraped(server: Prometheus, expr: str, timeout_s: float = 60.0) -> None:
    """Until Prometheus holds a sample of ``expr`` taken after the traffic, then a few
    more scrapes (a rate needs two samples, and every target its last ones)."""
    query = f"count_over_time(({expr})[10s:1s])"
    until(f"prometheus scraped {expr} (log: {server.directory / 'prometheus.log'})",
          lambda: finite_values(server.query(query)), timeout_s)  # fmt: skip
    time.sleep(3)


@pytest.fixture(scope="module")
def model_after_traffic(served: Served, prometheus: Prometheus) -> str:
    def scraped(models: list[str]) -> None:
        for m in models:
            _wait_scraped(prometheus, f'aegaeon_ttft_seconds_count{{model="{m}"}}')

    model = _traffic(served, scraped)
    # every request scored, and the counters' rise scraped
    until("the traffic's rise scraped",
          lambda: finite_values(prometheus.query(
              f'increase(aegaeon_ttft_seconds_count{{model="{model}"}}[5m]) > 0')),
          60.0)  # fmt: skip
    time.sleep(3)
    return model


def test_every_target_of_the_node_is_up(served: Served, prometheus: Prometheus) -> None:
    services = fetch_services(served.url)
    deadline = time.monotonic() + 60
    health: dict[str, str] = {}
    while time.monotonic() < deadline:
        health = prometheus.targets_up()
        if len(health) >= len(services) and all(h == "up" for h in health.values()):
            break
        time.sleep(0.5)
    scraped = {url for url, h in health.items() if h == "up"}
    for service in services:
        assert service["metrics_url"] in scraped, (service, health)


def _check(server: Prometheus, title: str, expr: str, model: str) -> str | None:
    """None when the query returns a finite value; else what was wrong."""
    query = instantiate(expr, model, RATE_INTERVAL)
    result = server.query(query)
    if not result:
        return f"{title}: no series for {query}"
    if not finite_values(result):
        return f"{title}: only NaN/Inf for {query}: {result[:3]}"
    return None


def test_vllm_example_dashboard_queries_return_data(
    prometheus: Prometheus, model_after_traffic: str
) -> None:
    panels = json.loads(VLLM_QUERIES.read_text())["panels"]
    problems = [_check(prometheus, p["title"], p["expr"], model_after_traffic) for p in panels]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
    # the numbers the operators look at first are the node's own, not zeros
    ttft = prometheus.query(
        f"histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket"
        f'{{model_name="{model_after_traffic}"}}[{RATE_INTERVAL}])))'
    )
    assert 0 < finite_values(ttft)[0] < 120
    # vLLM's current names of what that dashboard reads under older ones (ITL, KV usage),
    # which autoscalers and the Gateway API's endpoint picker query
    for expr in (
        f"histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket"
        f'{{model_name="{model_after_traffic}"}}[{RATE_INTERVAL}])))',
        f'vllm:kv_cache_usage_perc{{model_name="{model_after_traffic}"}}',
        f"histogram_quantile(0.9, sum by(le) (rate(vllm:request_queue_time_seconds_bucket"
        f'{{model_name="{model_after_traffic}"}}[{RATE_INTERVAL}])))',
    ):
        values = finite_values(prometheus.query(expr))
        assert values and 0 <= values[0] < 120, (expr, values)
    success = prometheus.query(
        f'sum(vllm:request_success_total{{model_name="{model_after_traffic}"}})'
    )
    assert finite_values(success)[0] >= 6  # 3 completions + 3 chats, at least


def test_project_dashboard_queries_return_data(
    served: Served, prometheus: Prometheus, model_after_traffic: str
) -> None:
    problems: list[str] = []
    for title, expr in dashboard_queries(DASHBOARD):
        problem = _check(prometheus, title, expr, model_after_traffic)
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(problems)
