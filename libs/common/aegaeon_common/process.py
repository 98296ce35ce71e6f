"""Process entry habits: a title, logging, death with the parent, clean signals."""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import gc
import io
import linecache
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

from aegaeon_common.logs import get_logger, setup_logging

_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def run_fast(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on uvloop when it is installed (the services' loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# What a stuck process is asked for before it is killed (the supervisor sends both):
# every thread's Python stack (faulthandler: answered even when the event loop is
# blocked in C) and every asyncio task's stack (by the loop, if it still runs).
STACKS_SIGNAL = signal.SIGUSR1
TASKS_SIGNAL = signal.SIGUSR2


def _await_chain(awaitable: object, out: io.StringIO) -> None:
    """Where a task waits: each coroutine of its ``await`` chain, innermost last."""
    for _ in range(64):
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is None:
            print(f"  awaiting {awaitable!r}", file=out)
            return
        code = frame.f_code
        print(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}', file=out)
        print(f"    {linecache.getline(code.co_filename, frame.f_lineno).strip()}", file=out)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)


def _print_tasks() -> None:
    out = io.StringIO()
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}:", file=out)
        _await_chain(task.get_coro(), out)
    print(f"asyncio tasks of pid {os.getpid()}:\n{out.getvalue()}", file=sys.stderr, flush=True)


async def cancel_tasks(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0) -> list[str]:
    """Cancel ``tasks`` and wait at most ``timeout_s`` for them to end; returns the names
    of those still running. A task can swallow its cancellation (a library that turns
    it into an error the task's loop catches and carries on after): waiting for it
    without a bound kept a process from ever exiting, so a loop that catches errors
    must also stop on a flag of its own."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    pending: set[asyncio.Task[Any]] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error of a task being stopped is not news
    return sorted(task.get_name() for task in pending)


FATAL = ": fatal: "  # what marks a service's one-line cause of death in its output
_FATAL_SCAN_BYTES = 1 << 20


def root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain (``raise ... from``, or raised
    while handling another): what went wrong first."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def fatal_line(name: str, exc: BaseException) -> str:
    """One line naming why service ``name`` stops: its root cause's type and message
    and where it was raised (``aegaeon NAME: fatal: Type: message (file.py:123 in fn)``)."""
    cause = root_cause(exc)
    text = " ".join(str(cause).split()) or "(no message)"
    where = ""
    tb = cause.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        where = f" ({Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name})"
    outer = "" if cause is exc else f"{' '.join(str(exc).split())}: "
    return f"aegaeon {name}{FATAL}{outer}{type(cause).__name__}: {text}{where}"


def last_fatal_line(log_path: Path) -> str | None:
    """The last one-line cause of death (:func:`fatal_line`) a service wrote to its log
    at ``log_path`` (its end is read), or None."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _FATAL_SCAN_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [ln for ln in tail.splitlines() if ln.startswith("aegaeon ") and FATAL in ln]
    return lines[-1] if lines else None


def run_service(
    name: str, main: Callable[[asyncio.Event], Coroutine[Any, Any, None]], *, child: bool = True
) -> int:
    """Run one service's asyncio ``main(stop_event)`` until SIGINT/SIGTERM.

    ``main`` must return soon after ``stop_event`` is set, having released its
    resources. A fatal error gives exit status 1: first one line on stderr naming its
    cause (:func:`fatal_line`; a supervisor repeats it), then the logged traceback.
    """
    # The service's modules are imported (torch among them): their objects live as long as
    # the process. Frozen, a full collection while serving no longer walks them (shorter
    # pauses), nor does the one at exit (a cachemgr's stop took a second more without).
    gc.freeze()
    set_title(f"aegaeon-{name}")
    setup_logging(name)
    if child:
        die_with_parent()
    log = get_logger("process")
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(TASKS_SIGNAL, _print_tasks)
        await main(stop)

    try:
        run_fast(runner())
    except Exception as exc:
        line = fatal_line(name, exc)
        print(line, file=sys.stderr, flush=True)
        log.exception("fatal", service=name, cause=line)
        return 1
    return 0


def private_dir(path: Path) -> Path:
    """Make ``path`` (a run directory: sockets, ready and address files) exist with
    mode 0700: only this user may connect to the node's ipc:// sockets or read its
    files. A directory of another user is refused (PermissionError), not used."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not this user")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def ready_path(run_dir: Path, name: str) -> Path:
    """Where service ``name`` announces readiness (its pid) to the supervisor."""
    return run_dir / f"{name}.ready"


def mark_ready(run_dir: Path, name: str) -> Path:
    """Write this process's pid to its ready file (atomically)."""
    path = ready_path(run_dir, name)
    private_dir(path.parent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(path)
    return path


def is_ready(run_dir: Path, name: str, pid: int) -> bool:
    """True once the process ``pid`` has marked service ``name`` ready."""
    try:
        return int(ready_path(run_dir, name).read_text().strip()) == pid
    except (OSError, ValueError):
        return False
