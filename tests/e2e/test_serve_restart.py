"""A child that dies is restarted by `aegaeon serve`, and serving resumes."""

from __future__ import annotations

import os
import signal
import time

import openai
from serve_harness import Served


def _ask(served: Served, model: str) -> str:
    client = openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0, timeout=60)
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    return reply.choices[0].text


def _pids(served: Served) -> dict[str, int | None]:
    health = served.get_json("/health")
    instances = health["backend"]["instances"]  # type: ignore[index]
    return {name: info["pid"] for name, info in instances.items()}  # type: ignore[union-attr]


def _wait_serving(served: Served, model: str, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _ask(served, model)
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _child_pid(served: Served, service: str) -> int:
    for proc in served.children():
        if any(service in part for part in proc.cmdline()):
            return proc.pid
    raise AssertionError(f"no {service} child")


def test_a_killed_instance_and_a_killed_cachemgr_are_restarted(served: Served) -> None:
    model = served.get_json("/v1/models")["data"][0]["id"]  # type: ignore[index]
    before = _ask(served, model)
    old = _pids(served)["decode-0"]
    assert old is not None
    os.kill(old, signal.SIGKILL)
    after = _wait_serving(served, model)
    assert after == before  # greedy: the restarted instance answers the same
    new = _pids(served)["decode-0"]
    assert new is not None and new != old

    # The cache manager owns the shared memory: everything restarts with it.
    os.kill(_child_pid(served, "cachemgr"), signal.SIGKILL)
    time.sleep(1.0)
    assert _wait_serving(served, model, timeout_s=180.0) == before
    assert "child died" in served.log_path.read_text()
