"""What the reliability benchmarks check on a running node (chaos, cancel, soak).

* :class:`Holdings`: what the node holds, from ``/v1/aegaeon/stats``
  (``open_requests``; per instance ``kv_blocks_in_use``, ``leases``,
  ``open_sequences``); all zero on an idle node that leaked nothing.
  :func:`wait_quiet` polls until they are (heartbeats lag by ~0.5 s).
* The processes of an ``aegaeon serve`` (its children by service name), the
  shared-memory segments of its run, each process's RSS and open fds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aegaeon_workload.stats_json import holdings

from aegaeon_bench.node.client import ServiceError, get_stats

SERVICES = ("cachemgr", "prefill", "decode", "proxy")
STORE = "store"  # many nodes: the private redis-server of `aegaeon serve --nodes`

__all__ = [
    "STORE",
    "Holdings",
    "ProcessSample",
    "read_holdings",
    "sample_processes",
    "serve_children",
    "shm_segments",
    "stray_processes",
    "wait_quiet",
]


HELD = ("kv_blocks_in_use", "leases", "open_sequences")


@dataclass(frozen=True)
class Holdings:
    """What a node holds now (-1: not known)."""

    open_requests: int
    kv_blocks: int
    leases: int
    sequences: int
    per_instance: list[dict[str, Any]] = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        # leases -1 with the rest read: a proxy replica, which does not see the nodes'
        # leases (their cachemgrs do)
        return (self.open_requests, self.kv_blocks, self.sequences) == (0, 0, 0) and \
            self.leases in (0, -1)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "open_requests": self.open_requests, "kv_blocks_in_use": self.kv_blocks,
            "leases": self.leases, "open_sequences": self.sequences,
        }  # fmt: skip
        held = {str(i.get("name")): {k: i[k] for k in HELD if i.get(k, 0) > 0}
                for i in self.per_instance if any(i.get(k, 0) > 0 for k in HELD)}  # fmt: skip
        if held:  # who holds what, when anything is held
            out["held_by"] = held
        return out

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> Holdings:
        listed = holdings(stats)
        leases = [int(i.get("leases", -1)) for i in listed]
        return cls(
            open_requests=int(stats.get("open_requests", -1)),
            kv_blocks=sum(int(i.get("kv_blocks_in_use", 0)) for i in listed),
            leases=-1 if any(x < 0 for x in leases) else sum(leases),
            sequences=sum(int(i.get("open_sequences", 0)) for i in listed),
            per_instance=listed,
        )


async def read_holdings(session: aiohttp.ClientSession, base_url: str) -> Holdings:
    stats = await get_stats(session, base_url, light=True)
    if stats is None:
        raise ServiceError("the node reports no /v1/aegaeon/stats")
    return Holdings.of(stats)


async def wait_quiet(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, poll_s: float = 0.25
) -> Holdings:
    """Poll until the node holds nothing (or ``timeout_s``); the last reading."""
    deadline = time.monotonic() + timeout_s
    last: Holdings | None = None
    while True:
        try:
            last = await read_holdings(session, base_url)
        except (ServiceError, aiohttp.ClientError, TimeoutError):
            last = last or Holdings(-1, -1, -1, -1)
        if last.quiet or time.monotonic() > deadline:
            return last
        await asyncio.sleep(poll_s)


def _service_name(proc: psutil.Process) -> str | None:
    """``cachemgr``, ``proxy``, ``prefill-0``, ``decode-1`` from an aegaeon child's process
    title (``aegaeon-decode-1``, set at start) or, before it is set, its argv."""
    try:
        argv = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    title = argv[0].strip() if argv and not any(argv[1:]) else ""
    if title.startswith("aegaeon-") and title.split("-")[1] in SERVICES:
        return title.removeprefix("aegaeon-")
    if "aegaeon_cli.main" not in argv:
        return None
    rest = argv[argv.index("aegaeon_cli.main") + 1 :]
    if not rest or rest[0] not in SERVICES:
        return None
    if "--index" in rest:
        return f"{rest[0]}-{rest[rest.index('--index') + 1]}"
    return rest[0]


def _member_names(run_dir: Path | None) -> dict[int, str]:
    """Many nodes (``aegaeon serve --nodes``): pid -> ``node-0``, ``proxy-1``... from the
    ready files of the members' run directories."""
    names: dict[int, str] = {}
    for ready in sorted(run_dir.glob("*/*.ready")) if run_dir is not None else ():
        with contextlib.suppress(OSError, ValueError):
            names[int(ready.read_text().strip())] = ready.parent.name
    return names


def serve_children(serve_pid: int, run_dir: Path | None = None) -> dict[str, psutil.Process]:
    """The live services of the ``aegaeon serve`` with pid ``serve_pid``, by name. Many
    nodes (``run_dir``: serve's ``--run-dir``): its members (``node-0``, ``proxy-1``) and
    ``store``, its private redis-server."""
    try:
        children = psutil.Process(serve_pid).children()
    except psutil.NoSuchProcess:
        return {}
    members = _member_names(run_dir)
    out: dict[str, psutil.Process] = {}
    for proc in children:
        name = members.get(proc.pid) or _service_name(proc)
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if name is None and proc.name() == "redis-server":
                name = STORE
        if name is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            out[name] = proc
    return out


def stray_processes(known_pids: Iterable[int], serve_pid: int,
                    run_dir: Path | None = None) -> list[str]:  # fmt: skip
    """Processes that served this node once (``known_pids``) and are still there
    without being one of its live services: a restart's leftovers or an
    unreaped zombie, ``"name:pid"`` each."""
    live = {p.pid for p in serve_children(serve_pid, run_dir).values()}
    strays: list[str] = []
    for pid in sorted(set(known_pids) - live):
        try:
            proc = psutil.Process(pid)
            name = _service_name(proc) or proc.name()
        except psutil.NoSuchProcess:
            continue
        except psutil.ZombieProcess:
            name = "zombie"
        strays.append(f"{name}:{pid}")
    return strays


def shm_segments(run_dir: Path) -> list[str]:
    """The shared-memory segments of the deployment whose run directory is ``run_dir``."""
    from aegaeon_common.config import Config

    prefix = Config(models=(), run_dir=run_dir).shm_prefix
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


@dataclass(frozen=True)
class ProcessSample:
    """One process at one time: resident memory and open file descriptors."""

    name: str
    pid: int
    rss_bytes: int
    num_fds: int


def sample_processes(serve_pid: int) -> dict[str, ProcessSample]:
    """RSS and fds of every service of a node, by service name."""
    out: dict[str, ProcessSample] = {}
    for name, proc in serve_children(serve_pid).items():
        try:
            with proc.oneshot():
                out[name] = ProcessSample(name, proc.pid, proc.memory_info().rss, proc.num_fds())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out
