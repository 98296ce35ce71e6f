"""What the proxy shows an instance holding (``/v1/aegaeon/stats``): the newest reading of
the process that said hello last, from its heartbeat or a message about a request."""

from __future__ import annotations

from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.messages.structs import Holdings
from aegaeon_proxy.cluster.instances import Instances, InstanceView

ME, NEXT = 11, 22  # two processes of decode-0


def _hello(pid: int, incarnation: int) -> InstanceHello:
    return InstanceHello("decode", 0, pid, 1 << 20, 1 << 20, 8, incarnation=incarnation)


def _beat(held: Holdings) -> InstanceStats:
    return InstanceStats("decode", 0, None, 0, 0, holdings=held)


def _instances() -> Instances:
    view = InstanceView("decode-0", "decode", 0, pusher=None)  # type: ignore[arg-type]
    instances = Instances({"decode-0": view})
    instances.on_hello(_hello(100, ME))
    return instances


def _shown(instances: Instances) -> tuple[int, int] | None:
    held = instances.views["decode-0"].holdings
    return None if held is None else (held.kv_blocks_in_use, held.open_sequences)


def test_a_late_heartbeat_read_before_a_requests_end_does_not_bring_it_back() -> None:
    instances = _instances()
    instances.on_stats(_beat(Holdings(3, 510, 1, ME)))  # mid-request
    instances.note_holdings("decode", 0, Holdings(4, 0, 0, ME))  # its last token's reading
    assert _shown(instances) == (0, 0)
    instances.on_stats(_beat(Holdings(3, 510, 1, ME)))  # read before the end, arrived after
    assert _shown(instances) == (0, 0)
    instances.on_stats(_beat(Holdings(4, 32, 1, ME)))  # read after it: a new request since
    assert _shown(instances) == (32, 1)
    instances.note_holdings("decode", 0, None)  # a message that ended nothing
    assert _shown(instances) == (32, 1)


def test_only_the_current_process_readings_count() -> None:
    instances = _instances()
    instances.note_holdings("decode", 0, Holdings(90, 7, 1, ME))
    instances.on_hello(_hello(101, NEXT))  # restarted: a new process, its own versions
    assert _shown(instances) is None
    instances.on_stats(_beat(Holdings(1, 0, 0, NEXT)))
    assert _shown(instances) == (0, 0)
    instances.note_holdings("decode", 0, Holdings(91, 7, 1, ME))  # the old one's, late
    assert _shown(instances) == (0, 0)
    instances.note_holdings("prefill", 0, Holdings(1, 5, 5, NEXT))  # no such instance
    assert _shown(instances) == (0, 0)
