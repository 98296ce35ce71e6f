"""The gpu-check runner's steps: each runs in a session of its own, so a Ctrl-C of the
check must end that session itself (nothing the step started outlives the check)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from aegaeon_bench.gpu_check.run import Runner, session_members

# the step starts a grandchild that ignores nothing and sleeps far past the test
STEP = ("import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print('started', flush=True); time.sleep(600)")  # fmt: skip


def test_a_ctrl_c_of_the_check_ends_the_running_step_and_its_children(tmp_path: Path) -> None:
    runner = Runner(tmp_path, time.monotonic() + 600, dict(os.environ), tmp_path,
                    say=lambda _: None)  # fmt: skip
    out, err = tmp_path / "step.out", tmp_path / "step.err"
    sessions: list[int] = []

    def interrupt() -> None:
        give_up = time.monotonic() + 120
        while b"started" not in (out.read_bytes() if out.exists() else b""):
            if time.monotonic() > give_up:
                break
            time.sleep(0.05)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
        sessions.extend(pid for pid in pids if _session_leader_of_step(pid, out))
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C (an earlier test in this process may have put in another)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.spawn([sys.executable, "-c", STEP], out, err, timeout_s=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    thread.join(10)
    assert sessions, "the step's session was not found while it ran"
    assert all(session_members(sid) == [] for sid in sessions)


def _session_leader_of_step(pid: int, out: Path) -> bool:
    """True for the step's own process: its stdout is ``out`` and it leads its session."""
    try:
        fd1 = os.readlink(f"/proc/{pid}/fd/1")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return fd1 == str(out) and int(fields[3]) == pid
