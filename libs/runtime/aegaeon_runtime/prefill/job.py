"""One prefill job (paper §4.2, batch 1; §5.3 swap-out with an event).

Switch the model in if needed, prefill the prompt into device blocks, sample
the first token, copy the prompt's KV out to the unified CPU cache on the
swap-out stream (the device blocks go back to the pool behind that copy's
event) and describe the handoff. The caller sends the outcome to the proxy;
nothing here waits for the copy.

The prompt's device blocks are taken first (:func:`reserve_blocks`), before the
job leaves its queue: a prompt that fits the region but not now (its blocks are
held by copies still in flight, or by a hybrid's decode sequences, which are
swapped out to the unified CPU cache to make room, as a model switch does)
stays queued and is tried again when blocks come back; only a prompt larger
than the whole region fails (``kv_capacity``). The proxy's deadline bounds the
wait (it cancels the request with ``deadline_exceeded``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone, RequestFailed, SwitchRecord
from aegaeon_common.messages.structs import KVHandoff, RequestTimings, TokenLogprobs
from aegaeon_common.transport import RemoteError
from aegaeon_gpumem import OutOfBlocks
from aegaeon_sched import Request

from aegaeon_runtime.cacheclient.client import to_event, to_shape
from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.kv import shape_key
from aegaeon_runtime.port import ModelGoneError, WorkerPort
from aegaeon_runtime.sampling import SeqSampling, finish_reason, sample_step


def prefill_request(msg: EnqueuePrefill, unit: str = "") -> Request:
    """The queue's view of an enqueued request (as the proxy built it: same class,
    same targets, same switching unit, so both sides order the queue alike)."""
    return Request(msg.request_id, msg.model, msg.arrival_s, len(msg.prompt_token_ids),
                   msg.sampling.max_tokens, priority=msg.priority, ttft_s=msg.ttft_s or None,
                   tbt_s=msg.tbt_s or None, unit="" if unit == msg.model else unit)  # fmt: skip


# Makes room for a prompt: swaps sequences out until at least the given bytes of
# device blocks are on their way back to the pool; returns the bytes (0: nothing
# left to swap out). Raises RemoteError when the unified CPU cache is full.
Evict = Callable[[int], int]


@dataclass(frozen=True)
class PrefillOutcome:
    message: PrefillDone | RequestFailed
    switch: SwitchRecord | None
    compute_s: float
    num_tokens: int


def _failed(worker: WorkerPort, msg: EnqueuePrefill, code: str, message: str) -> PrefillOutcome:
    failed = RequestFailed(msg.request_id, worker.kind, worker.index, code, message)
    return PrefillOutcome(failed, None, 0.0, 0)


def reserve_blocks(
    worker: WorkerPort, msg: EnqueuePrefill, evict: Evict | None = None
) -> list[int] | PrefillOutcome | None:
    """Device blocks for ``msg``'s prompt, taken before its job starts.

    A failed outcome when it can never run here: ``kv_capacity`` when the prompt
    needs more blocks than the whole region holds, ``kv_cache_full`` when room
    could only be made by swapping out to a full unified CPU cache. ``None`` when
    it fits the region but not now: nothing was allocated; blocks freed behind
    copies still in flight (the move list) come back on their own, so the caller
    keeps the job queued and tries again a little later. With ``evict`` (a hybrid
    instance: its decode sequences) the missing blocks are first made free by
    swapping sequences out, once nothing is already on its way back.
    """
    w = worker
    shape = w.kv_shape(msg.model)
    need = shape.blocks_for(len(msg.prompt_token_ids))
    capacity = w.kv.capacity_blocks(shape)
    if need > capacity:
        message = (f"prompt does not fit: it needs {need} KV blocks of shape "
                   f"{shape_key(shape)!r}; the device region holds at most {capacity}")  # fmt: skip
        return _failed(w, msg, "kv_capacity", message)
    while True:
        try:
            return w.kv.alloc(shape, need)
        except OutOfBlocks as exc:
            if evict is None or w.kv.pool.stats().pending_blocks:
                return None  # blocks are on their way back: wait for them first
            missing = max(1, exc.requested_blocks - exc.available_blocks) * shape.block_bytes
            try:
                if evict(missing) == 0:
                    return None
            except RemoteError as err:
                return _failed(w, msg, "kv_cache_full",
                               f"no room for the prompt: unified KV cache: {err}")  # fmt: skip


def run_prefill(
    worker: WorkerPort,
    msg: EnqueuePrefill,
    blocks: list[int],
    prefetch: str | None,
    clock: Clock = SYSTEM_CLOCK,
) -> PrefillOutcome:
    """Prefill ``msg`` on ``worker`` into ``blocks`` (from :func:`reserve_blocks`;
    this call owns them); ``prefetch`` is the model to load behind it."""
    w = worker
    started = clock.wall()
    shape = w.kv_shape(msg.model)
    unit = w.unit_of(msg.model)  # a LoRA adapter runs on its base's weights
    try:
        record = w.switcher.activate(unit, started)
        if prefetch is not None:
            w.switcher.prefetch(prefetch)
        adapter = w.adapters.for_step([msg.model])[0] if unit != msg.model else None
    except ModelGoneError as exc:
        w.kv.free(shape, blocks)
        return _failed(w, msg, exc.code, exc.message)
    except BaseException:
        w.kv.free(shape, blocks)
        raise
    prompt = msg.prompt_token_ids

    def fail(code: str, message: str) -> PrefillOutcome:
        """The request fails; its blocks are freed."""
        w.kv.free(shape, blocks)
        failed = RequestFailed(msg.request_id, w.kind, w.index, code, message)
        return PrefillOutcome(failed, record, 0.0, 0)

    def grammar_problem() -> str:
        """What a sequence's grammar found wrong (empty: nothing)."""
        return next((why for seq in seqs if seq.grammar is not None
                     and (why := seq.grammar.check())), "")  # fmt: skip

    if unit != msg.model and adapter is None:  # no room on the device for its matrices
        return fail("adapter_capacity", f"adapter {msg.model!r} does not fit the device's "
                                        "adapter region (adapter_memory)")
    spec = msg.sampling
    seqs = [SeqSampling.start(spec, i, model=msg.model, device=w.engine.device,
                              grammars=w.grammars, prompt_ids=prompt)
            for i in range(spec.n)]  # fmt: skip
    if why := grammar_problem():
        return fail("bad_grammar", why)
    compute_start = clock.now()
    scored: list[TokenLogprobs] = []
    if spec.prompt_logprobs >= 0:
        logits, scored = w.engine.prefill_scored(prompt, blocks, spec.prompt_logprobs,
                                                 adapter=adapter)
    else:
        logits = w.engine.prefill(prompt, blocks, adapter=adapter)
    # the n sequences share the prompt's logits (and, below, its KV)
    tokens, logprobs = sample_step(w.sampler, logits[None].expand(len(seqs), -1), seqs)
    compute_s = clock.now() - compute_start
    if why := grammar_problem():
        return fail("bad_grammar", why)
    finishes = [finish_reason(t, 1, seq.params) for t, seq in zip(tokens, seqs, strict=True)]
    handoff = None
    if any(f is None for f in finishes):
        try:
            host, event = w.kv.swap_out(shape, blocks)
        except RemoteError as exc:
            return fail("kv_cache_full", f"unified KV cache: {exc}")
        handoff = KVHandoff(to_shape(shape), host, len(prompt), to_event(event.handle()))
    else:
        w.kv.free(shape, blocks)
    done = clock.wall()
    timings = RequestTimings(
        prefill_wait_s=max(0.0, started - msg.arrival_s),
        prefill_s=done - started,
        extra={"prefill_compute_s": compute_s, "switch_s": record.total_s if record else 0.0},
    )
    message = PrefillDone(
        msg.request_id, w.index, tokens[0], finishes[0], handoff, timings, done, w.kind,
        sibling_token_ids=tokens[1:], sibling_finish_reasons=finishes[1:],
        logprobs=[lp for lp in logprobs if lp is not None], prompt_logprobs=scored,
    )  # fmt: skip
    return PrefillOutcome(message, record, compute_s, len(prompt))
