"""A node started as an operator would harden it (`--api-key`, `--admin-key`, an admin port, tight
admission bounds and timeouts), and the short CI versions of the reliability
benchmarks against it: API keys and the admin port, files and logs, overload (every
request accounted for), 100 cancelled streams (nothing left), hypothesis input on
both endpoints and every ZeroMQ socket (no 5xx, every frame answered or counted), a
body sent a byte at a time, and fds and shm segments that do not grow."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aegaeon_bench.node.probe import sample_processes, serve_children, shm_segments, wait_quiet
from aegaeon_bench.reliability.cancel import cancel_run
from aegaeon_bench.reliability.chaos_load import Attempt, request_body, send
from aegaeon_bench.reliability.fuzz import fuzz_http, fuzz_zmq
from http_support import call_json
from serve_harness import Served, free_port, serve_config, serving

KEY = "sk-e2e-hardened-7f3a91"  # a user key: the API
LIMITED = "sk-e2e-limited-11c0de"
ADMIN_KEY = "sk-e2e-admin-5eb0a7"  # the admin port's (and the API's)
PROMPT_MARKER = "zebra-quartz-marker"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


ADMIN: dict[str, str] = {}  # the running node's admin URL
LIMITED_MODEL: list[str] = []


@pytest.fixture(scope="module")
def hardened(small_market: Path, market_names: list[str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # fmt: skip
    admin_port = free_port()
    first = market_names[0]
    proxy = {"admin_port": admin_port, "max_kv_blocks": 48, "admission_wait": False,
             "read_timeout": 1.0, "write_timeout": 2.0, "send_buffer": "32KiB",
             "keepalive_timeout": 1.0,
             "api_keys": [{"key": LIMITED, "models": [first]}]}  # fmt: skip
    ADMIN["url"] = f"http://127.0.0.1:{admin_port}"
    LIMITED_MODEL[:] = [first]
    with serving(small_market, tmp_path_factory.mktemp("hardened") / "run", "--api-key", KEY,
                 "--admin-key", ADMIN_KEY,
                 config=serve_config(small_market, proxy=proxy)) as served:  # fmt: skip
        yield served


def _admin(served: Served) -> str:
    return ADMIN["url"]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``(status, JSON body or text)`` of ``GET url``."""
    return call_json(url, "GET", "", headers=headers)


def _models(served: Served) -> list[str]:
    status, body = _get(served.url + "/v1/models", AUTH)
    assert status == 200
    return [m["id"] for m in body["data"]]


@pytest.fixture(scope="module")
def baseline(hardened: Served) -> dict[str, dict[str, int]]:
    """Each service's fds and the run's shm segments once the node served every model."""
    for model in _models(hardened):
        asyncio.run(_stream(hardened, model, 4))
    asyncio.run(_quiet(hardened))
    procs = sample_processes(hardened.proc.pid)
    return {"fds": {n: s.num_fds for n, s in procs.items()},
            "pids": {n: s.pid for n, s in procs.items()},
            "shm": {"segments": len(shm_segments(hardened.run_dir))}}  # fmt: skip


async def _stream(served: Served, model: str, max_tokens: int, timeout_s: float = 30.0,
                  prompt: str | None = None) -> Attempt:  # fmt: skip
    import random

    body = request_body(model, random.Random(0), max_tokens, timeout_s)
    if prompt is not None:
        body["prompt"] = prompt
    attempt = Attempt(0, model, time.time())
    async with aiohttp.ClientSession() as session:
        return await send(session, served.url + "/v1/completions", body, attempt, timeout_s + 15,
                          AUTH)  # fmt: skip


async def _quiet(served: Served) -> None:
    async with aiohttp.ClientSession(headers=ADMIN_AUTH) as session:
        held = await wait_quiet(session, _admin(served), 30.0)
    assert held.quiet, held


