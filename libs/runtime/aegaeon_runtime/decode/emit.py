"""Tokens leaving a decode instance: one message per few steps of a running turn.

Every message costs the same on its way out whatever it carries: a send here,
a receive and a wake-up of each request's stream in the proxy, a socket
write there and a read in the client. Inside a turn steps come every few
milliseconds, far inside the TBT target, so the tokens of consecutive steps
may travel together (each is still its own event to the client):

- the tokens of a turn's first step leave at once: they may have waited a
  whole round;
- so do a step's tokens when one of them is due (``arrival + TTFT + k TBT``
  for token ``k``, the SLO's deadline) within ``hold_s`` plus a step: holding
  a token never makes it late (one already late is held: it is missed
  either way, and sending it alone would cost the others their time);
- a request's last token (its finish) leaves at once;
- otherwise tokens are held until the oldest has waited ``hold_s``
  (``scheduler.token_hold`` x the TBT target, 1 by default), and whatever is
  held leaves when the turn ends or the instance is about to wait.

``hold_s = 0`` sends every step's tokens as they come.
"""

from __future__ import annotations

from collections.abc import Iterable

from aegaeon_common.messages.report import StepTokens, TokenItem
from aegaeon_sched import SLO

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.holdings import Reading, no_reading
from aegaeon_runtime.port import MessageSink


class TokenEmitter:
    """See the module docstring."""

    def __init__(
        self, outbox: MessageSink, index: int, slo: SLO, hold: float, clock: Clock = SYSTEM_CLOCK,
        kind: str = "decode",
    ) -> None:  # fmt: skip
        """``hold``: how long tokens may wait, as a fraction of ``slo.tbt_s``; ``kind``:
        the instance's (a prefill instance decodes when idle)."""
        self.outbox = outbox
        self.clock = clock
        self.index = index
        self.kind = kind
        # the instance's holdings, read into a message that ends a request (its KV is
        # freed by then: the request finished before its last token is added)
        self.changed: Reading = no_reading
        self.slo = slo
        self.hold_s = max(0.0, hold * slo.tbt_s)
        self._held: dict[tuple[str, int], TokenItem] = {}  # by (request, sequence)
        self._since: float | None = None  # clock.now() of the oldest held token

    @property
    def holds(self) -> bool:
        """Whether tokens may wait at all (``hold_s = 0``: every step's leave at once)."""
        return self.hold_s > 0

    def near(self, tokens: Iterable[tuple[float, int]], now_s: float, step_s: float) -> bool:
        """Is one of these tokens (request arrival, index) due ahead of ``now_s``
        (wall clock), but sooner than a hold and a step?"""
        deadlines = (self.slo.deadline_s(arrival_s, k) for arrival_s, k in tokens)
        return self.near_deadlines(deadlines, now_s, step_s)

    def near_deadlines(self, deadlines: Iterable[float], now_s: float, step_s: float) -> bool:
        """:meth:`near` for tokens given by their deadlines (a request with its own
        SLO class or targets: ``Seq.deadline_s``)."""
        return any(0.0 <= due - now_s < self.hold_s + step_s for due in deadlines)

    def add(self, items: list[TokenItem], *, urgent: bool = False) -> None:
        """A step's tokens; ``urgent``: send now (a turn's first step, a deadline near)."""
        if not items:
            return
        if not self._held and (urgent or self.hold_s <= 0):
            self._send(items)  # nothing waits before them: they leave as they are
            return
        for item in items:
            key = (item.request_id, item.index)
            held = self._held.get(key)
            self._held[key] = item if held is None else TokenItem(
                item.request_id, held.token_ids + item.token_ids, item.finish_reason,
                item.timings, item.index, held.logprobs + item.logprobs,
            )  # the same sequence's earlier steps: one item, tokens in order
        now = self.clock.now()
        if self._since is None:
            self._since = now
        finished = any(item.finish_reason is not None for item in items)
        if urgent or finished or now - self._since >= self.hold_s:
            self.flush()

    def flush(self) -> None:
        if self._held:
            items = list(self._held.values())
            self._held.clear()
            self._send(items)
        self._since = None

    def _send(self, items: list[TokenItem]) -> None:
        ended = any(item.finish_reason is not None for item in items)
        holdings = self.changed() if ended else None
        self.outbox.send(StepTokens(self.index, items, self.clock.wall(), self.kind, holdings))
        self._since = None
