"""A decode instance's token messages: a few steps per message, urgent tokens at once."""

from __future__ import annotations

from typing import Any

from aegaeon_common.messages.report import StepTokens, TokenItem
from aegaeon_common.messages.structs import RequestTimings
from aegaeon_runtime.decode.emit import TokenEmitter
from aegaeon_sched import SLO


class Sent:
    """Stands in for the outbox: keeps what would have gone to the proxy."""

    def __init__(self) -> None:
        self.messages: list[StepTokens] = []

    def send(self, msg: Any) -> None:
        assert isinstance(msg, StepTokens)
        self.messages.append(msg)

    def tokens(self, i: int) -> dict[str, list[int]]:
        return {item.request_id: item.token_ids for item in self.messages[i].items}


def _step(*tokens: tuple[str, int]) -> list[TokenItem]:
    return [TokenItem(rid, [token]) for rid, token in tokens]


def test_steps_travel_together_in_order_until_the_turn_flushes() -> None:
    sent = Sent()
    emit = TokenEmitter(sent, index=3, slo=SLO(2.0, 60.0), hold=1.0)  # type: ignore[arg-type]
    emit.add(_step(("a", 1), ("b", 10)), urgent=True)  # a turn's first step: at once
    assert sent.tokens(0) == {"a": [1], "b": [10]} and sent.messages[0].index == 3
    emit.add(_step(("a", 2), ("b", 11)))
    emit.add(_step(("a", 3), ("b", 12)))
    assert len(sent.messages) == 1  # held
    emit.flush()  # the turn ends
    assert sent.tokens(1) == {"a": [2, 3], "b": [11, 12]}
    emit.flush()
    assert len(sent.messages) == 2  # nothing held, nothing sent


def test_a_finish_leaves_at_once_with_what_its_request_held() -> None:
    sent = Sent()
    emit = TokenEmitter(sent, index=0, slo=SLO(2.0, 60.0), hold=1.0)  # type: ignore[arg-type]
    emit.add(_step(("a", 1), ("b", 10)))
    timings = RequestTimings(decode_s=1.0)
    emit.add([TokenItem("a", [2], "length", timings), TokenItem("b", [11])])
    assert len(sent.messages) == 1
    a, b = sent.messages[0].items
    assert (a.token_ids, a.finish_reason, a.timings) == ([1, 2], "length", timings)
    assert (b.token_ids, b.finish_reason) == ([10, 11], None)


def test_without_a_hold_every_step_leaves_as_it_comes() -> None:
    sent = Sent()
    emit = TokenEmitter(sent, index=0, slo=SLO(2.0, 0.025), hold=0.0)  # type: ignore[arg-type]
    for token in range(3):
        emit.add(_step(("a", token)))
    assert [sent.tokens(i) for i in range(3)] == [{"a": [0]}, {"a": [1]}, {"a": [2]}]
    emit.add([])
    assert len(sent.messages) == 3


def test_only_a_deadline_ahead_and_closer_than_a_hold_and_a_step_is_near() -> None:
    # TTFT 2 s, TBT 25 ms, hold one TBT: token k of a request that arrived at 0
    # is due at 2 + 0.025 k
    emit = TokenEmitter(Sent(), index=0, slo=SLO(2.0, 0.025), hold=1.0)  # type: ignore[arg-type]
    step = 0.003
    now = 2.0 + 0.025 * 10 - 0.02  # token 10 is due in 20 ms
    assert emit.near([(0.0, 10)], now, step)  # within the hold: holding could make it late
    assert not emit.near([(0.0, 30), (0.0, 12)], now, step)  # 30 ms: room for a hold and a step
    assert not emit.near([(0.0, 9)], now, step)  # already late: held, missed either way
    assert emit.near([(0.0, 50), (0.0, 10)], now, step)  # any one of them


def test_a_request_with_its_own_targets_is_near_by_its_own_deadline() -> None:
    from aegaeon_runtime.decode.seq import Seq

    default = SLO(2.0, 0.025)
    emit = TokenEmitter(Sent(), index=0, slo=default, hold=1.0)  # type: ignore[arg-type]
    seq = Seq("r", "m", 0, None, None, 8, 0.0, [1], ttft_s=0.5, tbt_s=0.01)  # type: ignore[arg-type]
    assert seq.deadline_s(10, default) == 0.5 + 0.1
    now = 0.6 - 0.005  # its token 10 is due in 5 ms (by the default SLO: in 1.655 s)
    assert emit.near_deadlines([seq.deadline_s(10, default)], now, 0.003)
    assert not emit.near([(0.0, 10)], now, 0.003)
