"""The admission bounds: ``proxy.max_*``, the unset ones derived from the instances'
records (:func:`bounds_of`)."""

from __future__ import annotations

from collections.abc import Iterable

from aegaeon_common.config import Config
from aegaeon_common.registry import InstanceRecord
from aegaeon_common.wire import to_plain
from aegaeon_sched import LatencyModel
from aegaeon_sched.admission import Bounds, derive_bounds

TYPICAL_PROMPT_TOKENS = 512  # where a profile's per-token prefill time is read


def bounds_of(config: Config, records: Iterable[InstanceRecord], replicas: int = 1) -> Bounds:
    """``proxy.max_*`` bounds, the unset ones derived from the instances' ``records``
    (:func:`~aegaeon_sched.admission.derive_bounds`: prefill within the TTFT target, the
    decode instances' KV plus each node's host KV cache). With many proxy replicas,
    each admits on its own: a derived bound is shared by the ``replicas`` evenly (a
    configured one is each replica's as configured)."""
    proxy = config.proxy
    per_token: list[float] = []
    capacities: list[dict[str, int]] = []
    host_kv_tokens: dict[str, int] = {}  # node -> its host KV cache in tokens
    for m in records:
        prefills = config.unified or m.kind == "prefill"
        if prefills and m.latency is not None and m.capacity_tokens:
            latency = LatencyModel.from_dict(to_plain(m.latency))
            n = TYPICAL_PROMPT_TOKENS
            per_token.append(max(latency.prefill_one_s(x, n) / n for x in m.capacity_tokens))
        if config.unified or m.kind == "decode" or config.hybrid_prefill:  # it decodes
            capacities.append(dict(m.capacity_tokens))
            if m.capacity_tokens:
                # the host KV cache in tokens of the same (largest per-token) model:
                # the device region scaled by the two regions' sizes
                kind = config.decode if m.kind == "decode" else config.prefill
                region = kind.kv_memory_bytes
                tokens = min(m.capacity_tokens.values()) * config.cache.kv_cache_bytes // region
                host_kv_tokens[m.node] = max(host_kv_tokens.get(m.node, 0), tokens)
    derived = derive_bounds(Bounds(), ttft_s=config.slo.ttft_s, prefill_s_per_token=per_token,
                            decode_capacity_tokens=capacities,
                            host_kv_tokens=sum(host_kv_tokens.values()))  # fmt: skip

    def share(total: int | None) -> int | None:
        return None if total is None else max(1, total // max(1, replicas))

    configured = Bounds(
        proxy.max_prefill_tokens or share(derived.prefill_tokens),
        proxy.max_prefill_tokens_per_model,
        proxy.max_kv_blocks or share(derived.kv_blocks),
        proxy.max_kv_blocks_per_model,
    )  # fmt: skip
    # (nothing more to derive: the per-model bounds left unset are the totals)
    return derive_bounds(configured, ttft_s=config.slo.ttft_s, prefill_s_per_token=(),
                         decode_capacity_tokens=())  # fmt: skip
