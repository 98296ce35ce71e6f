"""Hybrid instances' decode shares, fed to Algorithm 2's placement as the live proxy does.

The live proxy (services/proxy ``cluster.backend``: one ``DecodeShare`` an instance) reads
each instance's record (its heartbeat) every 0.5 s; for a hybrid (a prefill instance that
decodes when idle) it computes the busy fraction ``d prefill_s / d t`` of
prefill *compute* seconds since the previous heartbeat, smooths it with a
moving average (``busy += 0.1 (new - busy)``, first value as is) and calls
``DecodeDispatcher.set_decode_share(instance, 1 - busy)``: a new decode batch
goes to the work list with the fewest batches per unit of decode share.

The same rule here, on the simulated clock: a heartbeat event every
``interval_s`` reads each hybrid instance's ``prefill_s`` counter (its loop's
own, as the heartbeat carries it). The first heartbeat only records
(share 1, as live). ``with_switches=True`` (not what the proxy does) counts
the instance's model switches as busy time too (``switch_s``: its prefills'
and its decode turns'): at H800 scale a prefill takes ~30 ms and the switch
before it ~0.35 s, so compute alone says a hybrid that is mostly switching is
nearly idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aegaeon_sched import DecodeDispatcher, DecodeShare, Policy
from aegaeon_sched.share import SMOOTHING

if TYPE_CHECKING:
    from aegaeon_sim.instances import SimInstance

HEARTBEAT_S = 0.5  # services' InstanceStats period


class DecodeShareFeed:
    """Heartbeats that set each hybrid's decode share on the policy's dispatcher."""

    def __init__(
        self,
        policy: Policy,
        hybrids: Sequence[SimInstance],
        *,
        interval_s: float = HEARTBEAT_S,
        smoothing: float = SMOOTHING,
        with_switches: bool = False,
    ) -> None:
        dispatcher = getattr(policy, "decode", None)
        if not isinstance(dispatcher, DecodeDispatcher):
            raise TypeError(f"policy {type(policy).__name__} has no decode dispatcher")
        self.dispatcher = dispatcher
        self.hybrids = list(hybrids)
        self.interval_s = interval_s
        self.smoothing = smoothing
        self.with_switches = with_switches
        self._shares: dict[str, DecodeShare] = {}
        self.shares: dict[str, list[tuple[float, float]]] = {h.name: [] for h in self.hybrids}

    def observe(self, name: str, prefill_s: float, now_s: float) -> float:
        """The proxy's rule for one heartbeat; returns the decode share."""
        share = self._shares.setdefault(name, DecodeShare(self.smoothing, min_interval_s=0.0))
        return share.observe(now_s, prefill_s)

    def start(
        self, schedule: Callable[[float, Callable[[float], None]], None], end_s: float
    ) -> None:
        """Schedule heartbeats every ``interval_s`` from 0 until ``end_s``."""

        def beat(now_s: float) -> None:
            for hybrid in self.hybrids:
                counters = hybrid.counters
                busy = counters.prefill_s + (counters.switch_s if self.with_switches else 0.0)
                share = self.observe(hybrid.name, busy, now_s)
                self.dispatcher.set_decode_share(hybrid.name, share)
                self.shares[hybrid.name].append((now_s, share))
            if now_s + self.interval_s <= end_s:
                schedule(now_s + self.interval_s, beat)

        schedule(0.0, beat)

    def mean_share(self, name: str) -> float:
        points = self.shares.get(name) or []
        return sum(s for _, s in points) / len(points) if points else 1.0
