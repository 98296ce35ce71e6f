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

With ``--nodes N`` / ``--proxies R`` the run is ``aegaeon serve --nodes N
--proxies R`` (a private redis-server shared by the nodes and the replicas),
its faults those of the store: ``store-kill`` (SIGKILL; serve restarts it
empty) and ``store-pause`` (SIGSTOP for twice the heartbeat TTL, then
SIGCONT). The load (every other request a plain completion, whose status is
the answer, the others streamed) and the probes go to the replicas in turn.
Before the first store fault the run changes models through the replicas (one
pinned, one given ``max_concurrency``, one added, one removed); per fault it
reports whether every replica kept them, when the store, those changes in it
and every node's services were back, and how each request ended against the
store's return: from 10 s after it every request must succeed, before it each
ends in a 200 or a 503 with ``Retry-After``, and every stream decoding at the
fault (each is injected while one decodes) finishes.
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
    parser.add_argument("--faults",
                        help=f"comma list, in order (default: one node's "
                        f"{','.join(_fault_names(False))}; many nodes' "
                        f"{','.join(_fault_names(True))})")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes of the deployment (more than 1: the store's faults) (1)")
    parser.add_argument("--proxies", type=int, default=1, help="proxy replicas (1)")
    parser.add_argument("--concurrency", type=int, default=4, help="load clients (4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's (30 s)")
    common.add_own_node_arguments(parser)
    parser.add_argument("--shm-size", default="3GiB",
                        help="as root: a private /dev/shm of this size for the run ('0': "
                        "use the machine's) (3GiB)")
    parser.add_argument("--shm-headroom", default="64MiB", help="fill_shm leaves this free")
    parser.add_argument("--shm-max-fill", default="2GiB",
                        help="fill_shm writes at most this much (bounds memory) (2GiB)")
    parser.set_defaults(func=run)


def _fault_names(cluster: bool) -> list[str]:
    from aegaeon_bench.reliability.faults import FAULTS

    return [name for name, fault in FAULTS.items() if fault.cluster == cluster]


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
        if "answers" in row:  # a store fault
            before, after = row["answers"]["before"], row["answers"]["after"]
            kept = row["settings_kept"] or {}
            lines.append(
                f"{'':<14} store back {row['store_back_s']} s, changes in it "
                f"{row['records_back_s']} s, every node listed {row['services_back_s']} s; "
                f"before +10 s: {before['completed']} ok, "
                f"{before['503_retry_after']} 503+Retry-After, {before['num_other']} other; "
                f"after: {after['completed']}/{after['sent']} ok; kept: "
                f"{','.join(k for k, v in kept.items() if v) or '-'}"
            )
    req = report["requests"]
    lines.append(f"requests sent {req['sent']}: completed {req['completed']}, error "
                 f"{req['error']}, connection {req['connection']}, hung {req['hung']}; "
                 f"{'OK' if report['ok'] else 'FAILED'}")  # fmt: skip
    return "\n".join(lines)


def _market_models(market: Path) -> list[str]:
    """The models of the market folder (one of them not served is the one a store
    fault's run adds)."""
    from aegaeon_common.market_index import MarketError, load_market

    try:
        return [entry.name for entry in load_market(market)]
    except (OSError, MarketError):
        return []


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import parse_bytes
    from aegaeon_common.process import run_fast

    from aegaeon_bench.node.launch import start_bench_node
    from aegaeon_bench.reliability.chaos_run import ChaosNode, ChaosOptions, run_chaos
    from aegaeon_bench.reliability.faults import FAULTS

    # every mistake answered before the run is re-executed or anything starts
    if args.nodes < 1 or args.proxies < 1:
        print(f"aegaeon bench chaos: --nodes {args.nodes} --proxies {args.proxies}: at least "
              "one node and one proxy", file=sys.stderr)  # fmt: skip
        return 2
    cluster = args.nodes > 1 or args.proxies > 1
    faults = args.faults or ",".join(_fault_names(cluster))
    names = [n.strip() for n in faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        print(f"aegaeon bench chaos: unknown fault {unknown[:1]} (known: {', '.join(FAULTS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    other_shape = [n for n in names if FAULTS[n].cluster != cluster]
    if other_shape:
        need = ("one node (no --nodes/--proxies)" if cluster else
                "many nodes (--nodes 2 or --proxies 2: a store they share)")  # fmt: skip
        print(f"aegaeon bench chaos: fault {other_shape[0]} is a fault of {need}",
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
        offered_models=tuple(_market_models(market)), stream=None if cluster else True,
    )  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="aegaeon-chaos-"))
    shape = ["--nodes", str(args.nodes), "--proxies", str(args.proxies)] if cluster else []
    node = start_bench_node("chaos", market, args.config, root, extra_args=shape,
                            ports=args.proxies)
    if node is None:
        return 1
    try:
        assert node.run_dir is not None
        port = int(node.url.rpartition(":")[2])
        replicas = tuple(f"http://127.0.0.1:{port + r}" for r in range(1, args.proxies))
        target = ChaosNode(node.url, node.run_dir, node.proc.pid, replicas, args.nodes)
        report = run_fast(run_chaos(target, opts))
    finally:
        node.stop()
    report = {**common.machine_info(), "private_shm": read_env().chaos_private_shm, **report}
    print(format_report(report))
    code = common.emit_report(args, report)
    shutil.rmtree(root, ignore_errors=True)
    return code
