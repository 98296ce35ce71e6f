"""A real ``redis-server`` for the tests that need one (the multi-node shape).

Found on PATH; where it is missing and this is a Debian machine we are root on,
installed with apt-get (the Debian package ``redis-server``), as scripts/test
does before the suite. A test that needs it is skipped, saying why, only when
it cannot be had.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aegaeon_bench.node.launch import free_port

INSTALL_LOG = Path("/tmp/aegaeon-redis-install.log")


def redis_server_binary() -> str | None:
    """The redis-server binary, installing the Debian package if we may; None if not."""
    found = shutil.which("redis-server")
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    with INSTALL_LOG.open("ab") as log:
        for cmd in (["apt-get", "install", "-y", "-q", "redis-server"],
                    ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "redis-server"]):  # fmt: skip
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False,
                                  env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            if cmd[1] == "install" and done.returncode == 0:
                break
    return shutil.which("redis-server")


@contextmanager
def running_redis(workdir: Path) -> Iterator[str]:
    """A private redis-server on a free loopback port (no persistence); its URL."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("needs redis-server: not on PATH, and the Debian package could not be "
                    f"installed (not root, or no apt-get; see {INSTALL_LOG})")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"],
        stdout=(workdir / "redis.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (workdir / "redis.log").read_text()
                raise RuntimeError(f"redis-server did not start: {log}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
