"""POSIX shared-memory regions mapped directly from /dev/shm.

Why not `multiprocessing.shared_memory`: in Python 3.11 it registers even
*attached* segments with the resource tracker, which unlinks them when the
attaching process exits and warns about "leaked" segments. Here the owner
(`ShmRegion.create`) alone unlinks; attachers open `/dev/shm/NAME` and `mmap`
it, and nothing is ever registered with the tracker.

Lifetime invariant: a mapping is never unmapped explicitly. Tensors made by
`torch.frombuffer` keep a reference to the `mmap` object but do not hold a
buffer export, so `mmap.close()` would succeed under a live tensor and leave
it dangling (a segfault on the next access). `close()` therefore only drops
this object's references (and, for the owner, unlinks the name); the pages
stay mapped until the last tensor over them is gone.

Linux only (it relies on /dev/shm being the POSIX shm filesystem).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import warnings
from pathlib import Path

import torch

from aegaeon_gpumem.closing import Closing

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "aegaeon-"
_MAX_NAME_LEN = 200


def validate_name(name: str) -> str:
    """Return `name` if it is a valid Aegaeon segment name, else raise ValueError."""
    if not name.startswith(NAME_PREFIX):
        raise ValueError(f"shared memory name {name!r} must start with {NAME_PREFIX!r}")
    if "/" in name or "\0" in name or len(name) > _MAX_NAME_LEN:
        raise ValueError(f"shared memory name {name!r} has '/', NUL or is too long")
    return name


def unique_name(tag: str) -> str:
    """A fresh segment name `aegaeon-TAG-PID-RANDOM` (unique per process and call)."""
    return validate_name(f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def _frombuffer(mapping: mmap.mmap, readonly: bool) -> torch.Tensor:
    if not readonly:
        return torch.frombuffer(mapping, dtype=torch.uint8)
    # torch has no read-only tensors and warns about non-writable buffers; the
    # page protection (PROT_READ) is what enforces read-only access.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


class ShmRegion(Closing):
    """A named POSIX shared-memory segment mapped into this process.

    `create` makes an owner (its `close()` unlinks the name); `attach` maps an
    existing segment without owning it. `.tensor` is a zero-copy uint8 tensor
    over the whole mapping.

    Read-only attachments are mapped with `PROT_READ`: torch has no read-only
    tensor flag, so a write through `.tensor` is stopped by the MMU and kills
    the process with SIGSEGV instead of corrupting the owner's data.
    """

    def __init__(self, name: str, mapping: mmap.mmap, nbytes: int, owner: bool, readonly: bool):
        self._name = name
        self._mapping: mmap.mmap | None = mapping
        self._nbytes = nbytes
        self._owner = owner
        self._readonly = readonly
        self._tensor: torch.Tensor | None = None

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmRegion:
        """Create a new zero-filled segment `name` of `nbytes` bytes (fails if it exists)."""
        validate_name(name)
        if nbytes <= 0:
            raise ValueError(f"shared memory size must be positive, got {nbytes}")
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, nbytes, owner=True, readonly=False)

    @classmethod
    def attach(cls, name: str, readonly: bool = False, populate: bool = False) -> ShmRegion:
        """Map the existing segment `name` (FileNotFoundError if absent); never owns it.

        `populate` maps every page now (MAP_POPULATE: one pass in the kernel)
        instead of on first touch, where the page faults of a fresh mapping
        slow the first bulk read of it down (see `aegaeon_gpumem.memcopy`).
        """
        validate_name(name)
        fd = os.open(SHM_DIR / name, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes <= 0:
                raise ValueError(f"shared memory segment {name!r} is empty")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
        finally:
            os.close(fd)
        return cls(name, mapping, nbytes, owner=False, readonly=readonly)

    @property
    def name(self) -> str:
        """The segment name (without the /dev/shm/ prefix)."""
        return self._name

    @property
    def nbytes(self) -> int:
        """Size of the segment in bytes."""
        return self._nbytes

    @property
    def owner(self) -> bool:
        """True if this object created the segment and unlinks it on close."""
        return self._owner

    @property
    def readonly(self) -> bool:
        """True if mapped with PROT_READ (writes through `.tensor` fault)."""
        return self._readonly

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._mapping is None

    def linked(self) -> bool:
        """True while the segment's name is in /dev/shm (its owner has not unlinked it).

        An attacher's mapping outlives an unlink (the pages stay until the
        last mapping goes); this is how it learns that the owner let go.
        """
        return (SHM_DIR / self._name).exists()

    @property
    def mapping(self) -> mmap.mmap:
        """The underlying `mmap` object (for memoryview/numpy access)."""
        if self._mapping is None:
            raise ValueError(f"shared memory region {self._name!r} is closed")
        return self._mapping

    @property
    def tensor(self) -> torch.Tensor:
        """A zero-copy uint8 tensor over the whole segment (the same tensor each call)."""
        if self._tensor is None:
            self._tensor = _frombuffer(self.mapping, self._readonly)
        return self._tensor

    def close(self) -> None:
        """Drop this process's references; the owner also unlinks the name.

        Idempotent. Tensors obtained earlier stay valid (see module docstring).
        """
        if self._mapping is None:
            return
        self._mapping = None
        self._tensor = None
        if self._owner:
            # FileNotFoundError: already removed by cleanup_prefix of a restarted owner.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / self._name)

    def __repr__(self) -> str:
        role = "owner" if self._owner else ("ro" if self._readonly else "rw")
        return f"ShmRegion({self._name!r}, {self._nbytes} bytes, {role})"


def list_segments(prefix: str) -> list[str]:
    """Names of existing segments starting with `prefix` (which must start with aegaeon-)."""
    validate_name(prefix)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def cleanup_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix`; return the names removed.

    For an owner restarting after a crash. `prefix` must start with `aegaeon-`
    (so a bare prefix cannot reach other programs' segments). Processes that
    still map a removed segment keep their pages until they unmap.
    """
    removed = []
    for name in list_segments(prefix):
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
            continue  # raced with another cleaner
        removed.append(name)
    return removed
