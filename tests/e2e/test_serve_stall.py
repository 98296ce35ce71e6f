"""A wedged compute thread, for real: ``/health`` fails, the supervisor restarts it, requests
fail over.

The decode instance's compute thread is frozen alone (ptrace interrupts that one
thread; its event loop keeps answering, as with a deadlock or a kernel that never
returns) while it decodes a long request. Within ``health.stall_s`` + 5 s its
``/health`` is a 503 ``stalled``; the proxy marks it down at once (the streaming
request ends with ``instance_failed``; requests sent meanwhile are served by the
other decode instance); ``aegaeon serve``'s supervisor kills and restarts it, and the
new process is healthy and serves again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_harness import Served, call_json, serve_config, serving, until

STALL_S = 3.0
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="freezing one thread needs ptrace "
                                "of another process (root)")  # fmt: skip

_PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_DETACH = 0x4206, 0x4207, 17
_WALL = 0x40000000


class Frozen:
    """One thread of another process stopped alone (``PTRACE_SEIZE`` + ``INTERRUPT``):
    the process's other threads run on. ``release`` lets it go (or reaps it when its
    process was killed meanwhile, so that process can be waited for)."""

    def __init__(self, tid: int) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                     ctypes.c_void_p]  # fmt: skip
        self.tid = tid
        self.held = False

    def _ptrace(self, request: int) -> None:
        if self.libc.ptrace(request, self.tid, None, None) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"ptrace {request:#x} of {self.tid}: {os.strerror(code)}")

    def freeze(self) -> None:
        self._ptrace(_PTRACE_SEIZE)
        self._ptrace(_PTRACE_INTERRUPT)
        os.waitpid(self.tid, _WALL)  # stopped now
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self._ptrace(_PTRACE_DETACH)
        except OSError as exc:  # killed meanwhile: reap its exit so its process can end
            if exc.errno != errno.ESRCH:
                raise
        self.reap()

    def reap(self) -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.tid, os.WNOHANG | _WALL)


def _health(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _instance_urls(served: Served) -> dict[str, str]:
    services = served.get_json("/v1/aegaeon/services")["services"]
    assert isinstance(services, list)
    return {s["name"]: s["health_url"].removesuffix("/health") for s in services}


def _decoding_on(served: Served) -> str | None:
    """The decode instance holding an open sequence (the long request's)."""
    stats = served.get_json("/v1/aegaeon/stats?light=1")["instances"]
    assert isinstance(stats, list)
    held = [i["name"] for i in stats if i["kind"] == "decode" and i["open_sequences"] > 0]
    return held[0] if len(held) == 1 else None


def _freeze_compute_thread(url: str) -> Frozen:
    """Freeze the instance's compute thread at a moment it does not hold the GIL (its
    event loop must still answer: a frozen holder would stop the whole process, which
    the heartbeat timeout already covers)."""
    for _ in range(40):
        status, body = _health(url)
        assert status == 200, body
        frozen = Frozen(int(body["compute_thread"]["tid"]))
        frozen.freeze()
        try:
            _health(url, timeout_s=1.0)
            return frozen
        except (OSError, TimeoutError):
            frozen.release()  # caught holding the GIL: let it go and try again
            time.sleep(random.uniform(0.01, 0.05))
    raise AssertionError("could not freeze the compute thread without its GIL in 40 tries")


@pytest.fixture(scope="module")
def served(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = serve_config(
        small_market,
        health={"stall_s": STALL_S},
        decode={"instances": 2},
        # decoding happens on the decode instances alone: the frozen one is known
        scheduler={"prefill_decodes_when_idle": False},
    )
    with serving(small_market, tmp_path_factory.mktemp("serve-stall") / "run",
                 config=config) as node:  # fmt: skip
        yield node


def _complete(served: Served, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return served.post_json("/v1/completions", body)


def _stream(served: Served, model: str, events: list[dict[str, Any]]) -> None:
    """A long streaming request; its events (the last one an error or the end)."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{served.base_url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))


def test_a_stalled_compute_thread_fails_health_is_restarted_and_fails_over(
        served: Served) -> None:  # fmt: skip
    model = next(m["id"] for m in served.get_json("/v1/models")["data"])
    events: list[dict[str, Any]] = []
    streamer = threading.Thread(target=_stream, args=(served, model, events), daemon=True)
    streamer.start()
    until("the long request decodes", lambda: events and _decoding_on(served), 120)
    victim = _decoding_on(served)
    assert victim is not None
    urls = _instance_urls(served)
    status, before = _health(urls[victim])
    assert status == 200 and before["compute_thread"]["has_work"], before
    frozen = _freeze_compute_thread(urls[victim])
    try:
        # requests sent while it is frozen: each is served (by the other decode instance,
        # at once or once the frozen one is marked down)
        results: list[dict[str, Any]] = []
        senders = [threading.Thread(target=lambda k=k: results.append(
            _complete(served, model, f"during the stall {k}")), daemon=True) for k in range(3)]
        for sender in senders:
            sender.start()

        def stalled() -> dict[str, Any] | None:
            frozen.reap()
            code, body = _health(urls[victim])
            return body if code == 503 and body.get("status") == "stalled" else None

        # how soon it is seen depends on this machine's speed: only that it is seen, and
        # not before the thread was silent for health.stall_s, is asserted
        body = until("/health says stalled", stalled, 120)
        assert body["compute_thread"]["stalled"] and "no progress" in body["reason"]
        silent = re.search(r"no progress for ([0-9.]+) s", body["reason"])
        assert silent is not None and float(silent[1]) >= STALL_S, body["reason"]
        frozen.release()
        # the streaming request had tokens: it ends with the instance's failure, not a hang
        streamer.join(timeout=60)
        assert not streamer.is_alive()
        assert events and "error" in events[-1], events[-1:]
        assert events[-1]["error"]["code"] == "instance_failed"
        for sender in senders:
            sender.join(timeout=240)
        assert len(results) == 3 and all(r["usage"]["completion_tokens"] == 8 for r in results)
    finally:
        frozen.release()
    # the supervisor replaced it: a new process, healthy
    old_pid = before["pid"]

    def replaced() -> bool:
        try:
            code, now = _health(_instance_urls(served)[victim])
        except OSError:
            return False
        return code == 200 and now["pid"] != old_pid

    until("the supervisor restarts the stalled instance", replaced, 180)
    assert "child stalled" in served.log_path.read_text(errors="replace")
    until("the node is ready again", lambda: call_json(served.url, "GET", "/ready")[0] == 200, 180)
    assert _complete(served, model, "after the restart")["usage"]["completion_tokens"] == 8
