"""Issue 46: what a killed market writer leaves behind is removed, and said so; a live
writer's files never are.

The first test is the issue's: a ``market add`` killed with SIGKILL mid-write, a
second one stopped mid-write (alive), then ``market list`` and another ``market add``.
The rest build leftovers by hand and check each rule of ``aegaeon_market.leftovers``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aegaeon_cli.main import main
from aegaeon_common.owner import machine_tag, owner_state, parse_stamp, stamp
from aegaeon_market import leftovers
from aegaeon_market.create import create_market
from aegaeon_market.leftovers import format_bytes, sweep

BIG = "llama-3.1-8b"  # 16 GB when finished: never finished here, killed or stopped mid-write
WRITTEN_BYTES = 1 << 20  # mid-write: this much of the model is on disk


@pytest.fixture
def market(tmp_path: Path) -> Path:
    root = tmp_path / "m"
    create_market(root, 1, 0, "bfloat16", "small", progress=False)
    return root


def _start_add(market: Path, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "aegaeon_cli.main", "market", "add", "--market", str(market),
            "--random", BIG, "--name", name, "--quiet"]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _mid_write(market: Path, name: str, proc: subprocess.Popen[bytes]) -> Path:
    """The add's staging folder once it holds WRITTEN_BYTES (the add still running)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        for staging in market.glob(f".add-{name}.*.tmp"):
            if sum(p.stat().st_size for p in staging.rglob("*") if p.is_file()) >= WRITTEN_BYTES:
                return staging
        time.sleep(0.02)
    raise AssertionError(f"`market add {name}` wrote nothing in 300 s")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _nbytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_killed_add_is_removed_by_the_next_command_a_running_one_never(
    market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    index = (market / "market.json").read_bytes()
    models = sorted(p.name for p in market.iterdir())
    # both at work at once (an add sweeps as it starts), then one killed, one stopped
    killed, running = _start_add(market, "big1", env), _start_add(market, "big2", env)
    try:
        dead = _mid_write(market, "big1", killed)
        live = _mid_write(market, "big2", running)
        running.send_signal(signal.SIGSTOP)  # alive, mid-write, for as long as we look
        _kill(killed)
        assert dead.is_dir() and (market / "market.json").read_bytes() == index
        dead_bytes, live_bytes = _nbytes(dead), _nbytes(live)

        assert main(["market", "list", "--market", str(market)]) == 0
        out, err = capsys.readouterr()
        assert err.splitlines() == [
            f"aegaeon market list: removed 1 leftover of unfinished runs, "
            f"{format_bytes(dead_bytes)} freed: {dead.name} (add, pid {killed.pid} gone)"]
        assert f"{dead_bytes:,} bytes" in err
        assert not dead.exists()
        assert live.is_dir() and _nbytes(live) == live_bytes  # never touched
        assert re.search(rf"^leftover {re.escape(str(live))} .*: kept, its add is running "
                         rf"\(pid {running.pid}\)$", out, re.MULTILINE)  # fmt: skip
        assert out.splitlines()[1].startswith("llama-gqa-5m ")
        assert (market / "market.json").read_bytes() == index
    finally:
        for proc in (killed, running):  # the stopped one killed where it stopped
            _kill(proc)
    assert live.is_dir()  # a leftover now
    # another add: it sweeps first (the second leftover goes), then adds its model
    source = market / "llama-gqa-5m"
    assert main(["market", "add", "--market", str(market), str(source), "--name", "copy",
                 "--quiet"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"aegaeon market add: removed 1 leftover of unfinished runs, "
                          f"{format_bytes(live_bytes)} freed: {live.name} (add, pid "
                          f"{running.pid} gone)")  # fmt: skip
    assert sorted(p.name for p in market.iterdir()) == sorted([*models, "copy"])


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _make(path: Path, nbytes: int = 1000, age_s: float = 0.0, folder: bool = True) -> Path:
    if folder:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"\0" * nbytes)
    else:
        path.write_bytes(b"\0" * nbytes)
    if age_s:
        then = time.time() - age_s
        for item in [path, *path.rglob("*")] if folder else [path]:
            os.utime(item, (then, then))
    return path


def test_owners_are_judged_by_pid_only_where_the_pid_means_them() -> None:
    me = stamp()
    assert parse_stamp(str(me)) == me and machine_tag() == me.tag
    now = time.time()
    assert owner_state(me, now) == "alive"
    assert owner_state(type(me)(me.tag, _dead_pid()), now) == "gone"
    # this process started long after a file written a day ago: a reused pid, not its writer
    assert owner_state(me, now - 86400) == "gone"
    # another machine's (or container's, or boot's) pid is never looked up here
    assert owner_state(type(me)("other-host-abc123", os.getpid()), now) == "unknown"


def test_sweep_rules(market: Path, tmp_path: Path) -> None:
    me, dead = stamp(), f"{machine_tag()}.{_dead_pid()}"
    hour = leftovers.STALE_AFTER_S
    cache = tmp_path / "cache"
    made = {
        "dead add": _make(market / f".add-big.{dead}.tmp", 5000),
        "live add": _make(market / f".add-live.{me}.tmp"),
        "foreign recent": _make(market / ".add-x.far-host-abc123.42.tmp"),
        "foreign stale": _make(market / ".add-y.far-host-abc123.43.tmp", 700, age_s=2 * hour),
        "legacy stale": _make(market / ".add-z.4242.tmp", 300, age_s=2 * hour),
        "legacy recent": _make(market / ".add-w.4243.tmp"),
        "dead index": _make(market / f".market.json.{dead}.tmp", 10, folder=False),
        "dead removal": _make(market / f".removed-gone.{dead}", 20),
        "dead build": _make(tmp_path / f".m.{dead}.tmp", 30),
        "dead download": _make(cache / f".download-{dead}.k2j4h5l", 40),
        "legacy extract": _make(cache / ".extract-q9x8y7", 50, age_s=2 * hour),
    }
    other = _make(tmp_path / f".other.{dead}.tmp")  # another market's: not this one's to sweep
    # a replace cut short between its renames: the old model aside, the new one not in place
    aside = _make(market / f".old-llama-gqa-5m.{dead}", 60)
    os.rename(market / "llama-gqa-5m", tmp_path / "moved")
    index = (market / "market.json").read_bytes()

    dry = sweep(market, cache, dry_run=True)
    assert all(p.exists() for p in made.values()) and aside.exists()
    assert dry.summary() is not None and dry.summary().startswith("would remove 8 leftovers")

    done = sweep(market, cache)
    gone = {"dead add", "foreign stale", "legacy stale", "dead index", "dead removal",
            "dead build", "dead download", "legacy extract"}  # fmt: skip
    assert {k for k, p in made.items() if not p.exists()} == gone
    assert other.exists() and (market / "market.json").read_bytes() == index
    assert (market / "llama-gqa-5m" / "model.safetensors").stat().st_size == 60  # put back
    assert done.freed_bytes == 5000 + 700 + 300 + 10 + 20 + 30 + 40 + 50
    summary = done.summary()
    assert summary is not None
    assert f"{format_bytes(done.freed_bytes)} freed" in summary
    assert "put back llama-gqa-5m (replace cut short)" in summary
    kept = {Path(v.leftover.path).name: v.reason for v in done.kept}
    assert kept[f".add-live.{me}.tmp"] == f"its add is running (pid {me.pid})"
    assert kept[".add-x.far-host-abc123.42.tmp"].startswith("written on far-host-abc123, ")
    assert kept[".add-w.4243.tmp"].startswith("its pid cannot be checked")
    assert sweep(market, cache).summary() is None  # nothing more to do
    # the bound is the caller's: `gc --stale-after 0` takes what cannot be checked too
    assert sweep(market, cache, stale_after_s=0).summary() is not None
    assert [p.name for p in market.iterdir() if p.name.startswith(".")] == [
        f".add-live.{me}.tmp"]


def test_cachemgr_segments_of_a_dead_cachemgr(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead, me = f"{machine_tag()}.{_dead_pid()}", stamp()
    names = {
        "dead": f"aegaeon-0123abcd-{dead}-a1b2c3-model-0-llama",
        "live": f"aegaeon-0123abcd-{me}-a1b2c3-kv",
        "foreign": "aegaeon-0123abcd-far-host-abc123.77-a1b2c3-kv",
        "older name": f"aegaeon-0123abcd-{_dead_pid()}-a1b2c3-kv",
        "not ours": "psm_12345",
    }
    for name in names.values():
        (shm / name).write_bytes(b"\0" * 64)
    done = sweep(tmp_path / "no-market", shm_dir=shm)
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        n for k, n in names.items() if k != "dead")
    assert done.freed_bytes == 64 and not done.kept  # live segments are no leftovers to show


def test_market_gc_on_demand(market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(leftovers, "SHM_DIR", shm)  # the machine's /dev/shm is not ours to test
    dead = f"{machine_tag()}.{_dead_pid()}"
    (shm / f"aegaeon-0123abcd-{dead}-a1b2c3-kv").write_bytes(b"\0" * 4096)
    stale = _make(market / ".add-old.far-host-abc123.9.tmp", 100, age_s=600)
    assert main(["market", "gc", "--market", str(market), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("aegaeon market gc: would remove 1 leftover") and stale.exists()
    assert "kept, written on far-host-abc123" in out
    assert main(["market", "gc", "--market", str(market), "--stale-after", "5m"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("aegaeon market gc: removed 2 leftovers of unfinished runs, "
                          "4,196 bytes (4.1 KiB) freed: ")  # fmt: skip
    assert not stale.exists() and not list(shm.iterdir())
    assert main(["market", "gc", "--market", str(market)]) == 0
    assert capsys.readouterr().out == f"nothing to remove in {market}\n"


def test_remove_leaves_nothing_behind(market: Path) -> None:
    from aegaeon_market.edit import remove_model

    remove_model(market, "llama-gqa-5m")
    assert sorted(p.name for p in market.iterdir()) == ["market.json"]


def test_format_bytes() -> None:
    assert format_bytes(999) == "999 bytes"
    assert format_bytes(2_345_678_901) == "2,345,678,901 bytes (2.2 GiB)"
