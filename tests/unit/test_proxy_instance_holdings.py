"""What the proxy shows an instance holding (``/v1/aegaeon/stats``): the newest reading of
the process that said hello last, from its heartbeat or a message about a request
(``cluster.local_registrar``)."""

from __future__ import annotations

from pathlib import Path

from aegaeon_common.config import config_from_dict
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.messages.structs import Holdings
from aegaeon_common.registry import InstanceRecord
from aegaeon_common.wire import Message
from aegaeon_proxy.cluster.local_registrar import LocalRegistrar

ME, NEXT = 11, 22  # two processes of decode-0


def _hello(pid: int, incarnation: int) -> InstanceHello:
    return InstanceHello("decode", 0, pid, 1 << 20, 1 << 20, 8, incarnation=incarnation)


def _beat(held: Holdings) -> InstanceStats:
    return InstanceStats("decode", 0, None, 0, 0, holdings=held)


def _instances(tmp_path: Path) -> LocalRegistrar:
    config = config_from_dict({"models": [{"name": "m", "path": "x"}], "run_dir": str(tmp_path)})

    def put(record: InstanceRecord, live: bool) -> None:
        pass

    def send(record: InstanceRecord, msg: Message) -> None:
        pass

    instances = LocalRegistrar(config, put, send)
    instances.on_hello(_hello(100, ME))
    return instances


def _shown(instances: LocalRegistrar) -> tuple[int, int] | None:
    held = instances.instances["decode-0"].holdings
    return None if held is None else (held.kv_blocks_in_use, held.open_sequences)


def test_a_late_heartbeat_read_before_a_requests_end_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    instances = _instances(tmp_path)
    instances.on_stats(_beat(Holdings(3, 510, 1, ME)))  # mid-request
    instances.note_holdings("decode", 0, Holdings(4, 0, 0, ME))  # its last token's reading
    assert _shown(instances) == (0, 0)
    instances.on_stats(_beat(Holdings(3, 510, 1, ME)))  # read before the end, arrived after
    assert _shown(instances) == (0, 0)
    instances.on_stats(_beat(Holdings(4, 32, 1, ME)))  # read after it: a new request since
    assert _shown(instances) == (32, 1)
    instances.note_holdings("decode", 0, None)  # a message that ended nothing
    assert _shown(instances) == (32, 1)


def test_only_the_current_process_readings_count(tmp_path: Path) -> None:
    instances = _instances(tmp_path)
    instances.note_holdings("decode", 0, Holdings(90, 7, 1, ME))
    instances.on_hello(_hello(101, NEXT))  # restarted: a new process, its own versions
    assert _shown(instances) is None
    instances.on_stats(_beat(Holdings(1, 0, 0, NEXT)))
    assert _shown(instances) == (0, 0)
    instances.note_holdings("decode", 0, Holdings(91, 7, 1, ME))  # the old one's, late
    assert _shown(instances) == (0, 0)
    instances.note_holdings("prefill", 0, Holdings(1, 5, 5, NEXT))  # no such instance
    assert _shown(instances) == (0, 0)
