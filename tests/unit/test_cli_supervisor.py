"""`aegaeon serve`'s supervisor starts children by stage: a stage at once, after the one before."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aegaeon_cli.supervisor import Child, StartupError, Supervisor

# A child that, once started, notes which children were ready then (`<name>.saw`), waits
# until the children named after it have started (their `.saw` exists: they run at the same
# time as it, or it never gets ready), becomes ready (writes its file), then idles.
SCRIPT = """
import pathlib, sys, time
tmp, name, watch, peers = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
ready = [n for n in watch.split(",") if n and (tmp / f"{n}.ready").exists()]
(tmp / f"{name}.saw").write_text(",".join(ready))
while not all((tmp / f"{n}.saw").exists() for n in peers.split(",") if n):
    time.sleep(0.01)
(tmp / f"{name}.ready").write_text("ready")
time.sleep(60)
"""
NAMES = ("cachemgr", "prefill-0", "decode-0", "proxy")


def _child(tmp: Path, name: str, stage: int, peers: tuple[str, ...] = (),
           start_early: bool = False) -> Child:  # fmt: skip
    flag = tmp / f"{name}.ready"
    argv = [sys.executable, "-c", SCRIPT, str(tmp), name, ",".join(NAMES), ",".join(peers)]
    return Child(name=name, argv=argv, ready=flag.exists, log_path=tmp / f"{name}.log",
                 stage=stage, start_early=start_early)  # fmt: skip


def _saw(tmp: Path, name: str) -> set[str]:
    """The children that were ready when ``name`` started."""
    return set(filter(None, (tmp / f"{name}.saw").read_text().split(",")))


def test_instances_start_together_between_the_cachemgr_and_the_proxy(tmp_path: Path) -> None:
    # each instance gets ready only once the other has started: started one after the
    # other's readiness, the start would time out
    children = [_child(tmp_path, "cachemgr", 0),
                _child(tmp_path, "prefill-0", 1, peers=("decode-0",)),
                _child(tmp_path, "decode-0", 1, peers=("prefill-0",)),
                _child(tmp_path, "proxy", 2)]  # fmt: skip
    sup = Supervisor(children, ready_timeout_s=60)
    try:
        sup.start_all()
        # stage 1 started once the cachemgr was ready, before either instance was
        assert _saw(tmp_path, "prefill-0") == _saw(tmp_path, "decode-0") == {"cachemgr"}
        # stage 2 once every instance was ready
        assert _saw(tmp_path, "proxy") == {"cachemgr", "prefill-0", "decode-0"}
    finally:
        sup.stop_all(timeout_s=5)
    assert not any(c.alive() for c in children)


def test_children_that_start_early_start_with_the_first_stage_and_are_ready_after_it(
    tmp_path: Path,
) -> None:
    # a node's instances and proxy wait for their predecessors themselves: they start
    # beside the cachemgr, which here gets ready only once both instances have started
    children = [_child(tmp_path, "cachemgr", 0, peers=("prefill-0", "decode-0")),
                _child(tmp_path, "prefill-0", 1, start_early=True),
                _child(tmp_path, "decode-0", 1, start_early=True),
                _child(tmp_path, "proxy", 2)]  # fmt: skip
    sup = Supervisor(children, ready_timeout_s=60)
    ready: list[str] = []
    sup._wait_ready = _noting(sup._wait_ready, ready)  # type: ignore[method-assign]
    try:
        sup.start_all()
        # the instances started before the cachemgr was ready
        assert "cachemgr" not in _saw(tmp_path, "prefill-0") | _saw(tmp_path, "decode-0")
        # readiness is still waited for stage by stage: the proxy (not early) started
        # once every instance was ready
        assert ready == ["cachemgr", "prefill-0,decode-0", "proxy"]
        assert _saw(tmp_path, "proxy") == {"cachemgr", "prefill-0", "decode-0"}
    finally:
        sup.stop_all(timeout_s=5)
    assert not any(c.alive() for c in children)


def _noting(wait: Callable[[list[Child], list[Child]], None],
            ready: list[str]) -> Callable[[list[Child], list[Child]], None]:  # fmt: skip
    """``Supervisor._wait_ready`` that notes, in ``ready``, each stage it waited for."""
    def noted(children: list[Child], early: list[Child]) -> None:
        wait(children, early)
        ready.append(",".join(c.name for c in children))

    return noted


@pytest.mark.parametrize("early", [False, True], ids=["in-its-stage", "started-early"])
def test_a_child_dying_in_its_stage_stops_the_start_with_its_log(tmp_path: Path,
                                                                 early: bool) -> None:  # fmt: skip
    bad = Child(name="decode-0", argv=[sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                ready=lambda: False, log_path=tmp_path / "decode-0.log", stage=1,
                start_early=early)  # fmt: skip
    if early:  # the cachemgr never gets ready: decode-0's exit ends the first stage's wait
        children = [_child(tmp_path, "cachemgr", 0, peers=("never",)), bad]
    else:  # prefill-0 waits for a peer that never starts: only decode-0's exit ends the stage
        children = [_child(tmp_path, "cachemgr", 0),
                    _child(tmp_path, "prefill-0", 1, peers=("never",)), bad]  # fmt: skip
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


# A service that dies at start, of an error raised while handling another.
DIES = """
from aegaeon_common.process import run_service

def read_weights():
    raise FileNotFoundError("/m/qwen2-19m/model.safetensors: missing file")

async def main(stop):
    try:
        read_weights()
    except OSError as exc:
        raise RuntimeError("decode-0: could not build the worker") from exc

raise SystemExit(run_service("decode-0", main, child=False))
"""


def test_a_service_that_dies_says_why_in_one_line_that_the_supervisor_repeats(
    tmp_path: Path,
) -> None:
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    bad = Child(name="decode-0", argv=[sys.executable, str(script)], ready=lambda: False,
                log_path=tmp_path / "decode-0.log")  # fmt: skip
    sup = Supervisor([bad], ready_timeout_s=60)
    try:
        with pytest.raises(StartupError) as info:
            sup.start_all()
    finally:
        sup.stop_all(timeout_s=5)
    cause = ("aegaeon decode-0: fatal: decode-0: could not build the worker: FileNotFoundError:"
             " /m/qwen2-19m/model.safetensors: missing file (dies.py:5 in read_weights)")
    head = "decode-0 exited with status 1 during start-up"
    assert str(info.value) == f"{head}: {cause} (log: {bad.log_path})"
    log = bad.log_path.read_text().splitlines()
    at = log.index(cause)  # the line, before the logged traceback
    assert any("Traceback" in line for line in log[at + 1:])


def test_the_cause_is_the_bottom_of_the_chain() -> None:
    from aegaeon_common.process import fatal_line, root_cause

    try:
        try:
            {}["model"]
        except KeyError:
            raise ValueError("bad\n  value") from None  # the context is suppressed
    except ValueError as exc:
        assert root_cause(exc) is exc
        assert fatal_line("proxy", exc).startswith("aegaeon proxy: fatal: ValueError: bad value (")
