"""Rank 0 of a tensor-parallel instance: start the followers, join the group, map their KV.

A prefill or decode instance with ``tp`` > 1 (``prefill.tp``/``decode.tp``,
``aegaeon serve --tp N``) is one process per device of its group
(``InstancesConfig.group_devices``). The instance's own process is rank 0: it
keeps its sockets, loops, scheduler and sampler, and its engine is a
``MirroredEngine`` (every prefill and decode of a sharded model is broadcast
to the followers first). It starts ranks 1.. as child processes
(``python -m aegaeon_runtime.tp.follower``), which die with it; they join
through a ``TCPStore`` on the loopback (gloo on CPUs, NCCL with a gloo control
group on CUDA devices: ``aegaeon_engine.tp``) and hand rank 0 their KV
regions (``peer``). Each follower registers with the cachemgr as
``<instance>.r<rank>`` to map Model Cache regions, and runs its own switcher
over its own buffer: told of every switch, prefetch and eviction of a sharded
model (``SwitchMirror``), it copies its shard from the Model Cache at the
same time as rank 0 copies its own.

A follower that dies breaks the group's next collective: rank 0's compute
thread fails, the instance exits and its supervisor restarts it, followers
and all (they die with rank 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_engine.tp import TPGroup, join_group, leave_group
from aegaeon_engine.tp_mirror import FIRST_EXTRA_OP, STOP, send_command
from torch._C._distributed_c10d import TCPStore

from aegaeon_runtime.tp.peer import PeerRegion, import_kv

log = get_logger("tp")

ACTIVATE, PREFETCH, EVICT, ADD_MODEL = (FIRST_EXTRA_OP + k for k in range(4))
JOIN_TIMEOUT_S = 600.0  # followers build their engines (kernels, tuning) before they join
STOP_TIMEOUT_S = 10.0


def follower_name(instance: str, rank: int) -> str:
    """A follower's name at the cachemgr and in logs."""
    return f"{instance}.r{rank}"


def text_words(*texts: str) -> list[int]:
    """Strings as mirror words: each its length, then its UTF-8 bytes one a word."""
    words: list[int] = []
    for text in texts:
        data = text.encode()
        words += [len(data), *data]
    return words


def words_text(words: list[int], count: int) -> list[str]:
    """:func:`text_words` back to ``count`` strings."""
    out, at = [], 0
    for _ in range(count):
        n = words[at]
        out.append(bytes(words[at + 1:at + 1 + n]).decode())
        at += 1 + n
    return out


@dataclass
class InstanceGroup:
    """Rank 0's handle on its group: the collective group, the followers, their KV."""

    tp: TPGroup
    store: TCPStore
    followers: list[subprocess.Popen[bytes]]
    peers: list[PeerRegion] = field(default_factory=list)
    _closed: bool = False

    # -- SwitchMirror: what the followers' switchers do (aegaeon_runtime.switcher) ------
    def activate(self, name: str) -> None:
        send_command(self.tp, ACTIVATE, text_words(name))

    def prefetch(self, name: str) -> None:
        send_command(self.tp, PREFETCH, text_words(name))

    def evict(self, name: str) -> None:
        send_command(self.tp, EVICT, text_words(name))

    def add_model(self, name: str, path: str) -> None:
        send_command(self.tp, ADD_MODEL, text_words(name, path))

    @property
    def peer_tensors(self) -> list[torch.Tensor]:
        return [p.tensor for p in self.peers]

    def close(self) -> None:
        """End the followers' loops and the group; kill a follower that does not exit."""
        if self._closed:
            return
        self._closed = True
        if all(p.poll() is None for p in self.followers):
            try:
                send_command(self.tp, STOP)
            except RuntimeError as exc:  # a peer gone: nothing to tell it
                log.warning("tp_stop_not_sent", error=str(exc))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.followers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tp_follower_killed", pid=proc.pid)
                proc.kill()
                proc.wait()
        for peer in self.peers:
            peer.close()
        leave_group()


def start_group(config: Config, kind: str, index: int) -> InstanceGroup:
    """Start instance ``kind-index``'s followers and join its group as rank 0 (blocking:
    run it off the event loop). RuntimeError when a follower fails to start."""
    inst = config.prefill if kind == "prefill" else config.decode
    devices = inst.group_devices(index)
    size = len(devices)
    if not config.source or not os.path.isfile(config.source):
        raise RuntimeError(f"a tensor-parallel instance needs its config file (followers read "
                           f"it), not {config.source!r}")  # fmt: skip
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # gloo's network interface (torch reads it from the environment): the loopback, the
    # group is one host; rank 0 and its followers alike (an operator's setting wins)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env = dict(os.environ)
    name = f"{kind}-{index}"
    followers = []
    for rank in range(1, size):
        argv = [sys.executable, "-m", "aegaeon_runtime.tp.follower", "--config", config.source,
                "--kind", kind, "--index", str(index), "--rank", str(rank),
                "--port", str(store.port)]  # fmt: skip
        followers.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
        log.info("tp_follower_started", instance=name, rank=rank, device=devices[rank],
                 pid=followers[-1].pid)  # fmt: skip
    joined: list[TPGroup] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(join_group(store, 0, size, devices[0], timeout_s=JOIN_TIMEOUT_S))
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=join, name=f"aegaeon-{name}-join", daemon=True)
    thread.start()
    group = None
    try:
        while thread.is_alive():
            dead = [(r + 1, p.returncode) for r, p in enumerate(followers) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{name}: tensor-parallel rank {dead[0][0]} exited with "
                                   f"status {dead[0][1]} while the group formed")  # fmt: skip
            thread.join(0.1)
        if failed:
            raise RuntimeError(f"{name}: joining the tensor-parallel group failed: "
                               f"{failed[0]}") from failed[0]  # fmt: skip
        group = InstanceGroup(joined[0], store, followers)
        for rank in range(1, size):
            handle = json.loads(store.get(f"kv/{rank}").decode())
            group.peers.append(import_kv(handle))
        log.info("tp_group_ready", instance=name, size=size, devices=list(devices))
        return group
    except BaseException:
        if group is not None:
            group.close()
        else:
            for proc in followers:
                proc.kill()
                proc.wait()
        raise
