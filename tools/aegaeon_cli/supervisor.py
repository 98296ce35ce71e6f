"""Start, watch and stop the service processes of one node.

Children are started in dependency stages (cachemgr; every instance at once;
the proxy), a stage's children all ready before the next stage starts, but a
child that waits for its predecessors itself (``Child.start_early``: a node's
instances reach for their cachemgr until it answers, its proxy takes the
instances' reports whichever binds first) starts with the first stage, so its
imports and its own building overlap theirs; it still counts as ready only when
it says so, after the stages before it. A
child that exits while the supervisor is not stopping is logged and
restarted (with backoff), whether it died or drained after a SIGTERM sent to
it alone (a rolling restart: the others keep serving). A child that dies says
why in one line (``aegaeon NAME: fatal: ...``, ``aegaeon_common.process``): the
supervisor repeats that line when it stops because of it (a child that could not
start) and logs it with every restart. A child whose ``/health`` says it is
stalled (an instance whose compute thread made no progress for
``health.stall_s`` with work to do: a 503 with status ``stalled``,
``aegaeon_runtime.liveness``) is asked for its stacks, killed and restarted the
same way. Stop sends SIGTERM
stage by stage in reverse order (the proxy first, then every instance at
once, the cachemgr last, which owns every shared-memory segment and unlinks
them), waits up to the drain timeout plus a margin for each stage to drain
and exit, and kills what is left.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aegaeon_common.logs import get_logger
from aegaeon_common.process import STACKS_SIGNAL, TASKS_SIGNAL, is_ready, last_fatal_line

log = get_logger("supervisor")


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    log_path: Path
    stage: int = 0  # started with the other children of its stage, after every earlier one
    # It maps the first child's (the cachemgr's) shared memory: when that child dies,
    # this one is killed and started again with it (its state lived in that memory).
    maps_cache: bool = False
    # It waits for the children of the earlier stages itself (it retries reaching them):
    # started with the first stage rather than once they are ready. Its stage still
    # orders readiness (the start waits for it after the stages before) and the stop.
    start_early: bool = False
    # how long it may take to stop after SIGTERM (None: the supervisor's stop_timeout_s);
    # a child that supervises children of its own needs their timeout and a margin
    stop_timeout_s: float | None = None
    # its /health URL (None: not known yet, or it has none); polled for a stall
    health_url: Callable[[], str | None] | None = None
    proc: subprocess.Popen[bytes] | None = None
    # why its current process is stalled (its /health said so), else None
    stalled: str | None = None
    stalled_pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.5
    history: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        # A session of its own: a terminal's Ctrl-C reaches only the supervisor,
        # which then stops the children in order (cachemgr last).
        self.proc = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        self.started_at = time.monotonic()
        self.stalled = self.stalled_pid = None
        log.info("started", child=self.name, pid=self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def cause(self) -> str | None:
        """The one line in which this child said why it died (None: it did not)."""
        return last_fatal_line(self.log_path)

    def death(self, code: int | None, when: str = "") -> str:
        """One line: this child exited, and why (its own words, else its log's end)."""
        head = f"{self.name} exited with status {code}{when}"
        cause = self.cause()
        if cause is not None:
            return f"{head}: {cause} (log: {self.log_path})"
        return f"{head}; last log lines ({self.log_path}):\n{self.tail()}"


class StartupError(RuntimeError):
    pass


DRAIN_MARGIN_S = 10.0  # past a child's own drain timeout before it is killed
HEALTH_POLL_S = 1.0  # how often each child's /health is asked whether it stalled
HEALTH_TIMEOUT_S = 2.0


def stall_of(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why the service at ``url`` (its /health) says it is stalled, or None: healthy, or
    not answering (starting, or gone: its exit is noticed on its own)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read()
            return None
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            return None
        if exc.code == 503 and isinstance(body, dict) and body.get("status") == "stalled":
            return str(body.get("reason") or "stalled")
        return None
    except (OSError, ValueError):
        return None


def watch_health(children: list[Child], poll_s: float = HEALTH_POLL_S) -> threading.Event:
    """Start a daemon thread asking every child with a /health URL whether it stalled, so
    the watch loop (which must not wait on HTTP) only reads ``Child.stalled``; setting
    the event returned ends it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(poll_s):
            for child in children:
                if child.health_url is None or not child.alive() or child.proc is None:
                    continue
                if child.stalled is not None and child.stalled_pid == child.proc.pid:
                    continue  # already said; the watch loop kills it
                url = child.health_url()
                reason = stall_of(url) if url else None
                if reason is not None:
                    child.stalled_pid, child.stalled = child.proc.pid, reason

    threading.Thread(target=run, name="aegaeon-health", daemon=True).start()
    return stop


class Supervisor:
    """Owns the children; ``run()`` blocks until a stop signal.

    ``stop_timeout_s``: how long a stage may take to exit after SIGTERM (the
    services' drain timeout plus :data:`DRAIN_MARGIN_S`) before SIGKILL.
    """

    def __init__(
        self,
        children: list[Child],
        ready_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.children = children
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._stopping = False

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def _wait_ready(self, children: list[Child], early: list[Child]) -> None:
        """Until every one of ``children`` reports ready (one deadline for all); a child
        of ``children`` or ``early`` (started before its stage) that exits ends it."""
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(children)
        while waiting:
            if self._stopping:
                raise StartupError("stopped during start-up")
            for child in [*early, *waiting]:
                if not child.alive():
                    code = child.proc.returncode if child.proc else None
                    raise StartupError(child.death(code, " during start-up"))
            for child in list(waiting):
                if child.ready():
                    log.info("ready", child=child.name)
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise StartupError(f"{names} not ready after {self.ready_timeout_s:.0f} s")
            if waiting:
                time.sleep(0.1)

    def _stages(self, children: list[Child]) -> list[list[Child]]:
        return [[c for c in children if c.stage == k] for k in sorted({c.stage for c in children})]

    def _start_stages(self, children: list[Child]) -> None:
        early = [c for c in children if c.start_early]
        for child in early:
            child.start()
        for stage in self._stages(children):
            for child in stage:
                if not child.start_early:
                    child.start()
            self._wait_ready(stage, [c for c in early if c not in stage])

    def start_all(self) -> None:
        self._start_stages(self.children)

    def watch(self, on_ready: Callable[[], None] | None = None) -> None:
        """Restart children that die, until a stop is requested.

        The first child (cachemgr) owns the shared memory the instances map: when
        it dies, they are killed and restarted with it, in order; the others (the
        proxy) keep serving, answering 503 until the instances are back.
        """
        if on_ready is not None:
            on_ready()
        health = watch_health(self.children)
        try:
            self._watch()
        finally:
            health.set()

    def _kill_stalled(self, child: Child) -> None:
        """A child whose /health says it stalled: its stacks to its log, then SIGKILL
        (a stalled process cannot drain); the exit is restarted like any other."""
        proc = child.proc
        if proc is None or child.stalled_pid != proc.pid or not child.alive():
            return
        log.error("child stalled", child=child.name, pid=proc.pid, reason=child.stalled,
                  log=str(child.log_path))  # fmt: skip
        dump_stacks(proc)
        proc.kill()
        proc.wait()

    def _watch(self) -> None:
        while not self._stopping:
            for position, child in enumerate(self.children):
                if child.stalled is not None and not self._stopping:
                    self._kill_stalled(child)
                if child.alive() or self._stopping:
                    continue
                code = child.proc.returncode if child.proc else None
                if code == 0:  # drained after a SIGTERM of its own: a rolling restart
                    log.info("child exited", child=child.name, status=code)
                else:
                    log.error("child died", child=child.name, status=code,
                              cause=child.cause(), log=str(child.log_path))  # fmt: skip
                # Restart at once after a long healthy run; back off after quick crashes.
                if time.monotonic() - child.started_at < 10.0:
                    time.sleep(child.backoff_s)
                    child.backoff_s = min(child.backoff_s * 2, 10.0)
                else:
                    child.backoff_s = 0.5
                if position == 0:
                    self._restart_with_cache()
                    break
                child.restarts += 1
                child.start()
            time.sleep(0.2)

    def _restart_with_cache(self) -> None:
        """The cachemgr and every child that maps its memory: killed (nothing they
        hold outlives that memory; a drain would wait on a dead cachemgr), restarted
        in stage order (those that start early beside the new cachemgr). The new
        cachemgr removes the old segments."""
        group = [self.children[0], *(c for c in self.children[1:] if c.maps_cache)]
        log.warning("restarting the cache manager and the instances that map its memory",
                    children=[c.name for c in group])  # fmt: skip
        for child in group[1:]:
            if child.alive() and child.proc is not None:
                child.proc.kill()
                child.proc.wait()
        for child in group:
            child.restarts += 1
        try:
            self._start_stages(group)
        except StartupError as exc:
            log.error("restart failed", error=str(exc))

    def _terminate(self, children: list[Child], timeout_s: float | None = None) -> None:
        """SIGTERM each stage at once, last stage first; wait for it to drain and exit
        (up to ``timeout_s``, default ``stop_timeout_s``), then kill what is left."""
        limit = self.stop_timeout_s if timeout_s is None else timeout_s
        for stage in reversed(self._stages(children)):
            running = [c for c in stage if c.alive() and c.proc is not None]
            for child in running:
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            for child in running:
                assert child.proc is not None
                own = limit if timeout_s is not None or child.stop_timeout_s is None else (
                    child.stop_timeout_s)  # fmt: skip
                try:
                    child.proc.wait(timeout=max(0.0, began + own - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("killing", child=child.name, after_s=own,
                                stacks=str(child.log_path))  # fmt: skip
                    dump_stacks(child.proc)
                    child.proc.kill()
                    child.proc.wait()
                log.info("stopped", child=child.name, status=child.proc.returncode)

    def stop_all(self, timeout_s: float | None = None) -> None:
        """Terminate in reverse start order; kill what does not exit in time."""
        self._stopping = True
        self._terminate(self.children, timeout_s)


def dump_stacks(proc: subprocess.Popen[bytes], wait_s: float = 1.0) -> None:
    """Ask a service that did not stop in time where it is stuck: its threads' and its
    asyncio tasks' stacks go to its log (``aegaeon_common.process``)."""
    for sig in (STACKS_SIGNAL, TASKS_SIGNAL):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)


def marked_ready(child: Child, run_dir: Path, name: str) -> Callable[[], bool]:
    """Whether ``child``'s current process marked itself ready as ``name`` in ``run_dir``
    (``aegaeon_common.process.mark_ready``)."""
    return lambda: child.proc is not None and is_ready(run_dir, name, child.proc.pid)


def python_argv(*args: str) -> list[str]:
    """Run an ``aegaeon`` subcommand with this interpreter."""
    return [sys.executable, "-m", "aegaeon_cli.main", *args]


def install_stop_handlers(sup: Supervisor) -> None:
    """Stop on SIGINT/SIGTERM. A request for stacks (:func:`dump_stacks`) is answered
    with this process's and passed on to every live child (down a tree of supervisors
    to the services)."""
    signal.signal(signal.SIGINT, sup.request_stop)
    signal.signal(signal.SIGTERM, sup.request_stop)

    def pass_on(signum: int, _frame: object) -> None:
        for child in sup.children:
            if child.alive() and child.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signum)

    signal.signal(STACKS_SIGNAL, pass_on)  # then this process's own stacks, then pass_on
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=True)
    signal.signal(TASKS_SIGNAL, pass_on)


def supervise(children: list[Child], drain_timeout_s: float, on_ready: Callable[[], None],
              prog: str, shm_prefix: str | None = None) -> int:
    """Start every child (a stage may take ``drain_timeout_s`` plus :data:`DRAIN_MARGIN_S`
    to stop), watch them until a stop signal, stop them all; 1 if they could not start.
    The cachemgr unlinks its shared memory; what is left under ``shm_prefix`` (it was
    killed) is removed here."""
    sup = Supervisor(children, stop_timeout_s=drain_timeout_s + DRAIN_MARGIN_S)
    install_stop_handlers(sup)
    started = time.monotonic()
    try:
        sup.start_all()
        sup.watch(on_ready=on_ready)
    except StartupError as exc:
        # (a child's fatal line in it: a supervisor above this one repeats it in turn)
        print(f"{prog}: {exc} (after {time.monotonic() - started:.0f} s)", file=sys.stderr)
        return 1
    finally:
        sup.stop_all()
        if shm_prefix is not None:
            for path in Path("/dev/shm").glob(f"{shm_prefix}*"):
                path.unlink(missing_ok=True)
    return 0
