"""Step-wise driving of the engine's standalone driver (``aegaeon_engine.LLM``).

``LLM.generate`` runs a whole batch to completion; a server needs the same
continuous batching one step at a time, with requests joining and leaving
between steps, so that tokens stream as they are made. This adapter keys
LLM's step-wise API (``request``, ``start``, ``step``, ``release``: the
engine's one definition of admission, prefill, decode and finish rules) by
request id and translates sampling parameters and finish reasons. Runs on
the worker thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aegaeon_common.config import ModelConfig

from aegaeon_proxy.backend import FinishReason, SamplingParams

if TYPE_CHECKING:
    from aegaeon_engine import LLM
    from aegaeon_engine import SamplingParams as EngineSampling
    from aegaeon_engine.llm import LLMRequest

__all__ = ["EngineStepper", "StepEvent"]

_FINISH: dict[str | None, FinishReason | None] = {None: None, "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class StepEvent:
    """One request's new token from a prefill or decode step."""

    request_id: str
    token_id: int
    finish_reason: FinishReason | None


class EngineStepper:
    """One loaded model: admit requests while KV blocks last, step them together."""

    def __init__(
        self,
        model: ModelConfig,
        *,
        dtype: str | None,
        kv_cache_bytes: int,
        max_num_seqs: int,
        num_threads: int | None,
    ) -> None:
        from aegaeon_engine import LLM

        self.model = model.name
        self.llm: LLM = LLM(
            model.path,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            num_threads=num_threads,
        )
        self._running: dict[str, LLMRequest] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _engine_params(self, sampling: SamplingParams) -> EngineSampling:
        from aegaeon_engine import SamplingParams as EngineSampling

        return EngineSampling(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # the engine's "off" is 0, ours -1
            seed=sampling.seed,
            max_tokens=sampling.max_tokens,
            stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos,
        )

    def fits_ever(self, prompt_len: int, sampling: SamplingParams) -> bool:
        """Whether the request's KV budget fits the empty cache at all."""
        return self.llm.blocks_for_budget(prompt_len, sampling.max_tokens) <= self.llm.num_blocks

    def try_admit(
        self, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> StepEvent | None:
        """Reserve blocks and prefill; None when the batch or the cache is full now."""
        if len(self._running) >= self.llm.max_num_seqs:
            return None
        req = self.llm.request(prompt, self._engine_params(sampling))
        if not self.llm.start(req):
            return None
        if req.finish_reason is None:
            self._running[request_id] = req
        return StepEvent(request_id, int(req.output[-1]), _FINISH[req.finish_reason])

    def step(self) -> list[StepEvent]:
        """One decode step of every running request."""
        if not self._running:
            return []
        ids, reqs = list(self._running), list(self._running.values())
        self.llm.step(reqs)
        events = []
        for request_id, req in zip(ids, reqs, strict=True):
            events.append(StepEvent(request_id, int(req.output[-1]), _FINISH[req.finish_reason]))
            if req.finish_reason is not None:
                del self._running[request_id]
        return events

    def abort(self, request_id: str) -> bool:
        """Drop a running request and free its blocks; False if it is not running."""
        req = self._running.pop(request_id, None)
        if req is None:
            return False
        self.llm.release(req)
        return True

    def abort_all(self) -> list[str]:
        ids = list(self._running)
        for request_id in ids:
            self.abort(request_id)
        return ids
