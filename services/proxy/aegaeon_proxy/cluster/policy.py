"""Building the configured policy once every instance has announced itself."""

from __future__ import annotations

from aegaeon_common.config import Config
from aegaeon_common.wire import to_plain
from aegaeon_sched import (
    ClusterSpec,
    DecodeDispatcher,
    LatencyModel,
    Policy,
    PolicyOptions,
    make_policy,
)
from aegaeon_sched.admission import Bounds, derive_bounds

from aegaeon_proxy.cluster.instances import Instances

TYPICAL_PROMPT_TOKENS = 512  # where a profile's per-token prefill time is read


def _latency(instances: Instances) -> LatencyModel:
    """The prefill instances' start-up profile (Alg. 1 needs prefill estimates);
    any instance's when the policy has no prefill instances."""
    ordered = sorted(instances, key=lambda v: v.kind != "prefill")
    for view in ordered:
        if view.hello is not None and view.hello.latency is not None:
            return LatencyModel.from_dict(to_plain(view.hello.latency))
    raise RuntimeError("no instance reported a latency profile")


def _min_capacity(instances: Instances, kind: str) -> dict[str, int]:
    capacity: dict[str, int] = {}
    for view in instances:
        if view.kind != kind or view.hello is None:
            continue
        for model, tokens in view.hello.capacity_tokens.items():
            capacity[model] = min(tokens, capacity.get(model, tokens))
    return capacity


def build_policy(config: Config, instances: Instances, unified: bool) -> Policy:
    names = [v.name for v in instances]
    standby: tuple[str, ...] = ()
    if unified:
        cluster = ClusterSpec(prefill_instances=(), decode_instances=tuple(names))
    else:
        prefill = tuple(n for n in names if n.startswith("prefill-"))
        decode = tuple(n for n in names if n.startswith("decode-"))
        if config.role_switching:
            # Every instance may prefill (decode instances run the hybrid loop); the
            # decode ones start in the decode role (standby for prefill work) and the
            # proxy moves them (aegaeon_proxy.cluster.roles).
            standby = decode
            prefill, decode = prefill + decode, decode + prefill
        elif config.hybrid_prefill:
            decode += prefill  # decode instances first: Alg. 2 breaks ties by order
        cluster = ClusterSpec(prefill_instances=prefill, decode_instances=decode)
    capacity = _min_capacity(instances, "decode")
    options = PolicyOptions(
        max_group_size=config.scheduler.max_group_size,
        max_batch_size=config.scheduler.max_batch_size,
        decode_capacity_tokens=capacity,
        unified_capacity_tokens=capacity,
        decode_tbt_s=config.slo.tbt_s,  # what every decode instance plans for
        # a request without its own TTFT (classes off) is keyed by the deployment's,
        # as the instances key their mirrors
        default_ttft_s=config.slo.ttft_s,
        standby=standby,
        role_switching=config.role_switching and not unified,
    )
    policy = make_policy(config.scheduler.policy, cluster, _latency(instances), options)
    dispatcher = getattr(policy, "decode", None)
    if isinstance(dispatcher, DecodeDispatcher):  # each instance's own KV capacity
        for view in instances:
            if view.name in cluster.decode_instances and view.hello is not None:
                for model, tokens in view.hello.capacity_tokens.items():
                    dispatcher.set_capacity(view.name, model, tokens)
    return policy


def admission_bounds(config: Config, instances: Instances) -> Bounds:
    """``proxy.max_*`` bounds, the unset ones derived from the instances' hellos
    (:func:`~aegaeon_sched.admission.derive_bounds`)."""
    proxy = config.proxy
    configured = Bounds(proxy.max_prefill_tokens, proxy.max_prefill_tokens_per_model,
                        proxy.max_kv_blocks, proxy.max_kv_blocks_per_model)  # fmt: skip
    per_token: list[float] = []
    capacities: list[dict[str, int]] = []
    host_kv_tokens = 0
    for view in instances:
        hello = view.hello
        if hello is None:
            continue
        prefills = config.unified or view.kind == "prefill"
        if prefills and hello.latency is not None and hello.capacity_tokens:
            latency = LatencyModel.from_dict(to_plain(hello.latency))
            n = TYPICAL_PROMPT_TOKENS
            per_token.append(max(latency.prefill_one_s(m, n) / n for m in hello.capacity_tokens))
        if config.unified or view.kind == "decode" or config.hybrid_prefill:  # it decodes
            capacities.append(dict(hello.capacity_tokens))
            if hello.capacity_tokens:
                # the host KV cache in tokens of the same (largest per-token) model:
                # the device region scaled by the two regions' sizes
                kind = config.decode if view.kind == "decode" else config.prefill
                region = kind.kv_memory_bytes
                tokens = min(hello.capacity_tokens.values()) * config.cache.kv_cache_bytes // region
                host_kv_tokens = max(host_kv_tokens, tokens)
    return derive_bounds(configured, ttft_s=config.slo.ttft_s, prefill_s_per_token=per_token,
                         decode_capacity_tokens=capacities,
                         host_kv_tokens=host_kv_tokens)  # fmt: skip
