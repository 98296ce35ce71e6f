"""The stall verdict (aegaeon_runtime.liveness) and what reads it: the side server's 503 and
the supervisor's poll (aegaeon_cli.supervisor.stall_of)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aegaeon_cli.supervisor import stall_of
from aegaeon_runtime.liveness import Progress, judge

STALL_S = 30.0


def _progress(taken_s: float = 100.0, calling: float | None = None, queued: int = 1,
              commands: int = 0, started: bool = True) -> Progress:  # fmt: skip
    return Progress(taken_s, calling, queued, commands, started)


def test_a_thread_with_work_and_no_progress_for_stall_s_is_stalled() -> None:
    assert not judge(_progress(), 100.0 + STALL_S - 0.1, STALL_S).stalled
    verdict = judge(_progress(queued=2, commands=1), 100.0 + STALL_S + 0.5, STALL_S)
    assert verdict.stalled and verdict.has_work
    assert "no progress for 30.5 s" in verdict.reason and "2 request(s) and 1 command(s)" in (
        verdict.reason)
    body = verdict.body(STALL_S, 1234)
    assert body == {"tid": 1234, "since_progress_s": 30.5, "has_work": True, "stall_s": 30.0,
                    "stalled": True}  # fmt: skip


@pytest.mark.parametrize("progress", [
    _progress(queued=0, commands=0),  # idle: it may sleep in its inbox for good
    _progress(calling=90.0),  # waiting on the cachemgr (a model loading from disk)
    _progress(started=False),  # its start-up profile, or not running
])  # fmt: skip
def test_idle_waiting_on_the_cachemgr_or_starting_is_not_a_stall(progress: Progress) -> None:
    assert not judge(progress, 100.0 + 10 * STALL_S, STALL_S).stalled


def test_a_command_waiting_is_work() -> None:
    assert judge(_progress(queued=0, commands=1), 100.0 + STALL_S, STALL_S).stalled


class _Health(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, tuple[int, Any]]] = {}

    def do_GET(self) -> None:
        code, body = self.answers[self.path]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_the_supervisor_acts_on_a_stall_only() -> None:
    _Health.answers = {
        "/ok": (200, {"status": "ok"}),
        "/stalled": (503, {"status": "stalled", "reason": "compute thread made no progress"}),
        "/draining": (503, {"status": "ok"}),
        "/garbled": (503, b"not json"),
    }
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert stall_of(f"{base}/stalled") == "compute thread made no progress"
        assert stall_of(f"{base}/ok") is None and stall_of(f"{base}/draining") is None
        assert stall_of(f"{base}/garbled") is None
        server_port = server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
    assert stall_of(f"http://127.0.0.1:{server_port}/ok", timeout_s=1.0) is None  # gone


def test_the_side_server_answers_503_for_a_body_not_ok(tmp_path: Path) -> None:
    from aegaeon_common.http_side import Readiness, SideServer
    from aegaeon_common.metrics import new_registry

    async def run() -> tuple[int, int]:
        import aiohttp

        state = {"status": "ok"}
        side = SideServer("decode-0", "decode", new_registry(), Readiness(), host="127.0.0.1",
                          port=0, run_dir=tmp_path, health=lambda: dict(state))  # fmt: skip
        url = await side.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/health") as ok:
                    first = ok.status
                state["status"] = "stalled"
                async with session.get(f"{url}/health") as bad:
                    second = bad.status
        finally:
            await side.stop()
        return first, second

    assert asyncio.run(run()) == (200, 503)

