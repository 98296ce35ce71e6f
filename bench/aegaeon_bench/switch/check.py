"""Sanity of the switch path: exact bytes, and the same greedy tokens as a fresh engine.

After a scale-up the active model's bytes in the worker's arena must equal
its Model Cache region, and after A -> B -> A switches (prefetched or not,
promoted or not) the worker's engine must produce the same greedy tokens as
a fresh ``aegaeon_engine.LLM`` that loaded the checkpoint from disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from aegaeon_engine import LLM, DecodeSeq, SamplingParams
from aegaeon_runtime.worker import Worker


@dataclass(frozen=True)
class SwitchCheck:
    """Outcome of :func:`check_switches`."""

    bytes_equal: bool
    tokens_equal: bool
    num_tokens: int


def active_bytes_equal(worker: Worker) -> bool:
    """True if the active model's arena bytes equal its Model Cache region (a model
    mapped in place is the region itself)."""
    switcher = worker.switcher
    active = switcher.active
    if active is None:
        raise RuntimeError("no active model")
    if active.allocation is None:  # mapped in place: the bytes are the region's own
        return True
    mapped = worker.cache.load_model(active.name, pin=True)
    try:
        if not mapped.nbytes == active.allocation.nbytes == switcher.nbytes(active.name):
            return False
        arena = worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
        return torch.equal(arena.cpu(), mapped.data)  # the arena may be on a GPU
    finally:
        worker.cache.unpin(active.name)


def greedy_tokens(worker: Worker, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens of the worker's active model for ``prompt`` (device KV blocks)."""
    model = worker.switcher.active_model
    if model is None:
        raise RuntimeError("no active model")
    shape = worker.kv_shape(model)
    blocks = worker.kv.alloc(shape, shape.blocks_for(len(prompt) + num_tokens))
    try:
        tokens = [int(worker.engine.prefill(prompt, blocks).argmax())]
        while len(tokens) < num_tokens:
            position = len(prompt) + len(tokens) - 1
            logits = worker.engine.decode([DecodeSeq(tokens[-1], position, blocks)])
            tokens.append(int(logits[0].argmax()))
        return tokens
    finally:
        worker.kv.free(shape, blocks)


def reference_tokens(model_dir: Path, dtype: str, prompt: list[int], num_tokens: int,
                     device: str = "cpu") -> list[int]:
    """Greedy tokens of a fresh engine on ``device`` that loaded the checkpoint from disk."""
    llm = LLM(model_dir, dtype=dtype, device=device, kv_cache_bytes=8 << 20, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return llm.generate([prompt], params)[0]


def check_switches(worker: Worker, a: str, b: str, model_dirs: dict[str, Path], dtype: str,
                   num_tokens: int = 8, seed: int = 0) -> SwitchCheck:
    """A -> B -> A (B prefetched while A is active when prefetch is on), then compare
    A's bytes and greedy tokens, and B's tokens on the way, with fresh engines."""
    gen = torch.Generator().manual_seed(seed)
    switcher = worker.switcher
    expected = {}
    prompts = {}
    for name in (a, b):
        vocab = worker.specs[name].vocab_size
        prompts[name] = torch.randint(0, vocab, (12,), generator=gen).tolist()
        expected[name] = reference_tokens(model_dirs[name], dtype, prompts[name], num_tokens,
                                          str(worker.engine.device))
    tokens_equal = True
    bytes_equal = True
    for name in (a, b, a):
        switcher.activate(name)
        if name == a and switcher.prefetch_enabled:
            switcher.prefetch(b)  # the next switch binds B where the prefetch put it
        bytes_equal = bytes_equal and active_bytes_equal(worker)
        tokens_equal = tokens_equal and greedy_tokens(worker, prompts[name],
                                                      num_tokens) == expected[name]
    switcher.activate(b)  # drains the last prefetch
    return SwitchCheck(bytes_equal, tokens_equal, num_tokens)
