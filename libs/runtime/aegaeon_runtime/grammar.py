"""Constrained decoding on an instance: llguidance matchers, one per sequence.

A request's grammar reaches the instance as llguidance's own grammar text
(``SamplingParams.grammar``; the proxy built it from the JSON schema, regex,
choices, Lark grammar or tool calls the client asked for, and checked it). A
sequence's :class:`GrammarState` is a matcher advanced over every token the
sequence has: a sequence that arrives with tokens already generated elsewhere
(the prefill instance's first token, a move to another instance) gets its
state rebuilt from them, so the mask always matches what was generated,
whatever happened to the request on the way. A sequence swapped out or
waiting through a model switch keeps its state.

The model's llguidance tokenizer takes about a second to build, and a grammar
a millisecond or more to compile, so both are made on this worker's grammar
thread, never on the compute thread: the first is kept per model, compiled
grammars per (model, grammar) in a small LRU (each sequence gets a copy). A
state is ``ready()`` once its matcher exists; the decode loop steps only ready
sequences, the prefill job waits for its own (started when the job arrived).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import llguidance
import torch

T = TypeVar("T")
MAX_COMPILED = 64  # compiled grammars kept per worker
WAIT_S = 60.0  # the longest a prefill waits for its grammar


class GrammarError(ValueError):
    """A grammar llguidance refuses (the proxy checked it: a bug or a version skew)."""


@dataclass(frozen=True)
class ModelVocab:
    """What a model's matcher needs of it: its ``tokenizer.json``, the logits' width and
    the tokens that end a sequence."""

    tokenizer_path: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarState:
    """One sequence's matcher (see the module docstring); a ``TokenMask`` for the sampler."""

    def __init__(self, matcher: Future[llguidance.LLMatcher], tokens: Sequence[int]) -> None:
        self._future = matcher
        self._matcher: llguidance.LLMatcher | None = None
        self._pending = list(tokens)  # tokens to replay once the matcher exists

    def ready(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float = WAIT_S) -> None:
        """Block until the matcher exists (the prefill job's first token needs it)."""
        self._future.result(timeout=timeout_s)

    def _get(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            pristine = self._future.result(timeout=WAIT_S)
            matcher = pristine.deep_copy()
            if self._pending and not matcher.consume_tokens(self._pending):
                raise GrammarError(f"the tokens so far do not follow the grammar: "
                                   f"{matcher.get_error()}")  # fmt: skip
            self._matcher, self._pending = matcher, []
        return self._matcher

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """The tokens allowed next, as bits (``TokenMask``)."""
        matcher = self._get()
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> None:
        """``token_id`` was sampled (under this state's mask, or a stop token)."""
        if self._matcher is None and not self._future.done():
            self._pending.append(token_id)
            return
        matcher = self._get()
        if not matcher.is_stopped():
            matcher.consume_token(token_id)

    def check(self) -> str:
        """'' when the state can give masks (waiting for its matcher if need be), else why
        it cannot (the grammar failed to compile, or the tokens so far break it)."""
        try:
            matcher = self._get()
        except (GrammarError, TimeoutError) as exc:
            return str(exc) or "the grammar's matcher was not made in time"
        if matcher.is_error():  # a token it took broke it (a mask and a parse disagreed)
            return f"the grammar failed: {matcher.get_error()}"
        return ""


class GrammarCache:
    """A worker's llguidance tokenizers (per model) and compiled grammars (per model and
    grammar), made on one background thread."""

    def __init__(self, vocab: Callable[[str], ModelVocab]) -> None:
        self._vocab = vocab
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._tokenizers: dict[str, Future[llguidance.LLTokenizer]] = {}
        self._compiled: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = (
            OrderedDict())

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._executor.submit(fn)

    def _tokenizer(self, model: str) -> Future[llguidance.LLTokenizer]:
        future = self._tokenizers.get(model)
        if future is None:
            vocab = self._vocab(model)

            def build() -> llguidance.LLTokenizer:
                text = vocab.tokenizer_path.read_text(encoding="utf-8")
                return llguidance.LLTokenizer(text, n_vocab=vocab.vocab_size,
                                              eos_token=list(vocab.eos_token_ids) or None)

            future = self._tokenizers[model] = self._submit(build)
        return future

    def _compile(self, model: str, grammar: str) -> Future[llguidance.LLMatcher]:
        with self._lock:
            key = (model, grammar)
            future = self._compiled.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._compiled.move_to_end(key)
                return future
            tokenizer = self._tokenizer(model)

            def build() -> llguidance.LLMatcher:
                matcher = llguidance.LLMatcher(tokenizer.result(), grammar, log_level=0)
                if matcher.is_error():
                    raise GrammarError(matcher.get_error())
                return matcher

            future = self._compiled[key] = self._submit(build)
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return future

    def prepare(self, model: str, grammar: str) -> None:
        """Start making ``grammar``'s matcher now (a prefill job that will need it)."""
        self._compile(model, grammar)

    def state(self, model: str, grammar: str, tokens: Sequence[int] = ()) -> GrammarState:
        """A new sequence's state under ``grammar``, advanced over ``tokens`` (those it
        generated already); its matcher is made on the grammar thread."""
        return GrammarState(self._compile(model, grammar), tokens)

    def forget(self, model: str) -> None:
        """``model`` was removed: drop its tokenizer and grammars."""
        with self._lock:
            self._tokenizers.pop(model, None)
            for key in [k for k in self._compiled if k[0] == model]:
                del self._compiled[key]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