def test_files_are_private_to_the_user(hardened: Served, baseline: object) -> None:
    assert stat.S_IMODE(hardened.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((hardened.run_dir / "config.yaml").stat().st_mode) == 0o600
    sockets = list(hardened.run_dir.glob("*.sock"))
    assert len(sockets) >= 4 and all(s.is_socket() for s in sockets)


def test_keys_guard_the_api_and_admin_lives_on_its_own_port(hardened: Served) -> None:
    status, body = _get(hardened.url + "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _get(hardened.url + "/v1/models", {"Authorization": "Bearer sk-nope-1234"})
    assert status == 401
    assert _get(hardened.url + "/health")[0] == 200  # probes need no key
    models = _models(hardened)
    limited = {"Authorization": f"Bearer {LIMITED}"}
    status, body = _get(hardened.url + "/v1/models", limited)
    assert status == 200 and [m["id"] for m in body["data"]] == LIMITED_MODEL
    other = next(m for m in models if m not in LIMITED_MODEL)
    assert _get(f"{hardened.url}/v1/models/{other}", limited)[0] == 404
    assert _get(f"{hardened.url}/v1/models/{other}", AUTH)[0] == 200
    for path in ("/metrics", "/v1/aegaeon/stats", "/v1/aegaeon/services"):
        assert _get(hardened.url + path, AUTH)[0] == 404, path  # not on the public port
    # the admin port asks an admin key too (a Service or a sidecar may expose it)
    assert _get(_admin(hardened) + "/v1/aegaeon/stats?light=1")[0] == 401
    status, body = _get(_admin(hardened) + "/metrics", AUTH)
    assert status == 403 and body["error"]["code"] == "insufficient_permissions"
    assert _get(_admin(hardened) + "/health")[0] == 200
    status, body = _get(_admin(hardened) + "/v1/aegaeon/stats?light=1", ADMIN_AUTH)
    assert status == 200 and isinstance(body["instances"], list)
    for inst in body["instances"]:
        assert {"kv_blocks_in_use", "leases", "open_sequences"} <= set(inst)
    assert isinstance(body["open_requests"], int)
    assert _get(_admin(hardened) + "/v1/models", ADMIN_AUTH)[0] == 404  # nor the API there


def test_logs_hold_no_key_and_no_prompt(hardened: Served) -> None:
    model = _models(hardened)[0]
    attempt = asyncio.run(_stream(hardened, model, 4, prompt=f"{PROMPT_MARKER} say hi"))
    assert attempt.outcome == "completed", attempt
    logs = [*hardened.run_dir.glob("*.log"), hardened.log_path]
    for log in logs:
        text = log.read_text(errors="replace")
        assert KEY not in text and LIMITED not in text and ADMIN_KEY not in text, log.name
        assert PROMPT_MARKER not in text, log.name


def test_overload_accounts_for_every_request(hardened: Served) -> None:
    """Past the KV bound new requests are 429s with Retry-After; requests with a short
    deadline end with deadline_exceeded; nothing else, and nothing stays open."""
    models = _models(hardened)

    async def burst() -> list[Attempt]:
        import random

        rng = random.Random(1)
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> Attempt:
                timeout = 0.3 if i % 4 == 0 else 60.0
                body = request_body(models[i % len(models)], rng, 48, timeout)
                return await send(session, hardened.url + "/v1/completions", body,
                                  Attempt(i, body["model"], time.time()), 75.0, AUTH)  # fmt: skip

            return await asyncio.gather(*(one(i) for i in range(40)))

    attempts = asyncio.run(burst())
    kinds = Counter("completed" if a.outcome == "completed" else a.code for a in attempts)
    assert set(kinds) <= {"completed", "deadline_exceeded", "overloaded"}, kinds
    assert kinds["overloaded"] > 0 and kinds["completed"] > 0, kinds
    assert all(a.status == 429 for a in attempts if a.code == "overloaded")
    asyncio.run(_quiet(hardened))


def test_cancelled_streams_leave_nothing(hardened: Served) -> None:
    # the admin key: its requests and the stats it reads on the admin port
    report = asyncio.run(cancel_run(hardened.url, 100, 8, 32, 0, 30.0, admin_url=_admin(hardened),
                                    headers=ADMIN_AUTH))  # fmt: skip
    assert report["ok"], report
    assert sum(report["outcomes"].values()) == 100


def test_bench_serve_sends_the_key_from_the_option_or_the_environment(
    hardened: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aegaeon_cli.main import main

    argv = ["bench", "serve", "--url", hardened.url, "--model", _models(hardened)[0],
            "--rps", "2", "--duration", "1.5", "--prompt-tokens", "8", "--output-tokens", "4",
            "--json", "--quiet"]  # fmt: skip
    monkeypatch.delenv("AEGAEON_API_KEY", raising=False)
    assert main(argv) == 2  # no key: told how to give one, nothing sent
    assert "--api-key KEY or $AEGAEON_API_KEY" in capsys.readouterr().err
    for extra, env in (([], KEY), (["--api-key", KEY], None)):
        if env is None:
            monkeypatch.delenv("AEGAEON_API_KEY", raising=False)
        else:
            monkeypatch.setenv("AEGAEON_API_KEY", env)
        assert main([*argv, *extra]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["completed"] >= 1 and result["failed"] == 0, result


def test_bad_input_on_both_endpoints_and_every_socket(hardened: Served) -> None:
    models = [*_models(hardened), "no-such-model"]
    http = fuzz_http(hardened.url, models, examples=60, seed=0, headers=AUTH)
    assert http["5xx"] == 0 and http["num_problems"] == 0, http
    report = asyncio.run(fuzz_zmq(_admin(hardened), hardened.run_dir, frames=40, seed=0,
                                  headers=ADMIN_AUTH))  # fmt: skip
    assert report["cachemgr"]["unanswered"] == 0, report
    for name in ("prefill-0", "decode-0", "proxy"):
        assert report[name]["counted"] == report[name]["refused_by_channel"], report
    asyncio.run(_quiet(hardened))


def test_a_body_a_byte_a_second_is_cut(hardened: Served) -> None:
    host, port = hardened.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "x", "prompt": "y" * 100}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        reply, sent = b"", 0
        for i in range(len(body)):
            try:
                sock.sendall(body[i : i + 1])
            except OSError:
                break
            sent = i + 1
            sock.settimeout(0.3)
            try:
                reply += sock.recv(65536)
            except TimeoutError:
                continue
            if reply:
                break
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert sent < len(body)  # cut mid-body, not answered once it was all there


def test_a_reader_that_never_reads_is_cut_and_freed(hardened: Served) -> None:
    host, port = hardened.url.removeprefix("http://").split(":")
    body = json.dumps({"model": _models(hardened)[0], "prompt": "Tell me a story.",
                       "stream": True, "max_tokens": 1500, "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    client = sock.getsockname()[:2]
    try:
        # The client cannot see the proxy let go (its FIN waits behind the unread
        # bytes), so look from the server's side: its end of the connection leaves
        # ESTABLISHED (closed, or aborted at the write timeout).
        deadline = time.monotonic() + 60.0
        status = psutil.CONN_ESTABLISHED
        while time.monotonic() < deadline and status == psutil.CONN_ESTABLISHED:
            time.sleep(0.25)
            ends = [c for c in psutil.net_connections(kind="tcp")
                    if c.raddr and tuple(c.raddr) == client]  # fmt: skip
            status = ends[0].status if ends else psutil.CONN_CLOSE
        assert status != psutil.CONN_ESTABLISHED
    finally:
        sock.close()
    asyncio.run(_quiet(hardened))  # its request ended and holds nothing


def test_an_idle_keep_alive_connection_is_closed(hardened: Served) -> None:
    host, port = hardened.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30.0) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive by default
        received = b""
        while chunk := sock.recv(4096):  # the answer, then the end: the proxy closed it
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def test_no_fd_or_shm_growth_and_no_restart(
    hardened: Served, baseline: dict[str, dict[str, int]]
) -> None:
    asyncio.run(_quiet(hardened))
    procs = sample_processes(hardened.proc.pid)
    assert {n: s.pid for n, s in procs.items()} == baseline["pids"]
    for name, sample in procs.items():
        assert sample.num_fds <= baseline["fds"][name] + 2, (name, sample, baseline["fds"])
    assert len(shm_segments(hardened.run_dir)) == baseline["shm"]["segments"]
    assert set(serve_children(hardened.proc.pid)) == set(baseline["pids"])
    assert os.path.exists(hardened.run_dir / "cachemgr.sock")
