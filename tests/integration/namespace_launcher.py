"""Inside ``unshare --pid --fork --mount``: make this mount namespace a container's, then exec.

Run as ``python namespace_launcher.py SPEC.json`` by ``test_container_namespaces``:
it is PID 1 of a new PID namespace with a private copy of the mounts. SPEC (JSON):

- ``binds``: ``[{"path": P, "target": T, "ro": bool}]``: what compose mounts into every
  container (the run volume; the market and the config, read-only; the node's
  /dev/shm, compose's ``ipc: service:cachemgr``: a tmpfs the test keeps), ``target``
  where it appears here (default: ``path``);
- ``env`` and ``argv``: the service to exec.

Steps: the shared paths bound to a private staging tmpfs on /mnt (they may be under
/tmp, which is replaced next), a private tmpfs on /tmp (a container's own), the
shared paths bound back to their targets, a /proc of this PID namespace, then
``execvpe``. Mounts go through ``mount(2)`` directly (no ``mount(8)`` needed).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]  # fmt: skip


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:  # fmt: skip
    def enc(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source} -> {target}: {os.strerror(code)}")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    mount("tmpfs", "/mnt", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,size=1m")
    staged = []
    for k, bind in enumerate(spec["binds"]):
        source = Path(bind["path"])
        stage = Path(f"/mnt/{k}")
        if source.is_dir():
            stage.mkdir()
        else:
            stage.touch()
        mount(str(source), str(stage), None, MS_BIND)
        staged.append((stage, Path(bind.get("target") or bind["path"]), bool(bind.get("ro"))))
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=512m")
    for stage, target, read_only in staged:
        if stage.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
        mount(str(stage), str(target), None, MS_BIND)
        if read_only:
            mount(None, str(target), None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    main(sys.argv[1])
