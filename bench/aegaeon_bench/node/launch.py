"""Start and stop a whole `aegaeon serve` node for one sweep point."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aegaeon_common.ports import free_ports

READY_LINE = "Aegaeon is serving"
BENCH_STATS_RECORDS = 20000


def slo_config(market: Path, config: Path | None, ttft_s: float, tbt_s: float, out: Path) -> Path:
    """``out/serve-config.yaml``: ``config`` (default: `aegaeon serve`'s embedded one for
    ``market``) with its ``slo`` set to the SLO the run is scored with, so the
    planner (Eq. 2's TBT, the decode round bound) plans for the same targets."""
    import yaml
    from aegaeon_cli.serve import deployment

    # (ConfigError: one line, nothing started)
    raw, _, _ = deployment(config, market if config is None else None, 0)
    raw["slo"] = {**(raw.get("slo") or {}), "ttft_s": ttft_s, "tbt_s": tbt_s}
    # a run's every request timing, switch and turn (the proxy keeps the last 2000 by default)
    raw["proxy"] = {"stats_records": BENCH_STATS_RECORDS, **(raw.get("proxy") or {})}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "serve-config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class NodeError(RuntimeError):
    """The node did not come up (its log tail is in the message)."""


def free_port(count: int = 1) -> int:
    """A free port (with ``count``: the first of that many free in a row, e.g. for
    ``--proxies``), below the kernel's ephemeral range."""
    return free_ports(count)


def interrupt(proc: subprocess.Popen[bytes], timeout_s: float = 60.0,
              sig: int = signal.SIGINT) -> int:  # fmt: skip
    """Ctrl-C ``proc`` as a user would (or send it ``sig``) and wait; kill it if it does
    not stop in ``timeout_s``. Its exit status."""
    return interrupt_all([proc], timeout_s, sig)[0]


def interrupt_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 60.0,
                  sig: int = signal.SIGINT) -> list[int]:  # fmt: skip
    """:func:`interrupt` of each of ``procs``, every one signalled before the first is
    waited for (each stops while the others do), all within ``timeout_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


def aegaeon_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "aegaeon_cli.main", *args]


def bench_serve_argv(url: str, **flags: object) -> list[str]:
    """``aegaeon bench serve --url URL`` with each of ``flags`` as ``--name value`` (a
    ``_`` in the name as ``-``), its JSON last on stdout and no progress bar."""
    argv = aegaeon_argv("bench", "serve", "--url", url)
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return [*argv, "--json", "--quiet"]


@dataclass
class Node:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    run_dir: Path | None = None  # `aegaeon serve --run-dir`: sockets, logs, shm prefix

    def tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout_s: float = 60.0) -> int:
        return interrupt(self.proc, timeout_s)


def start_node(
    market: Path, policy: str, run_dir: Path, config: Path | None, timeout_s: float = 300.0,
    extra_args: Sequence[str] = (), ports: int = 1,
) -> Node:
    """`aegaeon serve` with ``policy`` on a free port (the first of ``ports`` free in a row:
    one per ``--proxies`` replica; ``extra_args`` appended); returns once it serves. What
    it would refuse (a ConfigError, EnvError or PlacementError: one line) is raised
    before it starts."""
    from aegaeon_cli.serve import check_serve

    check_serve(market, config, policy)
    port = free_port(ports)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "serve.log"
    argv = ["serve", "--market", str(market), "--policy", policy, "--port", str(port),
            "--run-dir", str(run_dir / "run")]  # fmt: skip
    if config is not None:
        argv += ["--config", str(config)]
    argv += list(extra_args)
    with log_path.open("wb") as out:
        proc = subprocess.Popen(aegaeon_argv(*argv), stdout=out, stderr=subprocess.STDOUT)
    node = Node(f"http://127.0.0.1:{port}", proc, log_path, run_dir / "run")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NodeError(f"aegaeon serve exited ({proc.returncode}):\n{node.tail()}")
        if READY_LINE in log_path.read_text(errors="replace"):
            return node
        time.sleep(0.2)
    node.stop()
    raise NodeError(f"aegaeon serve not ready after {timeout_s:.0f} s:\n{node.tail()}")


def start_bench_node(bench: str, market: Path, config: Path | None, root: Path | None = None,
                     extra_args: Sequence[str] = (), ports: int = 1) -> Node | None:  # fmt: skip
    """:func:`start_node` (policy ``aegaeon``) for ``aegaeon bench BENCH``, in ``root``
    (default: a new temporary folder); None, with the reason printed, when it did not
    come up."""
    root = root or Path(tempfile.mkdtemp(prefix=f"aegaeon-{bench}-"))
    try:
        return start_node(market, "aegaeon", root, config, extra_args=extra_args, ports=ports)
    except NodeError as exc:
        print(f"aegaeon bench {bench}: {exc}", file=sys.stderr)
        return None
