"""LoRA adapters in the compute loops, on an in-memory worker (fake_worker.py).

A decode instance decodes a base's and its adapters' sequences in one batch:
one weight switch (the base's), every step mixing the rows of the base and of
each adapter, each adapter brought to the device once, tokens and metrics per
adapter. A prefill instance runs an adapter's prompt on its base with the
adapter, and the base's group takes its adapters' requests with no switch
between them. An adapter added at run time (``AddModel`` with ``base``) is
served at once; sleeping it drops its matrices, not its base.
"""

from __future__ import annotations

import msgspec
from aegaeon_common.messages.prefill import AddModel, EnqueuePrefill, SetModelAwake
from aegaeon_common.messages.report import InstanceModels, ModelsResident, PrefillDone, StepTokens
from aegaeon_common.messages.structs import SamplingParams
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_runtime.prefill.loop import PrefillLoop
from fake_worker import FakeWorker, latency_model, run_loop, token_at


def test_a_base_and_its_adapters_decode_in_one_batch_with_one_switch() -> None:
    w = FakeWorker(latency_model(["base", "other"], switch_s=0.05))
    w.adapt("lora-a", "base")
    w.adapt("lora-b", "base")
    timed = [(0.0, w.enqueue("b1", "base", 0, 20, 12, 0.0)),
             (0.0, w.enqueue("a1", "lora-a", 0, 30, 12, 0.0)),
             (0.0, w.enqueue("a2", "lora-b", 0, 10, 12, 0.0)),
             (0.0, w.enqueue("o1", "other", 1, 10, 12, 0.0))]  # fmt: skip
    loop, outbox = run_loop(DecodeLoop, w, timed)
    assert set(w.switcher.activations) == {"base", "other"}  # never an adapter's switch
    # a turn per unit: the base's turns take its adapters' sequences with it
    turns = [t.model for t in loop.counters.new_turns]
    assert set(turns) == {"base", "other"} and len(w.switcher.activations) <= len(turns)
    mixed = [step for step in w.engine.step_adapters if len(step) == 3]
    assert mixed and all(sorted(s, key=str) == [None, "lora-a", "lora-b"] for s in mixed)
    assert w.adapters.num_loads == 2 and loop.stats().counters["adapter_loads"] == 2
    tokens: dict[str, list[int]] = {}
    for msg in outbox.of_type(StepTokens):
        for item in msg.items:
            tokens.setdefault(item.request_id, []).extend(item.token_ids)
    starts = {"b1": 20, "a1": 30, "a2": 10, "o1": 10}
    for rid, first in starts.items():
        assert tokens[rid] == [token_at(first + k) for k in range(11)], rid
    decoded = {m: w.metrics.registry.get_sample_value(
        "aegaeon_instance_tokens_total", {"instance": w.name, "stage": "decode", "model": m})
        for m in ("base", "lora-a", "lora-b")}  # fmt: skip
    assert decoded == {"base": 11, "lora-a": 11, "lora-b": 11}  # each adapter its own


def test_an_adapters_prompt_runs_on_its_base_in_the_bases_group() -> None:
    w = FakeWorker(latency_model(["base", "other"], switch_s=0.05), kind="prefill")
    w.adapt("lora-a", "base")
    spec = SamplingParams(max_tokens=8, temperature=0.0)
    timed = [(0.0, EnqueuePrefill("b1", "base", 0, list(range(20)), spec, 0.0)),
             (0.0, EnqueuePrefill("o1", "other", 1, list(range(10)), spec, 0.0)),
             (0.0, EnqueuePrefill("a1", "lora-a", 0, list(range(30)), spec, 0.0))]  # fmt: skip
    _, outbox = run_loop(PrefillLoop, w, timed)
    done = [(d.request_id, d.token_id) for d in outbox.of_type(PrefillDone)]
    # the adapter's request is in the base's group: it runs before the other model's
    assert done == [("b1", token_at(19)), ("a1", token_at(29)), ("o1", token_at(9))]
    assert w.switcher.activations == ["base", "other"]
    assert w.engine.prefill_adapters == [None, "lora-a", None]


def test_an_adapter_added_at_run_time_is_served_and_sleeps_without_its_base() -> None:
    w = FakeWorker(latency_model(["base"], switch_s=0.05))
    timed = [(0.0, AddModel("lora-x", "/market/lora-x", ticket=1, base="base")),
             (0.0, w.enqueue("b1", "base", 0, 20, 4, 0.0)),
             # (its handoff's KV is its base's shape)
             (0.01, msgspec.structs.replace(w.enqueue("x1", "base", 0, 20, 4, 0.0),
                                            model="lora-x")),
             (1.0, SetModelAwake("lora-x", False, ticket=2))]  # fmt: skip
    loop, outbox = run_loop(DecodeLoop, w, timed)
    (models,) = outbox.of_type(InstanceModels)
    assert set(models.capacity_tokens) == {"base", "lora-x"}
    assert models.latency is not None and "lora-x" in models.latency.models
    (resident,) = outbox.of_type(ModelsResident)
    assert resident.resident_models == ["base"]  # the adapter's matrices left, not the base
    assert w.switcher.activations == ["base"]
    assert loop.stats().counters["adapter_loads"] == 1
