"""The proxy's report loop (the instances' reports, each to its handler) and the
deployment's layout it reports."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.transport import Puller
from aegaeon_common.wire import Message, WireError

log = get_logger("cluster")

__all__ = ["layout_of", "receive_reports"]


async def receive_reports(reports: Puller, handlers: Mapping[type[Message], Callable[[Any], None]],
                          counters: Counter[str] | dict[str, int]) -> None:  # fmt: skip
    """Run each report's handler, forever. A bad frame is counted (``bad_frames``);
    a bug handling one report must not stop every later one (heartbeats included:
    the instances would all look dead), so it is logged and counted
    (``report_errors``)."""
    while True:
        try:
            msg = await reports.recv()
        except WireError as exc:
            counters["bad_frames"] += 1
            log.warning("bad report frame", error=str(exc))
            continue
        try:
            handlers[type(msg)](msg)
        except Exception:
            counters["report_errors"] += 1
            log.exception("report_failed", tag=msg.TAG)


def layout_of(config: Config) -> dict[str, object]:
    """The deployment's scheduling layout (``/v1/aegaeon/stats``' ``layout``): what a
    simulation of it needs besides the instances' latency profiles."""
    sched = config.scheduler
    return {
        "policy": sched.policy, "unified": config.unified,
        "hybrid_prefill": config.hybrid_prefill, "prefill": config.prefill.instances,
        "decode": config.decode.instances, "q_max_s": sched.q_max_s,
        "max_group_size": sched.max_group_size, "max_batch_size": sched.max_batch_size,
    }  # fmt: skip
