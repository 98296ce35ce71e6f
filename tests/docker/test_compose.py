"""The CPU compose stack for real: the image built by `scripts/images cpu`, the root
compose.yaml's `--profile cpu` up, three models streamed through the proxy, every
service's /metrics parsed and its request counters checked, then down leaving no
container, volume or network of the project (checked in the fixture's teardown).

Marked ``docker``: not in the default run (CI has no Docker daemon, and the first image
build takes minutes); skipped with the reason when ``docker info`` fails. Run it with

    .venv/bin/python -m pytest -m docker tests/docker -s

``AEGAEON_COMPOSE`` picks the compose command (default: ``docker compose`` where it
works, else ``docker-compose``); ``AEGAEON_TEST_BUILD=0`` uses the image as it is.
The timings are printed (``-s``) as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aegaeon_bench.node.launch import free_port
from http_support import fetch_sync, metric_samples, sample_sum, sse_events

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("AEGAEON_CPU_IMAGE", "aegaeon:cpu")
# each service's side port in its container (docker/entrypoint.py); the proxy: its API port
PORTS = {"proxy-cpu": 8000, "cachemgr-cpu": 9100, "prefill-cpu": 9200, "decode-cpu": 9300}
DECODE_REPLICAS = 2  # two decode containers: instance indexes from replica names, DNS discovery
MAX_TOKENS = 12
UP_TIMEOUT_S = 420

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


def _run(
    argv: list[str], timeout: float = 600, cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=cwd, env=env)


def _compose_command() -> list[str]:
    forced = os.environ.get("AEGAEON_COMPOSE", "").split()
    if forced:
        return forced
    if _run(["docker", "compose", "version"], timeout=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` (v2) nor `docker-compose` (1.x) is installed")


@dataclass
class Stack:
    compose: list[str]
    project: str
    env: dict[str, str]
    api_url: str
    timings_s: dict[str, float] = field(default_factory=dict)

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        # both profiles, services named on `up`: Grafana's image (from a registry) is
        # never needed
        return _run([*self.compose, "-p", self.project, "--profile", "cpu", "--profile",
                     "monitoring", *args], timeout=timeout, cwd=ROOT, env=self.env)

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "60", timeout=60).stdout[-12000:]

    def containers(self) -> dict[str, tuple[str, str]]:
        """container name -> (its service, its IP on the project's network)."""
        ids = _run(["docker", "ps", "-q", "--filter",
                    f"label=com.docker.compose.project={self.project}"]).stdout.split()
        out = {}
        for cid in ids:
            info = json.loads(_run(["docker", "inspect", cid]).stdout)[0]
            service = info["Config"]["Labels"]["com.docker.compose.service"]
            networks = info["NetworkSettings"]["Networks"].values()
            ip = next(n["IPAddress"] for n in networks if n["IPAddress"])
            out[info["Name"].lstrip("/")] = (service, ip)
        return out


def _leftovers(project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    kinds = {
        "containers": ["docker", "ps", "-aq", "--filter", label],
        "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
        "networks": ["docker", "network", "ls", "-q", "--filter", label],
    }
    return {kind: _run(argv).stdout.split() for kind, argv in kinds.items()}


@pytest.fixture(scope="module")
def docker_ready() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker client")
    info = _run(["docker", "info"], timeout=60)
    if info.returncode != 0:
        pytest.skip(f"no Docker daemon answers `docker info`: {info.stderr.strip()[-200:]}")


@pytest.fixture(scope="module")
def image(docker_ready: None) -> dict[str, float]:
    """The CPU image, built (or brought up to date) by scripts/images."""
    timings: dict[str, float] = {}
    if os.environ.get("AEGAEON_TEST_BUILD", "1") != "0":
        start = time.monotonic()
        built = _run([str(ROOT / "scripts" / "images"), "cpu"], timeout=1500, cwd=ROOT)
        assert built.returncode == 0, built.stderr[-4000:]
        timings["build_s"] = time.monotonic() - start
    if _run(["docker", "image", "inspect", IMAGE]).returncode != 0:
        pytest.skip(f"no image {IMAGE} (AEGAEON_TEST_BUILD=0 and scripts/images not run)")
    size = _run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]).stdout.strip()
    timings["image_mb"] = int(size) / 1e6
    return timings


