"""Plain data shared by every policy: the request as the scheduler sees it."""

from __future__ import annotations

import msgspec

InstanceId = str
"""An instance's name as the driver (proxy or simulator) chose it, e.g. ``"decode-3"``."""


class Request(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a policy knows about a request: identity, model, sizes, arrival.

    A msgspec struct: in a stored queue (:mod:`aegaeon_sched.shared`) it is the
    array of its fields in this order (fields past ``max_tokens`` may be missing:
    their defaults); ``gc=False`` since it holds no containers.

    ``max_tokens`` bounds the output and is what KV room is reserved for
    (``prompt_len + max_tokens``). ``oracle_output_len`` is the true output
    length, known only to oracle policies (SJF) and to the simulator.

    Past the paper (:mod:`aegaeon_sched.priority`): ``priority`` is the rank
    of the request's SLO class (0 = interactive, the highest; 1 = standard;
    2 = batch) and ``ttft_s`` / ``tbt_s`` its own targets, resolved by the
    proxy (``None``: the deployment's, as in the paper).

    ``unit`` is the model whose weights serve it when that is another: a LoRA
    adapter's base. A base and its adapters are one switching unit: one prefill
    group, one decode batch and one weight switch serve them all, while
    ``model`` (the adapter) keeps its own accounting (:attr:`switch_unit`).
    """

    request_id: str
    model: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    oracle_output_len: int | None = None
    priority: int = 1
    ttft_s: float | None = None
    tbt_s: float | None = None
    unit: str = ""

    @property
    def switch_unit(self) -> str:
        """The weights it runs on: its base for an adapter (``unit``), else ``model``."""
        return self.unit or self.model

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV room the request may need by its end."""
        return self.prompt_len + self.max_tokens


class NoInstance(LookupError):  # noqa: N818 (reads as the condition)
    """Every instance a dispatcher could choose is paused (draining or restarting)."""
