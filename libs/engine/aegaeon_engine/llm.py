"""A standalone driver: one model, one buffer, continuous batching (tests, demo, bench).

The driver owns one uint8 buffer holding the packed weights followed by the KV
region, and a free list of block ids. ``generate`` admits prompts while blocks
last (each request reserves the blocks of its whole budget up front, so a
running request never waits for memory), prefills them one at a time, and
decodes every running sequence together; finished sequences free their blocks
and waiting ones join at the next step.

A server drives the same rules one step at a time: :meth:`LLM.request`
validates a prompt, :meth:`LLM.start` reserves its blocks and prefills it,
:meth:`LLM.step` decodes running requests together, :meth:`LLM.release`
frees an unfinished one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import DecodeSeq, Engine
from .loader import load_weights
from .sampling import RowState, Sampler, SamplingParams, make_generator
from .spec import ModelSpec

_PAGE = 4096


@dataclass
class LLMRequest:
    """One prompt's state in :class:`LLM`: its output so far, its blocks, why it ended."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Position of the newest token (the next decode input)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def state(self) -> RowState:
        """What its penalties and ``min_tokens`` read (no grammar here)."""
        return RowState(self.prompt, self.output)


class LLM:
    """Load one checkpoint and generate token ids for batches of prompts."""

    def __init__(self, model_dir: str | Path, *, dtype: str | None = None,
                 device: str = "cpu", num_threads: int | None = 1,
                 kv_cache_bytes: int = 256 << 20, max_num_seqs: int = 64,
                 max_model_len: int | None = None, seed: int | None = None) -> None:
        """``dtype`` defaults to the checkpoint's; ``kv_cache_bytes`` sizes the KV region."""
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.from_dir(model_dir, max_model_len)
        self.engine = Engine(device, num_threads)
        self.layout = self.engine.layout(self.spec, dtype)
        self.engine.tune(self.spec, self.layout.dtype)  # the fastest kernels for its shapes
        self.kv_shape = self.spec.kv_shape(self.layout.dtype, self.engine.block_size)
        num_blocks = max(1, kv_cache_bytes // self.kv_shape.block_bytes)
        weights_bytes = -(-self.layout.total_bytes // _PAGE) * _PAGE
        self.buffer = torch.empty(weights_bytes + num_blocks * self.kv_shape.block_bytes,
                                  dtype=torch.uint8, device=device)
        weights = self.buffer[:self.layout.total_bytes]
        load_weights(model_dir, self.spec, self.layout, weights)
        self.engine.bind(self.spec, weights, self.buffer[weights_bytes:], self.layout.dtype)
        self.num_blocks = num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.max_num_seqs = max_num_seqs
        self.sampler = Sampler(device, seed)
        self.finish_reasons: list[str] = []

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[list[int]]:
        """Generated token ids for each prompt (a stop or EOS token ends, and is included in,
        its list). ``finish_reasons`` afterwards holds ``stop``/``length`` per prompt."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        requests = [self.request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        waiting, running = deque(requests), list[LLMRequest]()
        try:
            while waiting or running:
                while waiting and len(running) < self.max_num_seqs and self.start(waiting[0]):
                    req = waiting.popleft()
                    if req.finish_reason is None:
                        running.append(req)
                if waiting and not running:
                    raise RuntimeError(f"a request needs {self.blocks_needed(waiting[0])} KV "
                                       f"blocks, the cache has {self.num_blocks}; raise "
                                       f"kv_cache_bytes")
                if running:
                    self.step(running)
                    running = [r for r in running if r.finish_reason is None]
        finally:
            for req in requests:  # an error must not leak the blocks of unfinished requests
                self.release(req)
        self.finish_reasons = [r.finish_reason or "length" for r in requests]
        return [r.output for r in requests]

    def start(self, req: LLMRequest) -> bool:
        """Reserve ``req``'s blocks and prefill it (its first token is in ``req.output``);
        False, with nothing changed, when the free blocks do not hold its budget now."""
        need = self.blocks_needed(req)
        if need > len(self.free_blocks):
            return False
        req.block_ids = [self.free_blocks.pop() for _ in range(need)]
        try:
            logits = self.engine.prefill(req.prompt, req.block_ids)
            token = self.sampler.sample(logits[None], [req.params], [req.generator],
                                        [req.state])[0]
        except BaseException:
            self.release(req)
            raise
        self._append(req, token)
        return True

    def release(self, req: LLMRequest) -> None:
        """Free the blocks of a request that has not finished (a finished one has none)."""
        self.free_blocks.extend(reversed(req.block_ids))
        req.block_ids = []

    def step(self, running: list[LLMRequest]) -> None:
        """One decode step of every request in ``running`` (all started, none finished)."""
        logits = self.engine.decode([DecodeSeq(r.output[-1], r.position, r.block_ids)
                                     for r in running])
        tokens = self.sampler.sample(logits, [r.params for r in running],
                                     [r.generator for r in running], [r.state for r in running])
        for req, token in zip(running, tokens, strict=True):
            self._append(req, token)

    def request(self, prompt: Sequence[int], params: SamplingParams) -> LLMRequest:
        """A validated request for :meth:`start`; ValueError for a prompt the model cannot take."""
        prompt = list(prompt)
        window, vocab = self.spec.max_model_len, self.spec.vocab_size
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= window:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the window of "
                             f"{self.spec.name!r} ({window} tokens, prompt + 1 generated)")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.n != 1:
            raise ValueError(f"SamplingParams.n: the engine's LLM samples one sequence per "
                             f"prompt, got {params.n}")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.spec.eos_token_ids)
        return LLMRequest(prompt, params, make_generator(params, self.engine.device),
                        frozenset(stops))

    def blocks_needed(self, req: LLMRequest) -> int:
        """KV blocks ``req`` reserves for its whole budget."""
        return self.blocks_for_budget(len(req.prompt), req.params.max_tokens)

    def blocks_for_budget(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks of a prompt of ``prompt_len`` tokens generating up to ``max_tokens``."""
        # positions that enter the KV cache: the prompt and every generated token but the last
        positions = min(prompt_len + max_tokens - 1, self.spec.max_model_len)
        return self.kv_shape.blocks_for(positions)

    def _append(self, req: LLMRequest, token: int) -> None:
        req.output.append(token)
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif (len(req.output) >= req.params.max_tokens
              or req.position + 1 >= self.spec.max_model_len):
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.release(req)
