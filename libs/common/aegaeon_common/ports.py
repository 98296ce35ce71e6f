"""Free TCP ports on the loopback for services started on this machine.

Chosen below the kernel's ephemeral range: a port found free there can be taken
by any outgoing connection of this machine (a client, a Redis connection) before
the service binds it, and a run of consecutive ports (``--port``, ``--port + 1``
for proxy replicas; a node's instance ports) is checked whole.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["NoFreePortsError", "free_ports"]

LOWEST = 20000


class NoFreePortsError(RuntimeError):
    """No run of free ports was found."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int = 1, taken: set[int] | None = None, tries: int = 200) -> int:
    """A base port whose ``count`` consecutive ports are free on the loopback now, none
    in ``taken`` (ports already chosen for this run; the new ones are added to it)."""
    high = max(_ephemeral_low(), LOWEST + 2 * count) - count
    for _ in range(tries):
        base = random.randint(LOWEST, high)
        ports = range(base, base + count)
        if taken is not None and taken.intersection(ports):
            continue
        socks: list[socket.socket] = []
        try:
            for port in ports:
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        if taken is not None:
            taken.update(ports)
        return base
    raise NoFreePortsError(f"no {count} consecutive free ports found")
