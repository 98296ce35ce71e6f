"""The containers' boundaries without Docker: every service in PID and mount namespaces of its own.

compose runs the cachemgr, the prefill and decode instances and the proxy in
containers that share only: the run volume (ipc:// sockets, address files), the
market and the config (read-only), and the cachemgr's IPC namespace, i.e. its
/dev/shm (the Model Cache, the CPU KV cache, the event table). Each has its own
/tmp and its own processes; the cachemgr has no GPU (``CUDA_VISIBLE_DEVICES=""``).
Here each service runs under ``unshare --pid --fork --mount`` (PID 1 of its own
PID namespace, a private /tmp: ``namespace_launcher.py``), sharing exactly those
paths and one /dev/shm: a tmpfs the test mounts for the node (and unmounts).

Requests of several models then move KV from the prefill to the decode instance
(a swap-out event the decode's swap-in waits on, host blocks freed behind the
events of copies in flight); afterwards nothing is held: no leased block, no
sequence, no shared-memory segment once the cachemgr stopped, no free refused.
On the CPU (CI) the events are timeline events; ``scripts/gpu-check``'s
``namespaces`` step runs the same on a GPU (``AEGAEON_GPU_CHECK_DEVICE``): the
workers' CUDA copies' events reach the GPU-less cachemgr as their host mirrors,
and the cachemgr never loads the CUDA driver. ``AEGAEON_NAMESPACE_REPORT`` names a
file for the counts (the gpu-check step's results), ``AEGAEON_NAMESPACE_MARKET`` a market
to serve instead of the test's own (the dry run's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from aegaeon_bench.node.launch import free_port
from http_support import Samples, call_json, get_json, get_text, metric_samples
from market_support import market_cache
from serve_harness import until

LAUNCHER = Path(__file__).with_name("namespace_launcher.py")
REPO = Path(__file__).resolve().parents[2]
REQUESTS = 12
MAX_TOKENS = 12
READY_S = 240.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="PID and mount namespaces need root and util-linux's unshare",
)


def _device() -> str:
    device = os.environ.get("AEGAEON_GPU_CHECK_DEVICE", "cpu")
    return device if device == "cpu" or ":" in device else f"{device}:0"


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]  # the `unshare` process (it waits for its child)
    log: Path

    @property
    def inner(self) -> psutil.Process:
        """The service itself: PID 1 of its namespace, a child of `unshare`."""
        children = psutil.Process(self.proc.pid).children()
        assert children, f"{self.name} has no process:\n{self.tail()}"
        return children[0]

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the service (PID 1 of its namespace: it drains and exits)."""
        if self.proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess, AssertionError):
                self.inner.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class Node:
    root: Path
    run_dir: Path
    config: Path
    market: Path
    shm: Path  # the node's /dev/shm (a tmpfs mounted here)
    port: int
    services: dict[str, Service] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Service:
        binds = [{"path": str(self.run_dir)}, {"path": str(self.market), "ro": True},
                 {"path": str(self.config), "ro": True},
                 {"path": str(self.shm), "target": "/dev/shm"}]  # fmt: skip
        # the image's part (the code and its virtual environment), read-only, where a
        # checkout under /tmp would vanish behind the container's own /tmp
        binds += [{"path": str(p), "ro": True} for p in _code_under_tmp()]
        spec_path = self.root / f"{name}-spec.json"
        spec_path.write_text(json.dumps({"binds": binds, "env": env, "argv": argv}))
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation",
                 "private", sys.executable, str(LAUNCHER), str(spec_path)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        service = Service(name, proc, log)
        self.services[name] = service
        return service

    def url(self, name: str) -> str:
        if name == "proxy":
            return f"http://127.0.0.1:{self.port}"
        data = json.loads((self.run_dir / f"{name}.http").read_text())
        return str(data["url"])

    def wait_ready(self, name: str) -> None:
        service = self.services[name]
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            assert service.proc.poll() is None, f"{name} exited:\n{service.tail()}"
            try:
                if get_text(f"{self.url(name)}/ready")[0] == 200:
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"{name} not ready in {READY_S:g} s:\n{service.tail()}")

    def get(self, name: str, path: str) -> Any:
        return get_json(f"{self.url(name)}{path}")

    def metrics(self, name: str) -> Samples:
        return metric_samples(f"{self.url(name)}/metrics")


