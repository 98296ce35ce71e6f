"""``aegaeon bench chaos``: faults injected into a whole node under a steady load.

Starts ``aegaeon serve`` (``--market``/``--config``), drives ``--concurrency``
clients sending streamed completions one after another, and in turn, one
fault per slot of ``--duration / faults`` seconds: SIGKILL of the prefill
instance, the decode instance, the cachemgr and the proxy; SIGSTOP of the
decode instance past the proxy's heartbeat timeout; /dev/shm filled to
``--shm-headroom`` from full. Per fault it reports the requests in flight at
the injection and how each ended (completed / error: a typed error in
OpenAI's shape / connection: dropped with the proxy / hung: never ended,
which must be 0), the requests sent during the outage, the time until the
node serves again (probes every 0.3 s), which services restarted (only the
ones the fault should restart), and leaks once the load pauses: KV blocks,
leases, sequences and open requests (``/v1/aegaeon/stats``), shared-memory
segments of a previous cachemgr, stray or zombie processes.

As root, the run happens in a private mount namespace with its own
``--shm-size`` tmpfs on /dev/shm, so filling it "near full" commits a bounded
amount of memory (this machine's /dev/shm is larger than its free memory);
elsewhere the fill stops at ``--shm-max-fill``. Exit status 0 only if every
fault ended with 0 hung requests, 0 leaks, a recovery, and no unexpected
restart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from aegaeon_common.env import read_env

from aegaeon_bench import common

NAMESPACE_ENV = "AEGAEON_CHAOS_PRIVATE_SHM"  # set inside the re-executed run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "chaos",
        "faults (kills, stops, a full /dev/shm) under load: hung, leaks, recovery", __doc__)
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds of load, split into one slot per fault (180)")
    parser.add_argument("--seed", type=int, default=0, help="fault times and the load (0)")
    parser.add_argument("--faults", default=",".join(_fault_names()),
                        help=f"comma list, in order (default: {','.join(_fault_names())})")
    parser.add_argument("--concurrency", type=int, default=4, help="load clients (4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's (30 s)")
    common.add_node_arguments(parser)
    common.add_api_key_argument(parser)
    parser.add_argument("--shm-size", default="3GiB",
                        help="as root: a private /dev/shm of this size for the run ('0': "
                        "use the machine's) (3GiB)")
    parser.add_argument("--shm-headroom", default="64MiB", help="fill_shm leaves this free")
    parser.add_argument("--shm-max-fill", default="2GiB",
                        help="fill_shm writes at most this much (bounds memory) (2GiB)")
    common.add_report_arguments(parser)
    parser.set_defaults(func=run)


def _fault_names() -> list[str]:
    from aegaeon_bench.reliability.faults import FAULTS

    return list(FAULTS)


def _reexec_private_shm(size: str) -> int | None:
    """As root outside the namespace: run this same command in a private mount
    namespace with a ``size`` tmpfs on /dev/shm; its exit status (None: not done)."""
    if read_env().chaos_private_shm or os.geteuid() != 0 or size in ("0", ""):
        return None
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    import subprocess

    from aegaeon_common.config import parse_bytes

    script = f'mount -t tmpfs -o size={parse_bytes(size)},mode=1777 tmpfs /dev/shm && exec "$@"'
    argv = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            sys.executable, "-m", "aegaeon_cli.main", *sys.argv[1:]]  # fmt: skip
    return subprocess.call(argv, env={**os.environ, NAMESPACE_ENV: size})


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'fault':<14} {'in flight':>9} {'completed':>9} {'error':>5} {'conn':>4} "
             f"{'hung':>4} {'recovery':>9} {'leaks':>5}  restarted"]  # fmt: skip
    for row in report["faults"]:
        out = row["in_flight_outcomes"]
        rec = "-" if row["recovery_s"] is None else f"{row['recovery_s']:.1f} s"
        lines.append(
            f"{row['fault']:<14} {row['in_flight']:>9} {out['completed']:>9} {out['error']:>5} "
            f"{out['connection']:>4} {row['hung']:>4} {rec:>9} {'yes' if row['leaks'] else 'no':>5}"
            f"  {','.join(row['restarted']) or '-'}"
        )
    req = report["requests"]
    lines.append(f"requests sent {req['sent']}: completed {req['completed']}, error "
                 f"{req['error']}, connection {req['connection']}, hung {req['hung']}; "
                 f"{'OK' if report['ok'] else 'FAILED'}")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import parse_bytes
    from aegaeon_common.process import run_fast

    from aegaeon_bench.node.launch import NodeError, start_node
    from aegaeon_bench.reliability.chaos_run import ChaosNode, ChaosOptions, run_chaos
    from aegaeon_bench.reliability.faults import FAULTS

    # every mistake answered before the run is re-executed or anything starts
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        print(f"aegaeon bench chaos: unknown fault {unknown[:1]} (known: {', '.join(FAULTS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        sizes = [parse_bytes(v or "0") for v in (args.shm_size, args.shm_headroom,
                                                 args.shm_max_fill)]
    except ValueError as exc:
        print(f"aegaeon bench chaos: --shm-size/--shm-headroom/--shm-max-fill: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    market = common.node_market(args)  # (what `aegaeon serve` would refuse, refused here)
    status = _reexec_private_shm(args.shm_size)
    if status is not None:
        return status
    opts = ChaosOptions(
        faults=[FAULTS[n] for n in names], slot_s=args.duration / len(names), seed=args.seed,
        concurrency=args.concurrency, request_timeout_s=args.timeout,
        shm_headroom_bytes=sizes[1], shm_max_fill_bytes=sizes[2],
        api_key=common.api_key(args),
    )  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="aegaeon-chaos-"))
    try:
        node = start_node(market, "aegaeon", root, args.config)
    except NodeError as exc:
        print(f"aegaeon bench chaos: {exc}", file=sys.stderr)
        return 1
    try:
        assert node.run_dir is not None
        target = ChaosNode(node.url, node.run_dir, node.proc.pid)
        report = run_fast(run_chaos(target, opts))
    finally:
        node.stop()
    report = {**common.machine_info(), "private_shm": read_env().chaos_private_shm, **report}
    print(format_report(report))
    code = common.emit_report(args, report)
    shutil.rmtree(root, ignore_errors=True)
    return code
