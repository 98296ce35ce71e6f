"""Start `aegaeon serve` as a user would, and stop it; check it leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
import yaml
from aegaeon_bench.node.launch import free_port, interrupt_all
from aegaeon_bench.node.probe import shm_segments
from http_support import call_json, fetch_sync, get_json, sse_events

__all__ = [  # call_json: http_support's, here too for the tests that import it from here
    "READY_TIMEOUT_S", "NodeArgs", "Served", "call_json", "free_port", "is_sleeping",
    "launch_serve", "prompt_body", "serve_config", "serving", "serving_all", "start_serve",
    "stop_serve", "stop_serves", "stream_completion", "until", "wait_serving",
]  # fmt: skip

READY_TIMEOUT_S = 240.0


@dataclass
class Served:
    url: str
    run_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    urls: list[str]  # every proxy replica's API (``url`` the first)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def get_json(self, path: str) -> dict[str, object]:
        data = get_json(self.url + path)
        assert isinstance(data, dict)
        return data

    def post_json(self, path: str, body: Any, timeout_s: float = 120.0) -> dict[str, Any]:
        """The JSON answer of a POST of ``body`` to ``path``, which must answer 200."""
        reply = fetch_sync("POST", self.url + path, body, timeout_s=timeout_s)
        assert reply.status == 200, (path, reply.status, reply.text()[:300])
        data = reply.json()
        assert isinstance(data, dict)
        return data

    def client(self, timeout_s: float = 120.0) -> openai.OpenAI:
        """The official ``openai`` client of this node's API, without retries."""
        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0,
                             timeout=timeout_s)  # fmt: skip

    def switches(self) -> float:
        """The model switches so far, summed over the instances."""
        stats = self.get_json("/v1/aegaeon/stats")["instance_stats"]
        assert isinstance(stats, dict)
        return sum(float(s["counters"].get("switches", 0.0)) for s in stats.values() if s)

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def until(what: str | Callable[[], str], check: Any, timeout_s: float) -> Any:
    """``check()``'s first truthy value, polled every 0.2 s; fails after ``timeout_s``
    (saying ``what``, or what ``what()`` says then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"not within {timeout_s:g} s: {said}")
        time.sleep(0.2)


def is_sleeping(url: str, model: str, headers: dict[str, str] | None = None) -> bool:
    """What ``GET /is_sleeping?model=`` (a 200) says of ``model`` at ``url``."""
    status, body = call_json(url, "GET", f"/is_sleeping?model={model}", headers=headers)
    assert status == 200, body
    return bool(body["is_sleeping"])


def prompt_body(
    model: str, k: int, priority: str, max_tokens: int = 4, num_words: int = 600
) -> dict[str, Any]:
    """A greedy completion request ``k`` with a long prompt of ``num_words`` words (prefill
    work that queues up) at ``priority``, run to ``max_tokens``."""
    prompt = f"request {k}: " + " ".join(f"w{(k * 7 + i) % 97}" for i in range(num_words))
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "priority": priority}  # fmt: skip


async def stream_completion(
    session: Any, base_url: str, body: dict[str, Any], firsts: dict[str, int], name: str
) -> tuple[int, str | None]:
    """Stream one completion from ``base_url`` (``.../v1``) with an aiohttp session; note
    in ``firsts[name]`` when its first token came: how many of the streams sharing
    ``firsts`` had theirs before it; ``(status, finish reason)``."""
    finish: str | None = None
    async with session.post(f"{base_url}/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, None
        async for _, chunk in sse_events(resp):
            if chunk is None:
                break
            assert "error" not in chunk, chunk
            firsts.setdefault(name, len(firsts))
            finish = chunk["choices"][0].get("finish_reason") or finish
    return 200, finish


def launch_serve(market: Path, run_dir: Path, *extra: str) -> Served:
    """`aegaeon serve` started, not waited for (see :func:`wait_serving`)."""
    # --proxies N: the replicas listen on --port, --port + 1, ...
    proxies = int(extra[extra.index("--proxies") + 1]) if "--proxies" in extra else 1
    port = free_port(proxies)
    log_path = run_dir.parent / f"{run_dir.name}-serve.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    out = log_path.open("wb")
    argv = [sys.executable, "-m", "aegaeon_cli.main", "serve", "--market", str(market),
            "--port", str(port), "--run-dir", str(run_dir), *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    out.close()
    urls = [f"http://127.0.0.1:{port + k}" for k in range(proxies)]
    return Served(urls[0], run_dir, proc, log_path, urls)


def wait_serving(served: Served, timeout_s: float = READY_TIMEOUT_S) -> Served:
    """Until ``served`` says it serves; it is stopped, and this raises, when it exits first
    or is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            raise RuntimeError(f"aegaeon serve exited ({served.proc.returncode}):\n"
                               f"{served.log_tail()}")  # fmt: skip
        # the last line of the announcement (after every service's URLs)
        if "Press Ctrl-C to stop." in served.log_path.read_text(errors="replace"):
            return served
        time.sleep(0.2)
    stop_serve(served)
    raise RuntimeError(f"aegaeon serve not ready in {timeout_s} s:\n{served.log_tail()}")


