"""`aegaeon serve`'s supervisor starts children by stage: a stage at once, after the one before."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from aegaeon_cli.supervisor import Child, StartupError, Supervisor

# A child that becomes ready (writes its file) DELAY seconds after it starts, then idles.
SCRIPT = ("import pathlib, sys, time; time.sleep(float(sys.argv[2])); "
          "pathlib.Path(sys.argv[1]).write_text(str(time.time())); time.sleep(60)")  # fmt: skip


def _child(tmp: Path, name: str, stage: int, delay_s: float = 0.5) -> Child:
    flag = tmp / f"{name}.ready"
    return Child(name=name, argv=[sys.executable, "-c", SCRIPT, str(flag), str(delay_s)],
                 ready=flag.exists, log_path=tmp / f"{name}.log", stage=stage)  # fmt: skip


def _ready_at(tmp: Path, name: str) -> float:
    return float((tmp / f"{name}.ready").read_text())


def test_instances_start_together_between_the_cachemgr_and_the_proxy(tmp_path: Path) -> None:
    children = [_child(tmp_path, "cachemgr", 0), _child(tmp_path, "prefill-0", 1, 1.0),
                _child(tmp_path, "decode-0", 1, 1.0), _child(tmp_path, "proxy", 2)]  # fmt: skip
    sup = Supervisor(children, ready_timeout_s=60)
    wall = time.time() - time.monotonic()  # started_at is monotonic
    try:
        sup.start_all()
        started = {c.name: wall + c.started_at for c in children}
        # stage 1: both started after the cachemgr was ready, before either was ready
        for name in ("prefill-0", "decode-0"):
            assert started[name] >= _ready_at(tmp_path, "cachemgr") - 0.05
            assert started[name] < min(_ready_at(tmp_path, n) for n in ("prefill-0", "decode-0"))
        assert started["proxy"] >= max(_ready_at(tmp_path, n) for n in ("prefill-0", "decode-0"))
    finally:
        sup.stop_all(timeout_s=5)
    assert not any(c.alive() for c in children)


def test_a_child_dying_in_its_stage_stops_the_start_with_its_log(tmp_path: Path) -> None:
    bad = Child(name="decode-0", argv=[sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                ready=lambda: False, log_path=tmp_path / "decode-0.log", stage=1)  # fmt: skip
    children = [_child(tmp_path, "cachemgr", 0), _child(tmp_path, "prefill-0", 1, 30.0), bad]
    sup = Supervisor(children, ready_timeout_s=60)
    try:
        with pytest.raises(StartupError, match=r"decode-0 exited with status 3(.|\n)*boom"):
            sup.start_all()
    finally:
        sup.stop_all(timeout_s=5)
    assert not any(c.alive() for c in children)


# A service that never returns after SIGTERM: its main waits on an event nobody sets.
STUCK = """
import asyncio, pathlib, sys
from aegaeon_common.process import run_service

async def main(stop):
    pathlib.Path(sys.argv[1]).write_text("up")
    await stop.wait()
    await asyncio.Event().wait()  # stuck_after_stop

run_service("stuck", main, child=False)
"""


def test_a_child_that_does_not_stop_leaves_its_stacks_in_its_log(tmp_path: Path) -> None:
    flag, script = tmp_path / "stuck.ready", tmp_path / "stuck.py"
    script.write_text(STUCK)
    child = Child(name="stuck", argv=[sys.executable, str(script), str(flag)],
                  ready=flag.exists, log_path=tmp_path / "stuck.log")  # fmt: skip
    sup = Supervisor([child], ready_timeout_s=60)
    try:
        sup.start_all()
    finally:
        sup.stop_all(timeout_s=1.0)
    assert not child.alive() and child.proc is not None and child.proc.returncode == -9
    log = child.log_path.read_text()
    assert "Current thread" in log or "Thread 0x" in log  # every thread's stack
    assert "asyncio tasks of pid" in log and "stuck_after_stop" in log  # the task, and where


async def test_a_task_that_swallows_its_cancel_is_named_not_waited_for() -> None:
    import asyncio

    from aegaeon_common.process import cancel_tasks

    stop = False

    async def stubborn() -> None:  # a loop that catches what a cancelled call raised
        while not stop:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue

    async def polite() -> None:
        await asyncio.sleep(60)

    tasks = [asyncio.create_task(stubborn(), name="stubborn"),
             asyncio.create_task(polite(), name="polite")]  # fmt: skip
    await asyncio.sleep(0.01)
    assert await cancel_tasks(tasks, timeout_s=0.5) == ["stubborn"]
    assert tasks[1].cancelled()
    stop = True  # its own flag ends it
    await asyncio.wait_for(tasks[0], 5)