@pytest.fixture(scope="module")
def stack(image: dict[str, float], small_market: Path) -> Iterator[Stack]:
    market = small_market  # tests/conftest.py: the 4-model market tests/e2e use
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "AEGAEON_"))}
    env.update(AEGAEON_CPU_IMAGE=IMAGE, AEGAEON_MARKET_DIR=str(market), AEGAEON_API_PORT=str(port),
               AEGAEON_CPU_DECODE_INSTANCES=str(DECODE_REPLICAS),
               AEGAEON_PROMETHEUS_PORT=f"127.0.0.1:{free_port()}")
    s = Stack(_compose_command(), f"aegaeon-test-{os.getpid()}", env, f"http://127.0.0.1:{port}")
    s.timings_s.update(image)
    start = time.monotonic()
    up = s("up", "-d", "proxy-cpu", timeout=UP_TIMEOUT_S)  # and what it depends on
    try:
        assert up.returncode == 0, up.stderr[-3000:] + s.logs()
        deadline = time.monotonic() + UP_TIMEOUT_S
        while _get(f"{s.api_url}/ready")[0] != 200:
            assert time.monotonic() < deadline, "the proxy never got ready\n" + s.logs()
            time.sleep(1)
        s.timings_s["up_to_ready_s"] = time.monotonic() - start
        yield s
    finally:
        start = time.monotonic()
        down = s("down", "-v", "--remove-orphans", "--timeout", "60", timeout=300)
        s.timings_s["down_s"] = time.monotonic() - start
        print("compose-timings", json.dumps({k: round(v, 1) for k, v in s.timings_s.items()}))
        assert down.returncode == 0, down.stderr[-2000:]
        # brought down leaving nothing of the project
        assert _leftovers(s.project) == {"containers": [], "volumes": [], "networks": []}


def _get(url: str) -> tuple[int, str]:
    """``(status, text)``; ``(0, "")`` while nothing answers."""
    try:
        reply = fetch_sync("GET", url, timeout_s=30)
    except OSError:
        return 0, ""
    return reply.status, reply.text()