def start_serve(market: Path, run_dir: Path, *extra: str) -> Served:
    return wait_serving(launch_serve(market, run_dir, *extra))


def stop_serve(served: Served, timeout_s: float = 60.0) -> list[psutil.Process]:
    """SIGINT (Ctrl-C) and wait; returns the processes that outlived it (killed)."""
    return stop_serves([served], timeout_s)[0]


def stop_serves(nodes: list[Served], timeout_s: float = 60.0) -> list[list[psutil.Process]]:
    """:func:`stop_serve` of each of ``nodes``, all Ctrl-C'd before the first is waited
    for (each drains while the others do)."""
    children = [served.children() for served in nodes]  # before any can exit
    interrupt_all([served.proc for served in nodes], timeout_s)
    outlived = []
    for kids in children:
        _, alive = psutil.wait_procs(kids, timeout=5)
        for proc in alive:
            proc.kill()
        outlived.append(alive)
    return outlived


def serve_config(market: Path, **sections: Any) -> dict[str, Any]:
    """`aegaeon serve`'s embedded default config for ``market`` with ``sections`` in it
    (a map merged into the default's section of that name, anything else as given)."""
    from aegaeon_cli.serve import default_config_dict

    raw = default_config_dict(market, 0)
    for key, value in sections.items():
        merge = isinstance(value, dict) and isinstance(raw.get(key), dict)
        raw[key] = {**raw[key], **value} if merge else value
    return raw


@contextmanager
def serving(
    market: Path, run_dir: Path, *extra: str, config: dict[str, Any] | None = None
) -> Iterator[Served]:
    """`aegaeon serve` of ``market`` (with ``extra`` arguments, and ``config`` written
    as its config file beside ``run_dir``) for the ``with`` block; then Ctrl-C, and
    check that it exited 0 and left no process and no shared memory behind."""
    with serving_all([(market, run_dir, extra, config)]) as (served,):
        yield served


# one node of :func:`serving_all`: its market, run directory, extra arguments and config
NodeArgs = tuple[Path, Path, tuple[str, ...], "dict[str, Any] | None"]


@contextmanager
def serving_all(nodes: list[NodeArgs]) -> Iterator[list[Served]]:
    """:func:`serving` of each of ``nodes`` (independent nodes), all started before the
    first is waited for; stopped, and each checked, after the ``with`` block."""
    launched: list[Served] = []
    try:
        for market, run_dir, extra, config in nodes:
            args = list(extra)
            if config is not None:
                path = run_dir.parent / f"{run_dir.name}-config.yaml"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(yaml.safe_dump(config))
                args = ["--config", str(path), *args]
            launched.append(launch_serve(market, run_dir, *args))
        for served in launched:
            wait_serving(served)
    except BaseException:  # one did not start: the others are stopped, unchecked
        stop_serves(launched)
        raise
    try:
        yield launched
    finally:
        for served, survivors in zip(launched, stop_serves(launched), strict=True):
            assert served.proc.returncode == 0, served.log_tail()
            assert not survivors, f"processes outlived aegaeon serve: {survivors}"
            assert not shm_segments(served.run_dir), \
                f"shared memory left: {shm_segments(served.run_dir)}"  # fmt: skip