@pytest.fixture(scope="module")
def market(pytestconfig: pytest.Config) -> Path:
    """Three small models, kept across sessions (market_cache); or the market that
    ``AEGAEON_NAMESPACE_MARKET`` names (gpu-check's dry run: its own small market, built
    by then)."""
    from aegaeon_market import ensure_market

    given = os.environ.get("AEGAEON_NAMESPACE_MARKET")
    if given:
        return Path(given)
    path = Path(market_cache(pytestconfig)) / "namespaces-small3"
    ensure_market(path, num_models=3, profile="small", progress=False)
    return path


@pytest.fixture(scope="module")
def node(market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("namespaces")
    run_dir = root / "run"
    run_dir.mkdir(mode=0o700)
    device = _device()
    copy = {"device": device} if device.startswith("cuda") else {}
    port = free_port()
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "market": str(market), "run_dir": str(run_dir),
        "cachemgr": {"model_cache": "1GiB", "kv_cache": "256MiB"},
        "prefill": {"instances": 1, "device_memory": "768MiB", "kv_memory": "128MiB", **copy},
        "decode": {"instances": 1, "device_memory": "768MiB", "kv_memory": "128MiB", **copy},
        "proxy": {"port": port},
    }))  # fmt: skip
    shm = root / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=1777", "tmpfs", str(shm)],
                   check=True)  # fmt: skip
    node = Node(root, run_dir, config, market, shm, port)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    cli = [sys.executable, "-m", "aegaeon_cli.main"]
    try:
        node.start("cachemgr", [*cli, "cachemgr", "--config", str(config)],
                   {**env, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        node.wait_ready("cachemgr")
        for kind in ("prefill", "decode"):
            node.start(f"{kind}-0", [*cli, kind, "--config", str(config), "--index", "0"], env)
        for kind in ("prefill", "decode"):
            node.wait_ready(f"{kind}-0")
        node.start("proxy", [*cli, "proxy", "--config", str(config)], env)
        node.wait_ready("proxy")
        yield node
    finally:
        for name in ("proxy", "prefill-0", "decode-0", "cachemgr"):
            if name in node.services:
                node.services[name].stop()
        subprocess.run(["umount", "--lazy", str(shm)], check=False)


def _complete(node: Node, model: str, k: int) -> dict[str, Any]:
    body = {"model": model, "prompt": f"request {k}: once upon a time", "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True}  # fmt: skip
    status, out = call_json(node.url("proxy"), "POST", "/v1/completions", body)
    assert status == 200, out
    return dict(out)


def test_namespace_boundaries_serve_hand_off_and_leave_nothing(node: Node) -> None:
    # each service is PID 1 of a namespace of its own, the cachemgr without a GPU
    inner = {name: s.inner for name, s in node.services.items()}
    assert len({p.pid for p in inner.values()}) == 4
    for name in ("cachemgr", "prefill-0", "decode-0"):
        assert node.get(name, "/health")["pid"] == 1, name
        assert os.stat(f"/proc/{inner[name].pid}/ns/pid").st_ino != os.stat(
            "/proc/self/ns/pid").st_ino  # fmt: skip
    # (its environment: CUDA_VISIBLE_DEVICES="" from its spec; setproctitle reuses the
    # memory /proc/<pid>/environ shows, so the driver check below is the proof)
    spec = json.loads((node.root / "cachemgr-spec.json").read_text())
    assert spec["env"]["CUDA_VISIBLE_DEVICES"] == ""
    tmp_entries = {name: sorted(os.listdir(f"/proc/{p.pid}/root/tmp")) for name, p in inner.items()}
    assert "aegaeon-ns-probe" not in tmp_entries["cachemgr"]
    Path(f"/proc/{inner['prefill-0'].pid}/root/tmp/aegaeon-ns-probe").write_text("mine")
    assert not Path(f"/proc/{inner['decode-0'].pid}/root/tmp/aegaeon-ns-probe").exists()

    models = [m["id"] for m in node.get("proxy", "/v1/models")["data"]]
    before = node.metrics("cachemgr")
    with ThreadPoolExecutor(max_workers=6) as pool:
        done = list(pool.map(lambda k: _complete(node, models[k % len(models)], k),
                             range(REQUESTS)))  # fmt: skip
    assert all(d["usage"]["completion_tokens"] == MAX_TOKENS for d in done)

    def settled() -> Samples | None:
        stats = node.get("proxy", "/v1/aegaeon/stats?light=1")
        held = [(i["name"], i["kv_blocks_in_use"], i["open_sequences"])
                for i in stats["instances"]]  # fmt: skip
        after = node.metrics("cachemgr")
        owned = sum(v for (n, _), v in after.items() if n == "aegaeon_kv_blocks_owned")
        moving = after[("aegaeon_kv_cache_move_list_blocks", ())]
        if stats["open_requests"] or any(b or s for _, b, s in held) or owned or moving:
            return None
        return after

    after: Samples = until("no block or sequence held after every request ended", settled, 30)

    def count(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    failed_frees = sum(v - before.get(k, 0.0) for k, v in after.items()
                       if k[0] == "aegaeon_cachemgr_requests_total"
                       and dict(k[1]).get("type") == "cache.free_blocks"
                       and dict(k[1]).get("outcome") != "ok")  # fmt: skip
    freed_now = count("aegaeon_kv_cache_freed_blocks_total", when="now")
    freed_after = count("aegaeon_kv_cache_freed_blocks_total", when="after_event")
    frees = count("aegaeon_cachemgr_requests_total", type="cache.free_blocks", outcome="ok")
    assert failed_frees == 0
    assert frees >= REQUESTS and freed_now + freed_after > 0
    # the cachemgr never loaded the CUDA driver (it opens host mirrors, not CUDA events)
    maps = Path(f"/proc/{inner['cachemgr'].pid}/maps").read_text()
    assert "libcuda.so" not in maps
    report = {"device": _device(), "requests": REQUESTS, "failed_frees": failed_frees,
              "free_requests": frees, "blocks_freed_now": freed_now,
              "blocks_freed_after_event": freed_after}  # fmt: skip
    if os.environ.get("AEGAEON_NAMESPACE_REPORT"):
        Path(os.environ["AEGAEON_NAMESPACE_REPORT"]).write_text(json.dumps(report))
    print(json.dumps(report))

    # the instances and the proxy stop cleanly; the node's /dev/shm then holds only the
    # cachemgr's own segments, and nothing once it stopped
    for name in ("proxy", "prefill-0", "decode-0"):
        assert node.services[name].stop() == 0, node.services[name].tail()
    prefix = yaml.safe_load(node.config.read_text())["run_dir"]
    from aegaeon_common.config import Config

    shm_prefix = Config(models=(), run_dir=Path(prefix)).shm_prefix
    left = sorted(os.listdir(node.shm))
    assert left and all(n.startswith(shm_prefix) for n in left), left
    assert node.services["cachemgr"].stop() == 0, node.services["cachemgr"].tail()
    assert os.listdir(node.shm) == []
    assert all(s.proc.poll() is not None for s in node.services.values())


def _code_under_tmp() -> list[Path]:
    """The checkout and the interpreter's environment, those of them under /tmp."""
    tmp = Path("/tmp").resolve()
    found: list[Path] = []
    for path in (REPO, Path(sys.prefix).resolve()):
        if path.is_relative_to(tmp) and not any(path.is_relative_to(f) for f in found):
            found.append(path)
    return found

