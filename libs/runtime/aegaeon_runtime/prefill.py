"""One prefill job (paper §4.2, batch 1; §5.3 swap-out with an event).

Switch the model in if needed, prefill the prompt into device blocks, sample
the first token, copy the prompt's KV out to the unified CPU cache on the
swap-out stream (the device blocks go back to the pool behind that copy's
event) and describe the handoff. The caller sends the outcome to the proxy;
nothing here waits for the copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone, RequestFailed, SwitchRecord
from aegaeon_common.messages.structs import KVHandoff, KVShapeSpec, RequestTimings
from aegaeon_common.transport import RemoteError
from aegaeon_gpumem import OutOfBlocks
from aegaeon_sched import Request

from aegaeon_runtime.cacheclient.client import to_event
from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.port import WorkerPort
from aegaeon_runtime.sampling import engine_params, finish_reason


def prefill_request(msg: EnqueuePrefill) -> Request:
    """The queue's view of an enqueued request (as the proxy built it: same class,
    same targets, so both sides order the queue alike)."""
    return Request(msg.request_id, msg.model, msg.arrival_s, len(msg.prompt_token_ids),
                   msg.sampling.max_tokens, priority=msg.priority, ttft_s=msg.ttft_s or None,
                   tbt_s=msg.tbt_s or None)  # fmt: skip


@dataclass(frozen=True)
class PrefillOutcome:
    message: PrefillDone | RequestFailed
    switch: SwitchRecord | None
    compute_s: float
    num_tokens: int


def run_prefill(
    worker: WorkerPort, msg: EnqueuePrefill, prefetch: str | None, clock: Clock = SYSTEM_CLOCK
) -> PrefillOutcome:
    """Prefill ``msg`` on ``worker``; ``prefetch`` is the model to load behind it."""
    w = worker
    started = clock.wall()
    record = w.switcher.activate(msg.model, started)
    if prefetch is not None:
        w.switcher.prefetch(prefetch)
    shape = w.kv_shape(msg.model)
    prompt = msg.prompt_token_ids

    def fail(code: str, message: str) -> PrefillOutcome:
        failed = RequestFailed(msg.request_id, w.kind, w.index, code, message)
        return PrefillOutcome(failed, record, 0.0, 0)

    try:
        blocks = w.kv.alloc(shape, shape.blocks_for(len(prompt)))
    except OutOfBlocks as exc:
        return fail("kv_capacity", f"prompt does not fit: {exc}")
    params = engine_params(msg.sampling)
    compute_start = clock.now()
    logits = w.engine.prefill(prompt, blocks)
    gen = params.make_generator(w.engine.device)
    token = w.sampler.sample(logits[None], [params], [gen])[0]
    compute_s = clock.now() - compute_start
    finish = finish_reason(token, 1, params)
    handoff = None
    if finish is None:
        try:
            host, event = w.kv.swap_out(shape, blocks)
        except RemoteError as exc:
            w.kv.free(shape, blocks)
            return fail("kv_cache_full", f"unified KV cache: {exc}")
        spec = KVShapeSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                           shape.block_size, shape.dtype)  # fmt: skip
        handoff = KVHandoff(spec, host, len(prompt), to_event(event.handle()))
    else:
        w.kv.free(shape, blocks)
    done = clock.wall()
    timings = RequestTimings(
        prefill_wait_s=max(0.0, started - msg.arrival_s),
        prefill_s=done - started,
        extra={"prefill_compute_s": compute_s, "switch_s": record.total_s if record else 0.0},
    )
    message = PrefillDone(msg.request_id, w.index, token, finish, handoff, timings, done, w.kind)
    return PrefillOutcome(message, record, compute_s, len(prompt))
