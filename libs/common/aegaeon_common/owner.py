"""Whose is a temporary file, and does its writer still run?

A process that writes something it must remove later (a market import's
staging folder, a shared-memory segment) puts its *stamp* in the name:
``HOST-TAG.PID``. HOST is this machine's host name (for people reading a
listing); TAG is a digest of the boot (``/proc/sys/kernel/random/boot_id``) and
of the PID namespace, so a PID is only ever checked where it means the same
process: on another machine, in another container or after a reboot the stamp
is *foreign* and its PID is never looked up here. A market is often a shared
volume, and a PID checked on the wrong machine could name anything.

:func:`owner_state` says whether the writer of a stamp is ``alive``, ``gone``
(a local PID that no longer runs, or runs a process started after the file was
last written: the PID was reused) or ``unknown`` (a foreign stamp).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

OwnerState = Literal["alive", "gone", "unknown"]
STAMP = re.compile(r"(?P<tag>[A-Za-z0-9-]+)\.(?P<pid>[0-9]+)")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9-]+")
# a process's start time is known to a clock tick; allow for it and for clock steps
START_SLACK_S = 2.0


@dataclass(frozen=True)
class Stamp:
    """Who wrote a file: the writer's machine tag and its PID there."""

    tag: str
    pid: int

    def __str__(self) -> str:
        return f"{self.tag}.{self.pid}"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


@functools.cache
def machine_tag() -> str:
    """``HOST-DIGEST``: this host's name and where its PIDs mean one process (the boot and
    the PID namespace); the same in every process of one container or machine."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    digest = hashlib.sha1(f"{boot}|{namespace}".encode()).hexdigest()[:6]
    host = _HOST_CHARS.sub("-", socket.gethostname().split(".")[0]).strip("-")[:24] or "host"
    return f"{host}-{digest}"


def stamp() -> Stamp:
    """This process's stamp."""
    return Stamp(machine_tag(), os.getpid())


def parse_stamp(text: str) -> Stamp | None:
    """The stamp ``text`` is (``HOST-TAG.PID``), or None."""
    match = STAMP.fullmatch(text)
    return Stamp(match.group("tag"), int(match.group("pid"))) if match else None


def owner_state(owner: Stamp, last_written_s: float) -> OwnerState:
    """Whether the writer of a file stamped ``owner`` and last written at
    ``last_written_s`` (epoch seconds) still runs."""
    if owner.tag != machine_tag():
        return "unknown"
    try:
        process = psutil.Process(owner.pid)
        started_s = process.create_time()
        if process.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped
            return "gone"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:  # it exists; we may not look closer (another user's)
        return "alive"
    # the writer ran before it wrote: a process started after the last write is
    # another one that was given the same PID
    return "gone" if started_s > last_written_s + START_SLACK_S else "alive"
