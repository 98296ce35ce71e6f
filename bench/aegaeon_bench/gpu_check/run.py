"""The plumbing of ``scripts/gpu-check``: one step = one subprocess with a deadline.

Standard library only: this runs on a GPU machine before the carried wheels
are installed, with whatever ``python3`` is there. Each step runs in a
session of its own (its whole process tree is ended on a timeout), its
stdout and stderr go to two files under the logs folder, and its outcome is a
:class:`StepResult` whatever happened: ``ok``, ``failed`` (non-zero exit),
``timeout``, ``error`` (the step's own code raised) or ``skipped``. A step that
fails never stops the next one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import tarfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ERROR_TAIL_CHARS = 4000
KILL_GRACE_S = 10.0
LOG_TAIL_BYTES = 2 << 20  # per file in the tarball
MAX_ARCHIVE_BYTES = 15 << 20  # a file the device tool returns holds at most 16 MiB

STATUSES = ("ok", "failed", "timeout", "error", "skipped")


@dataclass
class StepResult:
    """One step's outcome, as it goes into the JSON summary."""

    name: str
    status: str = "skipped"
    duration_s: float = 0.0
    timeout_s: float | None = None
    returncode: int | None = None
    argv: list[str] | None = None
    results: Any = None
    error: str | None = None
    logs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "duration_s": round(self.duration_s, 2)}


def market_models(market: Path) -> list[dict[str, Any]]:
    """``market.json``'s entries as written (read before the project is installed)."""
    return list(json.loads((market / "market.json").read_text())["models"])


def tail(path: Path, num_chars: int = ERROR_TAIL_CHARS) -> str:
    """The last ``num_chars`` characters of a text file ('' if it is missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 4 * num_chars, 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text[-num_chars:]


def last_json_line(path: Path) -> Any:
    """The last line of ``path`` that parses as a JSON object, else None."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        line = raw.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def end_session(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
                grace_s: float = KILL_GRACE_S) -> None:
    """Signal the session ``proc`` leads (the whole step), then SIGKILL what is left."""
    for s in (sig, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, s)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            continue
        if not session_members(proc.pid):
            return
        time.sleep(0.5)
    # the leader is gone; stragglers of the session get SIGKILL one by one
    for pid in session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
    return text[text.rfind(")") + 2 :].split()


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields and fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry.name))
    return out


def processes_mentioning(text: str) -> list[dict[str, Any]]:
    """Live processes whose command line contains ``text`` (this one excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in argv if a)
        fields = _proc_stat(int(entry.name))
        if text in line and fields and fields[0] != "Z":
            found.append({"pid": int(entry.name), "cmdline": line[:300]})
    return found


def shm_segments(prefix: str = "aegaeon-") -> set[str]:
    """Names in /dev/shm starting with ``prefix``."""
    try:
        return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}
    except OSError:
        return set()


@dataclass
class Runner:
    """Runs steps against one deadline, logging under ``logs``."""

    logs: Path
    deadline: float  # time.monotonic()
    env: Mapping[str, str]
    cwd: Path
    say: Callable[[str], None] = print
    results: list[StepResult] = field(default_factory=list)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, cap_s: float, reserve_s: float = 0.0) -> float:
        """``cap_s``, or less when the deadline (minus ``reserve_s`` for later steps) is near."""
        return max(min(cap_s, self.left_s() - reserve_s), 0.0)

    def skip(self, name: str, why: str) -> StepResult:
        result = StepResult(name, "skipped", error=why)
        self.say(f"gpu-check: {name}: skipped ({why})")
        self.results.append(result)
        return result

    def command(self, name: str, argv: Sequence[str], cap_s: float, reserve_s: float = 0.0,
                parse: Callable[[Path, Path], Any] | None = None,
                env: Mapping[str, str] | None = None) -> StepResult:
        """Run ``argv`` as step ``name``; ``parse(stdout, stderr)`` makes its results."""
        timeout_s = self.budget(cap_s, reserve_s)
        if timeout_s < 1:
            return self.skip(name, "no time left")
        result = StepResult(name, timeout_s=round(timeout_s, 1), argv=list(argv))
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.err"
        result.logs = [out.name, err.name]
        self.say(f"gpu-check: {name}: running (up to {timeout_s:.0f} s)")
        start = time.monotonic()
        try:
            result.status, result.returncode = self.spawn(argv, out, err, timeout_s, env)
        except OSError as exc:
            result.status, result.error = "error", f"{type(exc).__name__}: {exc}"
        result.duration_s = time.monotonic() - start
        if parse is not None:
            try:
                result.results = parse(out, err)
            except Exception:  # a parser bug must not lose the step's other fields
                result.error = "parsing the output failed:\n" + traceback.format_exc()[-2000:]
        if result.status != "ok" and result.error is None:
            result.error = tail(err) or tail(out)
        return self.record(result)

    def spawn(self, argv: Sequence[str], out: Path, err: Path, timeout_s: float,
              env: Mapping[str, str] | None = None) -> tuple[str, int | None]:
        """Run to completion or timeout (the whole session ended); (status, returncode)."""
        with out.open("wb") as fout, err.open("wb") as ferr:
            proc = subprocess.Popen(list(argv), stdout=fout, stderr=ferr,
                                    stdin=subprocess.DEVNULL, cwd=self.cwd,
                                    env=dict(env or self.env), start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            end_session(proc)
            return "timeout", proc.returncode
        except BaseException:  # Ctrl-C of the check: its own session never saw the SIGINT
            end_session(proc, signal.SIGINT, grace_s=5.0)
            raise
        end_session(proc, grace_s=2.0)  # whatever it left running in its session
        return ("ok" if code == 0 else "failed"), code

    def call(self, name: str, fn: Callable[[StepResult], None]) -> StepResult:
        """Run ``fn(result)`` in this process as step ``name`` (it sets status and results)."""
        result = StepResult(name, status="ok")
        self.say(f"gpu-check: {name}: running")
        start = time.monotonic()
        try:
            fn(result)
        except Exception:
            result.status, result.error = "error", traceback.format_exc()[-ERROR_TAIL_CHARS:]
        result.duration_s = time.monotonic() - start
        return self.record(result)

    def record(self, result: StepResult) -> StepResult:
        self.say(f"gpu-check: {result.name}: {result.status} in {result.duration_s:.1f} s")
        self.results.append(result)
        return result


def pack_logs(folders: Sequence[Path], out: Path, tail_bytes: int = LOG_TAIL_BYTES) -> list[str]:
    """A tar.gz of every file under ``folders`` (the last ``tail_bytes`` of each), under
    ``MAX_ARCHIVE_BYTES`` (packed again with shorter tails until it is); its members."""
    members = []
    with tarfile.open(out, "w:gz") as tar:
        for folder in folders:
            if not folder.is_dir():
                continue
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                if path.is_socket() or path.suffix == ".sock":
                    continue
                name = f"{folder.name}/{path.relative_to(folder)}"
                try:
                    size = path.stat().st_size
                    with path.open("rb") as f:
                        f.seek(max(size - tail_bytes, 0))
                        data = f.read()
                except OSError:
                    continue
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
                members.append(name)
    if out.stat().st_size > MAX_ARCHIVE_BYTES and tail_bytes > 4096:
        return pack_logs(folders, out, tail_bytes // 4)
    return members
