"""A simulated decode instance's turns, measured as the live decode loop measures its own.

The live loop (services/decode ``TurnRunner``) times every decode step
(engine and sampling: its ``decode_s`` counter), refines its latency model
with each (``LatencyModel.observe_decode``) and, per model, keeps a moving
average of a turn's time outside its steps, which becomes the planner's
switch estimate when it exceeds Eq. 4. :class:`TurnMeter` does the same on
simulated time for :class:`~aegaeon_sim.decode_sim.DecodeSim`, and
keeps what a replay compares with the live counters (steps, engine seconds,
a log of turns). It also carries the cold-step flag: the first step of a
turn that began with a switch costs ``InstanceCosts.cold_step_s`` more.
"""

from __future__ import annotations

from aegaeon_sched import LatencyModel

from aegaeon_sim.switching import SwitchEstimate

TurnLog = tuple[str, float, float, int, float]  # model, start, end, steps, quota


class TurnMeter:
    def __init__(self, estimator: LatencyModel, estimate: SwitchEstimate) -> None:
        self.estimator = estimator
        self.estimate = estimate
        # Refine the estimator with every step, as live instances do; only
        # for an estimator of the instance's own (never the truth model).
        self.refine = False
        self.engine_s = 0.0
        self.num_steps = 0
        self.log: list[TurnLog] = []
        self.cold = False  # the next step is the first after a switch
        self._turn: tuple[str, float, float] | None = None
        self._engine_s = 0.0
        self._steps = 0

    def start(self, model: str, now_s: float, quota_s: float, switched: bool) -> None:
        self._turn, self._engine_s, self._steps = (model, now_s, quota_s), 0.0, 0
        self.cold = switched

    def steps(self, model: str, batch: int, context: int, engine_s: float, n: int) -> None:
        """``n`` steps of ``batch`` sequences holding ``context`` tokens, ``engine_s`` each."""
        self._engine_s += n * engine_s
        self._steps += n
        self.engine_s += n * engine_s
        self.num_steps += n
        if self.refine:
            for j in range(n):
                self.estimator.observe_decode(model, batch, context + j * batch, engine_s)

    def end(self, now_s: float) -> None:
        """The turn in progress (if any) ended at ``now_s``."""
        if self._turn is not None and self._steps > 0:
            model, start, quota = self._turn
            self.estimate.observe_turn(model, max(0.0, now_s - start - self._engine_s))
            self.log.append((model, start, now_s, self._steps, quota))
        self._turn = None
        self.cold = False
