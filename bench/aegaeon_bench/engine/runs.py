"""Timed runs of one workload on our engine and on transformers (same process, same dtype).

What is measured, for both (greedy, argmax in float32 on the logits):

- prefill: each of the ``B`` prompts alone (batch 1), tokens / seconds of the
  forward passes that produce the first token;
- decode at batch 1: ``num_new`` steps of the first prompt after its prefill;
- decode at batch 8: ``num_new`` steps of all prompts together (equal lengths,
  so transformers needs no padding), tokens = 8 * steps.

Transformers runs a manual loop over ``model(token, past_key_values=cache)``
(its ``DynamicCache``), which is what ``generate`` does minus its logits
processors and stopping checks: the fair, slightly generous baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Workload:
    """``prompts`` (equal lengths) and how many tokens each decode run generates."""

    model_dir: Path
    dtype: str
    prompts: list[list[int]]
    num_new: int
    device: str = "cpu"
    hf_dir: Path | None = None  # what transformers loads (default: model_dir)


@dataclass
class Timings:
    """Per-repeat measurements (tokens/s) of one engine, and its greedy batch-8 tokens."""

    prefill: list[float] = field(default_factory=list)
    decode_b1: list[float] = field(default_factory=list)
    decode_b8: list[float] = field(default_factory=list)
    tokens_b8: list[list[int]] = field(default_factory=list)


def _clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # queued kernels count
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


class OursRunner:
    """Our engine bound once; KV blocks handed out per prompt."""

    def __init__(self, work: Workload, threads: int) -> None:
        from aegaeon_engine import Engine, ModelSpec, load_weights, weight_layout

        self.work = work
        spec = ModelSpec.from_dir(work.model_dir)
        layout = weight_layout(spec, work.dtype)
        self.weights = torch.empty(layout.total_bytes, dtype=torch.uint8, device=work.device)
        load_weights(work.model_dir, spec, layout, self.weights)
        kv = spec.kv_shape(work.dtype)
        self.per_seq = kv.blocks_for(len(work.prompts[0]) + work.num_new)
        self.kv = torch.zeros(len(work.prompts) * self.per_seq * kv.block_bytes,
                              dtype=torch.uint8, device=work.device)
        self.engine = Engine(work.device, num_threads=threads)
        self.choice = self.engine.tune(spec, work.dtype)  # the fastest kernels, measured
        self.engine.bind(spec, self.weights, self.kv, work.dtype)

    def _blocks(self, i: int) -> list[int]:
        return list(range(i * self.per_seq, (i + 1) * self.per_seq))

    def _prefill(self, count: int) -> list[int]:
        return [int(self.engine.prefill(p, self._blocks(i)).argmax())
                for i, p in enumerate(self.work.prompts[:count])]

    def _decode(self, firsts: list[int]) -> list[list[int]]:
        from aegaeon_engine import DecodeSeq

        length = len(self.work.prompts[0])
        outs = [[t] for t in firsts]
        for step in range(self.work.num_new - 1):
            seqs = [DecodeSeq(o[-1], length + step, self._blocks(i)) for i, o in enumerate(outs)]
            for o, t in zip(outs, self.engine.decode(seqs).argmax(-1).tolist(), strict=True):
                o.append(t)
        return outs

    def greedy(self) -> list[list[int]]:
        """Greedy tokens of all prompts decoded together (untimed)."""
        return self._decode(self._prefill(len(self.work.prompts)))

    def run(self, into: Timings) -> None:
        count, length, steps = len(self.work.prompts), len(self.work.prompts[0]), self.work.num_new
        seconds, _ = _clock(lambda: self._prefill(count))
        into.prefill.append(count * length / seconds)
        for batch, sink in ((1, into.decode_b1), (count, into.decode_b8)):
            firsts = self._prefill(batch)
            seconds, outs = _clock(partial(self._decode, firsts))
            sink.append(batch * (steps - 1) / seconds)
            if batch == count:
                into.tokens_b8 = outs


class TransformersRunner:
    """transformers' model in the same dtype and thread count."""

    def __init__(self, work: Workload, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.work = work
        model: Any = AutoModelForCausalLM.from_pretrained(
            work.hf_dir or work.model_dir, dtype=getattr(torch, work.dtype))
        self.model = model.to(work.device)

    @torch.inference_mode()
    def _prefill(self, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(ids, past_key_values=cache, use_cache=True)
        return cache, out.logits[:, -1].float().argmax(-1, keepdim=True)

    @torch.inference_mode()
    def _decode(self, cache: Any, token: torch.Tensor) -> list[list[int]]:
        outs = [token]
        for _ in range(self.work.num_new - 1):
            out = self.model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].float().argmax(-1, keepdim=True)
            outs.append(token)
        return list(torch.cat(outs, 1).tolist())

    def greedy_alone(self) -> list[list[int]]:
        """Greedy tokens of each prompt decoded alone (batch 1): the reference, since in
        bf16 transformers' own tokens vary with the batch size."""
        outs = []
        for prompt in self.work.prompts:
            cache, first = self._prefill(torch.tensor([prompt], device=self.work.device))
            outs.extend(self._decode(cache, first))
        return outs

    def run(self, into: Timings) -> None:
        ids = torch.tensor(self.work.prompts, device=self.work.device)
        count, length, steps = ids.shape[0], ids.shape[1], self.work.num_new
        seconds, _ = _clock(lambda: [self._prefill(ids[i:i + 1]) for i in range(count)])
        into.prefill.append(count * length / seconds)
        for batch, sink in ((1, into.decode_b1), (count, into.decode_b8)):
            cache, first = self._prefill(ids[:batch])
            seconds, outs = _clock(partial(self._decode, cache, first))
            sink.append(batch * (steps - 1) / seconds)
            if batch == count:
                into.tokens_b8 = outs
