"""Counters an instance reports in its heartbeat (its decode work and its prefills)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from aegaeon_common.messages.report import InstanceStats, SwitchRecord, TurnRecord

from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_runtime.port import WorkerPort

# the counters a heartbeat carries (``InstanceStats.counters``), beside the KV pool's
REPORTED = ("rounds", "turns", "steps", "tokens", "decode_s", "switches", "switch_s",
            "prefetched_switches", "adapter_loads", "prefills", "prefill_tokens", "prefill_s",
            "cancelled", "failed")


@dataclass
class InstanceCounters:
    """Written by the compute thread; ``snapshot`` runs on the event loop."""

    rounds: int = 0
    turns: int = 0
    steps: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    switches: int = 0
    switch_s: float = 0.0
    prefetched_switches: int = 0
    adapter_loads: int = 0  # LoRA adapters brought to the device (no weight switch)
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    cancelled: int = 0
    failed: int = 0
    queued: int = 0
    running: int = 0
    new_switches: list[SwitchRecord] = field(default_factory=list)
    new_turns: list[TurnRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    metrics: WorkerMetrics | None = None  # the instance's /metrics, when served

    def note_switch(self, record: SwitchRecord) -> None:
        if self.metrics is not None:
            self.metrics.switch(record)
        with self.lock:
            self.switches += 1
            self.switch_s += record.total_s
            self.prefetched_switches += int(record.prefetched)
            self.new_switches.append(record)

    def note_turn(self, record: TurnRecord) -> None:
        with self.lock:
            self.new_turns.append(record)

    def snapshot(self, worker: WorkerPort) -> InstanceStats:
        with self.lock:
            switches, self.new_switches = self.new_switches, []
            turns, self.new_turns = self.new_turns, []
        pool = worker.kv.pool.stats()
        counters = {name: float(getattr(self, name)) for name in REPORTED}
        counters.update(kv_used_bytes=float(pool.slabs.used_bytes),
                        kv_fragmentation=float(pool.slabs.fragmentation))
        return InstanceStats(
            kind=worker.kind,
            index=worker.index,
            active_model=worker.switcher.active_model,
            queued=self.queued,
            running=self.running,
            counters=counters,
            switches=switches,
            turns=turns,
        )
