"""Moving instances between the prefill and decode roles by token velocity (past the paper).

TokenScale (§III-B, §IV-C) sizes each stage by the ratio of the tokens
arriving to the tokens an instance of that stage processes per second, and
converts decoders into prefillers during bursts ("convertible decoders");
HyperFlexis moves workers between the roles when their demands diverge.
Here every instance can do both (a prefill-role instance decodes when no
prefill waits; a decode-role instance in standby for prefill), so a role is
only where new work goes: a role change moves no request and no KV.

Signals (:class:`RoleSignals`, observed every heartbeat):

- prefill demand ``D = arrival velocity + backlog / backlog_horizon_s``:
  prompt tokens/s arriving at the cluster plus the queued prompt tokens
  that must be cleared within the horizon (default: half the TTFT target);
- prefill capacity ``C = sum of v_i`` over prefill-role instances, ``v_i``
  the tokens/s instance ``i`` prefills while busy;
- decode demand ``S = sum`` over instances of the share of time their decode
  work needs (Eq. 3's ``S``), against the decode capacity: 1 per
  decode-role instance plus each prefill-role one's idle share.

Rules, at most one change per observation, each instance keeping a role at
least ``min_dwell_s``:

1. **Up** (decode -> prefill): ``D > high_util x C`` for ``up_hold_s``,
   while the decode role left carries the decode demand
   (``S <= decode_high x (decode capacity - 1)``): the decode-role instance
   with the least decode demand, if that is at most ``convert_max_demand``,
   takes prefill work too (it keeps decoding what it holds, prefills first,
   and gets no new decode requests while a decode-role instance keeps up:
   :attr:`DecodeDispatcher.reserved`). Every prefill and its model switch
   stalls the decode work a converted instance holds: at the paper's scale
   (16 GPUs, 40 models) every decoder is busy and converting one cost
   20 points of attainment for a faster-drained backlog the 10 s TTFT did
   not need (docs/results.md), so a busy decoder stays a decoder.
2. **Back** (prefill -> decode): an instance converted up returns to decode
   once ``D < low_util x (C - v_j)`` for ``down_hold_s``: what stays
   would be at most ``low_util`` busy.
3. **Decode pressure** (prefill -> decode, any prefill-role instance, the
   converted ones first): ``S > decode_high x decode capacity`` and
   ``D < low_util x (C - v_j)``, both for ``up_hold_s``.

Hysteresis comes from the gap between ``high_util`` and ``low_util``, the
holds (short up: a burst lasts seconds, TokenScale's average 2.3 s; long
back: a burst's tail must not flap the role) and the dwell. ``min_prefill``
instances always prefill, ``min_decode`` always decode.

Draining is the caller's part and needs nothing here: an instance leaving
the prefill role is put in standby (:attr:`PrefillDispatcher.standby`), so
its queued groups still run and new groups go elsewhere; one joining it
keeps its decode batches (and, with ``AegaeonPolicy(role_switching=True)``,
takes new ones only when no decode-role instance keeps up).

Pure: the time and the signals are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from aegaeon_sched.latency import LatencyModel

PREFILL, DECODE = "prefill", "decode"
TYPICAL_PROMPT_TOKENS = 512


def estimated_prefill_velocity(
    latency: LatencyModel, models: Iterable[str], prompt_tokens: int = TYPICAL_PROMPT_TOKENS
) -> float:
    """Prompt tokens/s an instance prefills, from its latency profile (Eq. 5): a
    prompt of ``prompt_tokens`` over the mean estimate across ``models`` (the
    instance's measured rate replaces it once it has prefilled)."""
    times = [latency.prefill_one_s(m, prompt_tokens) for m in models]
    mean_s = sum(times) / len(times) if times else 0.0
    return prompt_tokens / mean_s if mean_s > 0 else 0.0


@dataclass(frozen=True)
class RoleSettings:
    high_util: float = 0.8
    low_util: float = 0.5
    up_hold_s: float = 0.5
    down_hold_s: float = 5.0
    min_dwell_s: float = 3.0
    backlog_horizon_s: float = 5.0
    decode_high: float = 0.9
    convert_max_demand: float = 0.2
    min_prefill: int = 1
    min_decode: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.low_util < self.high_util:
            raise ValueError("need 0 < low_util < high_util (the hysteresis band)")
        if self.backlog_horizon_s <= 0 or min(self.up_hold_s, self.down_hold_s) < 0:
            raise ValueError("backlog_horizon_s must be > 0 and the holds >= 0")


@dataclass(frozen=True)
class RoleSignals:
    """One observation of the cluster (see the module docstring)."""

    arrival_tokens_per_s: float
    backlog_tokens: int
    prefill_velocity: Mapping[str, float]  # per instance: prompt tokens/s while prefilling
    decode_demand: Mapping[str, float] = field(default_factory=dict)  # per instance
    prefill_busy: Mapping[str, float] = field(default_factory=dict)  # per instance, in [0, 1]


@dataclass(frozen=True)
class RoleChange:
    instance: str
    role: str  # the new role
    reason: str


class RoleController:
    """Roles by token velocity, with hysteresis; see the module docstring.

    ``base_roles``: each instance's configured role (prefill or decode), in
    the order ties are broken.
    """

    def __init__(self, base_roles: Mapping[str, str], settings: RoleSettings | None = None) -> None:
        if any(r not in (PREFILL, DECODE) for r in base_roles.values()):
            raise ValueError(f"roles are {PREFILL!r} or {DECODE!r}")
        self.settings = settings or RoleSettings()
        self.base_roles = dict(base_roles)
        self.roles = dict(base_roles)
        self._changed_s: dict[str, float] = {}
        self._since: dict[str, float] = {}  # condition -> since when it holds
        self.changes: list[tuple[float, RoleChange]] = []  # every change, for stats
        self.last: dict[str, float] = {}  # the last observation's figures, for stats

    def instances(self, role: str) -> list[str]:
        return [i for i, r in self.roles.items() if r == role]

    def track(self, base_roles: Mapping[str, str], decided: Mapping[str, str] | None = None
              ) -> None:  # fmt: skip
        """The instances are now those of ``base_roles`` (instances join and leave a
        cluster of many nodes): each in its role from ``decided`` (what another
        decider chose: a replica that follows one mirrors it), else the one it had,
        else its configured one; an instance gone is forgotten."""
        if any(r not in (PREFILL, DECODE) for r in base_roles.values()):
            raise ValueError(f"roles are {PREFILL!r} or {DECODE!r}")
        chosen = {i: r for i, r in (decided or {}).items() if r in (PREFILL, DECODE)}
        self.roles = {i: chosen.get(i) or self.roles.get(i) or base
                      for i, base in base_roles.items()}  # fmt: skip
        self.base_roles = dict(base_roles)
        for gone in set(self._changed_s) - set(base_roles):
            del self._changed_s[gone]

    def _held(self, name: str, holds: bool, now_s: float, hold_s: float) -> bool:
        """Whether condition ``name`` has held for ``hold_s`` (it restarts when it breaks)."""
        if not holds:
            self._since.pop(name, None)
            return False
        since = self._since.setdefault(name, now_s)
        return now_s - since >= hold_s

    def _settled(self, instance: str, now_s: float) -> bool:
        changed = self._changed_s.get(instance)
        return changed is None or now_s - changed >= self.settings.min_dwell_s

    def observe(self, now_s: float, signals: RoleSignals) -> list[RoleChange]:
        """Feed one observation; returns the role changes to carry out (0 or 1)."""
        s = self.settings
        v = signals.prefill_velocity
        prefill, decode = self.instances(PREFILL), self.instances(DECODE)
        capacity = sum(v.get(i, 0.0) for i in prefill)
        demand = signals.arrival_tokens_per_s + signals.backlog_tokens / s.backlog_horizon_s
        decode_need = sum(signals.decode_demand.values())
        decode_room = len(decode) + sum(
            max(0.0, 1.0 - signals.prefill_busy.get(i, 0.0)) for i in prefill
        )
        self.last = {"prefill_demand": demand, "prefill_capacity": capacity,
                     "decode_demand": decode_need, "decode_capacity": decode_room}  # fmt: skip
        # a decoder converts only while the decode role left carries the decode demand
        decode_spare = decode_need <= s.decode_high * (decode_room - 1)
        up = self._held("up", demand > s.high_util * capacity and decode_spare, now_s, s.up_hold_s)
        ups = [i for i in decode if self._settled(i, now_s)
               and signals.decode_demand.get(i, 0.0) <= s.convert_max_demand]  # fmt: skip
        if up and ups and len(decode) > s.min_decode:
            pick = min(ups, key=lambda i: signals.decode_demand.get(i, 0.0))
            return self._change(now_s, pick, PREFILL, "prefill demand over capacity")
        # Back down: converted instances first, then (under decode pressure) any.
        downs = sorted(
            (i for i in prefill if self._settled(i, now_s)),
            key=lambda i: (self.base_roles[i] == PREFILL, v.get(i, 0.0)),
        )
        if not downs or len(prefill) <= s.min_prefill:
            self._since.pop("back", None)
            self._since.pop("pressure", None)
            return []
        pick = downs[0]
        spare = demand < s.low_util * (capacity - v.get(pick, 0.0))
        converted = self.base_roles[pick] == DECODE
        if self._held("back", spare and converted, now_s, s.down_hold_s):
            return self._change(now_s, pick, DECODE, "prefill demand back under capacity")
        pressure = spare and decode_need > s.decode_high * decode_room
        if self._held("pressure", pressure, now_s, s.up_hold_s):
            return self._change(now_s, pick, DECODE, "decode demand over capacity")
        return []

    def _change(self, now_s: float, instance: str, role: str, reason: str) -> list[RoleChange]:
        self.roles[instance] = role
        self._changed_s[instance] = now_s
        self._since.clear()
        change = RoleChange(instance, role, reason)
        self.changes.append((now_s, change))
        return [change]
