"""The request table every proxy backend shares (``cluster.requests``), with a recording
placement: shedding by class and release as room is freed, the step-token fan-out,
strangers' tokens cancelled, retries up to MAX_RETRIES; and the replicated proxy's
view of every node (``cluster.node_caches``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aegaeon_common.config import Config
from aegaeon_common.messages.report import PrefillDone, StepTokens, TokenItem
from aegaeon_common.messages.structs import RequestTimings, SamplingParams
from aegaeon_common.registry import InstanceRecord
from aegaeon_proxy.backend import BackendError, GenerationRequest
from aegaeon_proxy.cluster.node_caches import merge_model_caches, node_services
from aegaeon_proxy.cluster.requests import MAX_RETRIES, RequestTable
from aegaeon_proxy.cluster.tracked import Tracked
from aegaeon_sched.admission import Bounds
from proxy_support import instance_record

MODEL = "m"


class Recorder:
    """A Placement that records what the table asked of it."""

    def __init__(self) -> None:
        self.placed: list[str] = []
        self.replaced: list[str] = []
        self.unplaced: list[tuple[str, bool]] = []
        self.orphans: list[str] = []

    def place(self, tracked: Tracked) -> None:
        self.placed.append(tracked.gen.request_id)

    def replace(self, tracked: Tracked) -> None:
        self.replaced.append(tracked.gen.request_id)

    def unplace(self, tracked: Tracked, cancelled: bool) -> None:
        self.unplaced.append((tracked.gen.request_id, cancelled))

    def cancel_orphan(self, request_id: str, msg: StepTokens) -> None:
        self.orphans.append(request_id)


def _table(**proxy: object) -> tuple[RequestTable, Recorder]:
    from aegaeon_common.config import config_from_dict

    raw = {"models": [{"name": MODEL, "path": str(Path("/nonexistent"))}],
           "proxy": {"admission_wait": True, **proxy}}  # fmt: skip
    config: Config = config_from_dict(raw, source="test")
    placement = Recorder()
    return RequestTable(config, placement), placement


def _gen(rid: str, priority: int, prompt: int = 8, max_tokens: int = 8) -> GenerationRequest:
    name = ("interactive", "standard", "batch")[priority]
    return GenerationRequest(rid, MODEL, tuple(range(prompt)),
                             SamplingParams(max_tokens=max_tokens),
                             arrival_s=0.0, priority=priority, ttft_s=(5.0, 10.0, 50.0)[priority],
                             slo_class=name)  # fmt: skip


def _first(rid: str, finish: str | None = None) -> PrefillDone:
    return PrefillDone(rid, 0, 7, finish, None, RequestTimings(), 0.0)


async def test_batch_waits_past_its_share_and_goes_once_the_room_is_freed() -> None:
    table, placement = _table()
    table.set_bounds(Bounds(prefill_tokens=100))
    table.open(_gen("b0", 2, prompt=40))
    waiting = table.open(_gen("b1", 2, prompt=20))  # 60 > 0.5 x 100: it waits
    table.open(_gen("i0", 0, prompt=20))  # 60 <= 1.25 x 100: admitted at once
    assert placement.placed == ["b0", "i0"] and waiting.deferred
    assert table.prefilled(_first("b0"), "prefill-0") is not None  # its 40 tokens freed
    assert placement.placed == ["b0", "i0", "b1"] and not waiting.deferred
    assert table.counters["deferred"] == 1 and table.counters["rejected"] == 0


async def test_a_full_table_is_a_429_naming_where() -> None:
    table, _ = _table(max_queued_requests=1)
    table.open(_gen("a", 1))
    with pytest.raises(BackendError) as err:
        table.open(_gen("b", 1))
    assert err.value.status == 429 and "at this proxy" in err.value.message


async def test_an_id_in_flight_twice_is_a_409() -> None:
    table, placement = _table()
    table.open(_gen("same", 1))
    with pytest.raises(BackendError) as err:
        table.open(_gen("same", 1))
    assert (err.value.status, err.value.code) == (409, "duplicate_request_id")
    assert placement.placed == ["same"]
    table.end("same", "stop")
    table.open(_gen("same", 1))  # once it ended, the id may come again


async def test_tokens_fan_out_and_a_strangers_tokens_are_cancelled_once() -> None:
    table, placement = _table()
    tracked = table.open(_gen("r", 1))
    assert table.prefilled(_first("r"), "prefill-0") is tracked
    assert table.prefilled(_first("r"), "prefill-0") is None  # a second prefill of it
    msg = StepTokens(0, [TokenItem("r", [1, 2]), TokenItem("stranger", [3])], 0.0)
    table.step_tokens(msg)
    assert tracked.num_generated == 3
    assert placement.orphans == ["stranger"]
    table.step_tokens(StepTokens(0, [TokenItem("stranger", [4])], 0.0))
    assert placement.orphans == ["stranger"]  # cancelled already
    table.step_tokens(StepTokens(0, [TokenItem("r", [5], "length")], 0.0))
    assert tracked.num_generated == 4 and "r" not in table.requests
    assert placement.unplaced == [("r", False)]
    table.step_tokens(StepTokens(0, [TokenItem("r", [6])], 0.0))  # late: ended here
    assert placement.orphans == ["stranger"] and table.counters["finished"] == 1


async def test_a_lost_request_is_placed_again_until_the_retries_run_out() -> None:
    table, placement = _table()
    tracked = table.open(_gen("r", 1))
    for _ in range(MAX_RETRIES):
        table.lost(tracked, "prefill-0", "down")
    assert placement.replaced == ["r"] * MAX_RETRIES and "r" in table.requests
    table.lost(tracked, "prefill-0", "down")
    assert "r" not in table.requests and table.counters["failed"] == 1


def _record(node: str, kind: str, index: int, capacity_tokens: int = 64) -> InstanceRecord:
    return instance_record(node, kind, index, capacity_tokens={MODEL: capacity_tokens},
                           http_url=f"http://{node}-{kind}", cachemgr_address=f"ipc://{node}",
                           cachemgr_http_url=f"http://{node}-cachemgr")  # fmt: skip


def test_services_list_each_nodes_cachemgr_then_its_instances() -> None:
    records = [_record("n1", "decode", 0), _record("n0", "decode", 0), _record("n0", "prefill", 0)]
    names = [(s.name, s.role) for s in node_services(records)]
    assert names == [("n0/cachemgr", "cachemgr"), ("n0/prefill-0", "prefill"),
                     ("n0/decode-0", "decode"), ("n1/cachemgr", "cachemgr"),
                     ("n1/decode-0", "decode")]  # fmt: skip


def test_model_caches_merge_as_resident_where_every_node_holds_it() -> None:
    def cache(models: list[str], progress: dict[str, float]) -> dict[str, object]:
        return {"budget_bytes": 10, "used_bytes": 4, "num_loads": 1,
                "models": [{"name": m, "nbytes": 2} for m in models], "loading": list(progress),
                "progress": progress, "operator_pinned": models, "known": ["a", "b"]}  # fmt: skip

    merged = merge_model_caches({"n0": cache(["a", "b"], {}), "n1": cache(["a"], {"b": 0.5})})
    assert [m["name"] for m in merged["models"]] == ["a"]
    assert merged["progress"] == {"b": 0.5} and merged["operator_pinned"] == ["a"]
    assert merged["budget_bytes"] == 20 and merged["loading"] == ["b"]


def test_replicas_share_the_derived_bounds_and_each_node_adds_its_host_cache() -> None:
    from aegaeon_common.config import config_from_dict
    from aegaeon_proxy.cluster.requests import bounds_of

    def config(**proxy: object) -> Config:
        raw = {"models": [{"name": MODEL, "path": "/nonexistent"}], "proxy": proxy}
        return config_from_dict(raw, source="test")

    two_nodes = [_record("n0", "decode", 0, 4096), _record("n1", "decode", 0, 4096)]
    one_node = [_record("n0", "decode", 0, 4096)] * 2
    whole = bounds_of(config(), two_nodes).kv_blocks
    assert whole is not None and whole > (bounds_of(config(), one_node).kv_blocks or 0)
    assert bounds_of(config(), two_nodes, replicas=2).kv_blocks == whole // 2
    assert bounds_of(config(max_kv_blocks=32), two_nodes, replicas=2).kv_blocks == 32


async def test_engine_steps_count_prefills_and_bundled_decode_steps() -> None:
    """A decode report is one batch's steps: each open request's new tokens are counted
    (``vllm:iteration_tokens_total``), a stranger's left out."""
    from aegaeon_proxy.vllm_metrics import EngineSteps
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    table, placement = _table()
    registry = CollectorRegistry()
    table.steps = EngineSteps()
    table.steps.register(registry)
    table.steps.prefill(MODEL, 12)
    table.open(_gen("r1", 0, prompt=3))
    table.open(_gen("r2", 0, prompt=5))
    # two steps of a batch of two, sent together; an unknown request is left out
    table.step_tokens(StepTokens(0, [TokenItem("r1", [1, 2]), TokenItem("r2", [3, 4]),
                                     TokenItem("gone", [9, 9, 9])], 0.0))  # fmt: skip
    table.step_tokens(StepTokens(0, [TokenItem("gone2", [1])], 0.0))  # no step of ours
    assert placement.orphans == ["gone", "gone2"]
    text = generate_latest(registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples}  # fmt: skip
    assert samples["vllm:iteration_tokens_total_count"] == 3  # one prefill, two decode steps
    assert samples["vllm:iteration_tokens_total_sum"] == 12 + 2 * 2
