"""The faults `aegaeon bench chaos` injects into a node, and what each should restart.

One node (``aegaeon serve``): ``kill_*``: SIGKILL the service (serve restarts it:
the cachemgr with the instances that map its memory, anything else alone).
``stop_decode``: SIGSTOP decode-0 past the proxy's heartbeat timeout, then
SIGCONT. ``fill_shm``: fill /dev/shm to ``headroom`` bytes from full for a
while, then free it.

Many nodes (``aegaeon serve --nodes N --proxies R``), the shared store:
``store-kill``: SIGKILL its redis-server, which serve restarts empty (no
persistence); ``store-pause``: SIGSTOP it for twice the heartbeat TTL (every
heartbeat record expires meanwhile), then SIGCONT.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aegaeon_common.config import StoreConfig

HEARTBEAT_DEAD_S = 5.0  # an instance's record expires (store.heartbeat_ttl) and is read
STORE_TTL_S = StoreConfig().heartbeat_ttl_s  # many nodes: a heartbeat record's TTL
SHM = Path("/dev/shm")

__all__ = ["FAULTS", "Fault", "ShmFill"]


@dataclass(frozen=True)
class Fault:
    name: str
    action: str  # "kill" | "stop" | "fill"
    target: str | None = None  # the service (serve's child name)
    hold_s: float = 0.0  # stop / fill: how long the fault lasts
    # the services this fault restarts; every other keeps its process
    restarts: tuple[str, ...] = ()
    cluster: bool = False  # a fault of many nodes' shared store (else of one node)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("kill_prefill", "kill", "prefill-0", restarts=("prefill-0",)),
        Fault("kill_decode", "kill", "decode-0", restarts=("decode-0",)),
        Fault("stop_decode", "stop", "decode-0", hold_s=HEARTBEAT_DEAD_S + 3.0),
        Fault("fill_shm", "fill", hold_s=10.0),
        Fault("kill_cachemgr", "kill", "cachemgr",
              restarts=("cachemgr", "prefill-0", "decode-0")),
        Fault("kill_proxy", "kill", "proxy", restarts=("proxy",)),
        Fault("store-kill", "kill", "store", restarts=("store",), cluster=True),
        Fault("store-pause", "stop", "store", hold_s=2 * STORE_TTL_S, cluster=True),
    )
}  # fmt: skip


class ShmFill:
    """A file in /dev/shm that leaves ``headroom_bytes`` free (its pages committed by
    ``posix_fallocate``), at most ``max_bytes``; removed by :meth:`release`."""

    def __init__(self, headroom_bytes: int, max_bytes: int | None = None) -> None:
        self.path = SHM / f"aegaeon-chaos-fill-{os.getpid()}"
        free = shutil.disk_usage(SHM).free
        want = max(0, free - headroom_bytes)
        self.nbytes = want if max_bytes is None else min(want, max_bytes)
        self.free_before = free
        self.capacity = shutil.disk_usage(SHM).total

    def fill(self) -> None:
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            if self.nbytes:
                os.posix_fallocate(fd, 0, self.nbytes)
        finally:
            os.close(fd)

    @property
    def used_fraction(self) -> float:
        """How full /dev/shm is now (1.0: full)."""
        usage = shutil.disk_usage(SHM)
        return usage.used / usage.total if usage.total else 0.0

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