def _stream_chat(api_url: str, model: str) -> tuple[str, int, str | None]:
    """One streamed chat completion: (text, content chunks, finish_reason)."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Hello {model}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}

    async def stream() -> tuple[str, int, str | None]:
        text, chunks, finish = "", 0, None
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(f"{api_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, (await resp.read())[:500]
            assert resp.headers.get("Content-Type", "").startswith("text/event-stream")
            async for _, event in sse_events(resp):
                if event is None:
                    break
                for choice in event["choices"]:
                    content = choice.get("delta", {}).get("content")
                    if content:
                        text, chunks = text + content, chunks + 1
                    finish = choice.get("finish_reason") or finish
        return text, chunks, finish

    return asyncio.run(stream())


def test_cpu_stack_serves_three_models_and_every_service_exports_metrics(stack: Stack) -> None:
    status, body = _get(f"{stack.api_url}/v1/models")
    assert status == 200
    models = [m["id"] for m in json.loads(body)["data"]][:3]
    assert len(models) == 3

    start = time.monotonic()
    with ThreadPoolExecutor(len(models)) as pool:
        results = dict(zip(models, pool.map(lambda m: _stream_chat(stack.api_url, m), models),
                           strict=True))
    stack.timings_s["three_streams_s"] = time.monotonic() - start
    for model, (text, chunks, finish) in results.items():
        assert chunks >= 1 and text, model
        assert finish == "length", (model, finish)

    containers = stack.containers()
    services = sorted(svc for svc, _ in containers.values())
    assert services == sorted([*PORTS, *["decode-cpu"] * (DECODE_REPLICAS - 1)]), containers
    start = time.monotonic()
    deadline = time.monotonic() + 15
    while True:  # worker counters land when the stage's message is handled
        scraped = {name: metric_samples(f"http://{ip}:{PORTS[svc]}/metrics")
                   for name, (svc, ip) in containers.items()}
        workers = [scraped[name] for name, (svc, _) in containers.items()
                   if svc in ("prefill-cpu", "decode-cpu")]
        prefilled = sum(sample_sum(w, "aegaeon_instance_requests_total", stage="prefill",
                               outcome="ok") for w in workers)  # fmt: skip
        decoded = sum(sample_sum(w, "aegaeon_instance_requests_total", stage="decode",
                             outcome="length") for w in workers)  # fmt: skip
        if (prefilled, decoded) == (3, 3) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    stack.timings_s["scrape_s"] = time.monotonic() - start
    assert (prefilled, decoded) == (3, 3)
    for name, samples in scraped.items():
        assert ("process_resident_memory_bytes", ()) in samples, name
        assert ("process_open_fds", ()) in samples, name
    by_service = {svc: scraped[name] for name, (svc, _) in containers.items()}
    proxy = by_service["proxy-cpu"]
    for model in models:
        assert sample_sum(proxy, "aegaeon_requests_total", model=model) == 1
        assert sample_sum(proxy, "aegaeon_requests_total", model=model, outcome="length") == 1
        assert sample_sum(proxy, "aegaeon_ttft_seconds_count", model=model) == 1
    assert sample_sum(proxy, "aegaeon_instance_up") == 1 + DECODE_REPLICAS
    cachemgr = by_service["cachemgr-cpu"]
    assert sample_sum(cachemgr, "aegaeon_cachemgr_workers") == 1 + DECODE_REPLICAS
    assert sample_sum(cachemgr, "aegaeon_model_cache_models", state="resident") >= 3

    # the proxy lists every service, at addresses the compose network resolves
    status, body = _get(f"{stack.api_url}/v1/aegaeon/services")
    assert status == 200
    names = {s["name"] for s in json.loads(body)["services"]}
    decodes = {f"decode-{i}" for i in range(DECODE_REPLICAS)}
    assert names == {"proxy", "cachemgr", "prefill-0", *decodes}

    # compose's own view: every container healthy (the /health checks of compose.yaml)
    deadline = time.monotonic() + 30
    for name in containers:
        while True:
            health = _run(["docker", "inspect", "-f", "{{.State.Health.Status}}", name]).stdout
            if health.strip() == "healthy" or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert health.strip() == "healthy", (name, health)


def test_prometheus_scrapes_every_service_and_the_dashboard_queries_answer(stack: Stack) -> None:
    """The monitoring profile's Prometheus (scripts/images prometheus) beside the stack: every
    service's job is up, and each query of the Grafana dashboard runs against what it
    scraped (Grafana itself comes from a registry, so only its provisioning is checked)."""
    image = os.environ.get("AEGAEON_PROMETHEUS_IMAGE", "aegaeon-prometheus:bookworm")
    stack.env["AEGAEON_PROMETHEUS_IMAGE"] = image
    if _run(["docker", "image", "inspect", image]).returncode != 0:
        pytest.skip(f"no image {image} (scripts/images prometheus)")
    start = time.monotonic()
    up = stack("up", "-d", "prometheus")
    assert up.returncode == 0, up.stderr[-2000:]
    url = "http://" + stack.env["AEGAEON_PROMETHEUS_PORT"]
    jobs = {f"aegaeon-{k}" for k in ("proxy", "cachemgr", "prefill", "decode")}
    deadline = time.monotonic() + 90
    while True:
        status, body = _get(f"{url}/api/v1/targets")
        targets = json.loads(body)["data"]["activeTargets"] if status == 200 else []
        healthy = [t["labels"]["job"] for t in targets if t["health"] == "up"]
        if jobs <= set(healthy) and healthy.count("aegaeon-decode") == DECODE_REPLICAS:
            break
        assert time.monotonic() < deadline, targets
        time.sleep(1)
    time.sleep(11)  # two more scrapes: rates have two samples
    stack.timings_s["prometheus_up_s"] = time.monotonic() - start

    dashboard = json.loads((ROOT / "docker/monitoring/grafana/dashboards/aegaeon.json").read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$model", ".*").replace("$__rate_interval", "1m")
            status, body = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            assert status == 200, (panel["title"], expr, body[:300])
            if not json.loads(body)["data"]["result"]:
                empty.append(panel["title"])
    assert set(empty) <= {"Errors by model"}, empty  # no request failed, all else has data


def _complete(api_url: str, model: str, i: int) -> tuple[str, object]:
    body = {"model": model, "prompt": f"Request {i}", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    try:
        reply = fetch_sync("POST", f"{api_url}/v1/completions", body, timeout_s=180)
        if reply.status != 200:
            return "error", f"HTTP {reply.status}: {reply.text()[:300]}"
        answer = reply.json()
        return answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]
    except (OSError, ValueError, KeyError) as exc:  # the test's point: count every failure
        return "error", repr(exc)[:300]


def test_compose_restart_of_each_worker_under_load_loses_nothing(stack: Stack) -> None:
    """`docker compose restart prefill-cpu` / `decode-cpu` while requests stream: SIGTERM
    drains the worker (stop_grace_period covers drain_timeout), the container comes back
    and rejoins the cachemgr and proxy, no request fails."""
    models = [m["id"] for m in json.loads(_get(f"{stack.api_url}/v1/models")[1])["data"]][:3]
    results: list[tuple[str, object]] = []
    stop = threading.Event()

    def feed() -> None:
        with ThreadPoolExecutor(32) as pool:
            futures, i = [], 0
            while not stop.is_set():
                futures.append(pool.submit(_complete, stack.api_url, models[i % 3], i))
                i += 1
                time.sleep(0.1)
            results.extend(f.result() for f in futures)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        for service in ("decode-cpu", "prefill-cpu"):
            time.sleep(2)  # requests in every stage when the signal comes
            start = time.monotonic()
            restarted = stack("restart", service, timeout=180)
            assert restarted.returncode == 0, restarted.stderr[-2000:]
            stack.timings_s[f"restart_{service}_s"] = time.monotonic() - start
        time.sleep(2)
    finally:
        stop.set()
        feeder.join(timeout=300)
    assert len(results) > 50
    assert [r for r in results if r != ("length", MAX_TOKENS)] == []
    logs = stack("logs", "--no-color", "decode-cpu", timeout=60).stdout
    assert '"event": "drained"' in logs
