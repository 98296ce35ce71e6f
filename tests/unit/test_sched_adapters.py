"""LoRA adapters in the policies: a base and its adapters are one switching unit.

A request of an adapter carries its base as ``Request.unit``: it joins the
base's decode batch and prefill group (one switch serves them all), the
request-level baselines batch it on an instance holding its base (as vLLM
does), static multiplexing places it with its base, and the shared store's
request state keeps its unit.
"""

from __future__ import annotations

import msgspec
import pytest
from aegaeon_sched import (
    ClusterSpec,
    DecodeDispatcher,
    DecodeWorkList,
    LatencyModel,
    PolicyOptions,
    PrefillDispatcher,
    Request,
    RequestLevelPolicy,
    RunOnInstance,
    make_policy,
)
from sched_support import tiny_latency


def make_latency(models: list[str]) -> LatencyModel:
    """Prefill of a prompt: 1 ms a token; a switch: 1 s a model."""
    return tiny_latency(models)


def _req(rid: str, model: str, unit: str = "", arrival_s: float = 0.0) -> Request:
    return Request(rid, model, arrival_s, 100, 50, unit=unit)


def test_adapters_join_their_bases_decode_batch() -> None:
    work = DecodeWorkList()
    work.add(_req("b1", "base"), 0)
    work.add(_req("a1", "lora-a", unit="base"), 0)
    work.add(_req("a2", "lora-b", unit="base"), 0)
    batch = work.batch(0)
    assert batch is not None and batch.model == "base" and len(batch) == 3
    with pytest.raises(ValueError, match="holds 'base'"):
        work.add(_req("x", "lora-c", unit="other"), 0)
    dispatcher = DecodeDispatcher(["d0", "d1"])
    placed = {dispatcher.place(r) for r in (_req("b", "base"), _req("a", "lora-a", "base"),
                                             _req("c", "lora-b", "base"))}
    assert len(placed) == 1  # one batch on one instance: one switch serves them all


def test_adapters_share_their_bases_prefill_group_and_switch() -> None:
    latency = make_latency(["base", "other"])
    dispatcher = PrefillDispatcher(["p0"], latency)
    groups = {dispatcher.dispatch(r, 0.0)[1]
              for r in (_req("b", "base"), _req("a", "lora-a", "base"),
                        _req("c", "lora-b", "base"))}
    assert len(groups) == 1
    queue = dispatcher.queues["p0"]
    alone = queue.load_s(latency, 0.0)
    dispatcher.dispatch(_req("o", "other", arrival_s=0.0), 0.0)
    # the other model's group costs one more switch; the adapters cost none of their own
    assert queue.load_s(latency, 0.0) == pytest.approx(
        alone + latency.switch_s("other") + latency.prefill_one_s("other", 100))


def test_request_level_batches_adapters_on_a_resident_base() -> None:
    policy = RequestLevelPolicy(["u0", "u1"], max_batch_size=8)
    first = policy.on_arrival(_req("b", "base"), 0.0)
    runs = [(a.instance, a.model) for a in first if isinstance(a, RunOnInstance)]
    assert runs == [("u0", "base")]
    second = policy.on_arrival(_req("a", "lora-a", "base"), 0.1)
    run = [a for a in second if isinstance(a, RunOnInstance)]
    assert [(a.instance, a.model) for a in run] == [("u0", "base")]  # no scale-up to another


def test_static_mux_places_an_adapter_with_its_base() -> None:
    latency = make_latency(["base", "other", "lora-a"])
    cluster = ClusterSpec(prefill_instances=(), decode_instances=("g0", "g1"))
    options = PolicyOptions(model_loads={"base": 1.0, "other": 1.0, "lora-a": 5.0},
                            max_models_per_gpu=1, units={"lora-a": "base"})
    policy = make_policy("static-mux", cluster, latency, options)
    actions = policy.on_arrival(_req("a", "lora-a", "base"), 0.0)
    base_gpu = policy.on_arrival(_req("b", "base"), 0.0)
    assert [a.instance for a in actions] == [a.instance for a in base_gpu]  # type: ignore[attr-defined]


def test_the_stored_request_keeps_the_unit() -> None:
    request = _req("a", "lora-a", "base")
    stored = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(stored, type=Request) == request
    # a request stored before units: no unit
    older = msgspec.msgpack.encode(msgspec.to_builtins(request)[:9])
    assert msgspec.msgpack.decode(older, type=Request).unit == ""
    assert request.switch_unit == "base" and _req("b", "base").switch_unit == "base"
