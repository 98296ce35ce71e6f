"""SLO classes in the proxy (no processes): the request fields and their errors, what an
API key and a model allow, the targets a request is scheduled with, and admission by
class (the lowest class deferred or refused first, never the highest first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aegaeon_common.config import (
    ApiKeyConfig,
    Config,
    ModelConfig,
    ModelSettings,
    ProxyConfig,
    SLOClassConfig,
    SLOClassesConfig,
    SLOConfig,
)
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.params import FIELDS, parse_common
from aegaeon_proxy.slo_classes import class_table, resolve
from aegaeon_sched import Request, Shedder, Verdict
from aegaeon_sched.admission import AdmissionControl, Bounds, ClassAdmission
from proxy_support import MODEL, ScriptedBackend, front, market_dir

KEY = "sk-unit-slo-classes-1"
BATCH_KEY = "sk-unit-slo-batch-only"


# ---- request fields ------------------------------------------------------------


@pytest.mark.parametrize("value", ["urgent", "", "INTERACTIVE", 1.5, True, [], {}, 1 << 63])
def test_a_priority_that_is_not_a_class_is_a_400_naming_it(value: Any) -> None:
    with pytest.raises(APIError) as err:
        parse_common({"model": "m", "priority": value}, FIELDS)
    assert err.value.status == 400 and err.value.param == "priority"
    assert "interactive" in err.value.message


@pytest.mark.parametrize("name", ["interactive", "standard", "batch"])
def test_each_class_is_accepted(name: str) -> None:
    assert parse_common({"model": "m", "priority": name}, FIELDS).priority == name


def test_no_priority_or_null_leaves_the_default() -> None:
    assert parse_common({"model": "m"}, FIELDS).priority is None
    assert parse_common({"model": "m", "priority": None}, FIELDS).priority is None


@pytest.mark.parametrize("field", ["ttft_ms", "tbt_ms"])
@pytest.mark.parametrize("value", [0, -5, "100", True, float("inf"), 1e12])
def test_explicit_targets_must_be_positive_numbers(field: str, value: Any) -> None:
    with pytest.raises(APIError) as err:
        parse_common({"model": "m", field: value}, FIELDS)
    assert err.value.status == 400 and err.value.param == field


def test_explicit_targets_are_milliseconds() -> None:
    params = parse_common({"model": "m", "ttft_ms": 250, "tbt_ms": 40.0}, FIELDS)
    assert params.ttft_s == pytest.approx(0.25) and params.tbt_s == pytest.approx(0.04)


# ---- what a key and a model allow --------------------------------------------------

SLO = (2.0, 0.1)


def _config(enabled: bool = True, settings: ModelSettings | None = None) -> Config:
    return Config(models=(ModelConfig(MODEL, Path("x")),), slo=SLOConfig(*SLO),
                  slo_classes=SLOClassesConfig(enabled=enabled),
                  model_settings={MODEL: settings} if settings else {})  # fmt: skip


def _resolve(config: Config, key: ApiKeyConfig | None = None, **asked: Any) -> Any:
    fields = {"priority": None, "ttft_s": None, "tbt_s": None, **asked}
    return resolve(config, MODEL, config.settings_of(MODEL), key, model_slo=SLO, **fields)


def test_classes_scale_the_models_slo_unless_configured() -> None:
    config = _config()
    assert _resolve(config).priority == 1
    interactive = _resolve(config, priority="interactive")
    assert (interactive.priority, interactive.ttft_s, interactive.tbt_s) == (0, 1.0, 0.1)
    batch = _resolve(config, priority="batch")
    assert (batch.priority, batch.ttft_s, batch.targets) == (2, 10.0, (10.0, 0.4))
    tuned = Config(models=config.models, slo_classes=SLOClassesConfig(
        batch=SLOClassConfig(ttft_s=30.0, admit_fraction=0.2, defer=False)))  # fmt: skip
    cls = class_table(tuned, *SLO).get("batch")
    assert (cls.ttft_s, cls.tbt_s, cls.admit_fraction, cls.defer) == (30.0, 0.4, 0.2, False)


def test_a_class_the_key_does_not_allow_is_a_403_naming_priority() -> None:
    key = ApiKeyConfig(BATCH_KEY, slo_classes=("batch",))
    with pytest.raises(APIError) as err:
        _resolve(_config(), key, priority="interactive")
    assert (err.value.status, err.value.param, err.value.code) == (
        403, "priority", "slo_class_not_allowed")
    assert _resolve(_config(), key).slo_class == "batch"  # the default: the lowest allowed


def test_a_class_the_model_does_not_allow_is_a_403() -> None:
    config = _config(settings=ModelSettings(slo_classes=("standard", "batch")))
    with pytest.raises(APIError) as err:
        _resolve(config, priority="interactive")
    assert err.value.status == 403 and err.value.param == "priority"
    assert _resolve(config, priority="batch").priority == 2
    nothing = ApiKeyConfig(KEY, slo_classes=("interactive",))
    with pytest.raises(APIError):  # the key and the model allow no class in common
        _resolve(config, nothing)


def test_the_403_speaks_of_an_api_key_only_when_there_is_one() -> None:
    """Issue 43: with no keys configured, the model's own settings refuse the class."""
    config = _config(settings=ModelSettings(slo_classes=("batch",), min_ttft_s=5.0))
    for key, asked in [(None, {"priority": "interactive"}), (None, {"ttft_s": 1.0}),
                       (ApiKeyConfig(KEY), {"priority": "interactive"}),
                       (ApiKeyConfig(KEY), {"ttft_s": 1.0})]:  # fmt: skip
        with pytest.raises(APIError) as err:
            _resolve(config, key, **asked)
        assert err.value.status == 403 and f"model '{MODEL}'" in err.value.message
        assert ("with this API key" in err.value.message) == (key is not None), err.value.message


def test_explicit_targets_are_bounded_by_the_floors() -> None:
    config = _config(settings=ModelSettings(min_ttft_s=0.5))
    key = ApiKeyConfig(KEY, min_tbt_s=0.05)
    with pytest.raises(APIError) as err:
        _resolve(config, key, ttft_s=0.4)
    assert (err.value.status, err.value.param, err.value.code) == (
        403, "ttft_ms", "slo_target_not_allowed")
    with pytest.raises(APIError) as err:
        _resolve(config, key, tbt_s=0.01)
    assert err.value.param == "tbt_ms"
    got = _resolve(config, key, priority="batch", ttft_s=0.5, tbt_s=0.05)
    assert (got.priority, got.ttft_s, got.tbt_s) == (2, 0.5, 0.05)  # the class stays batch
    # a key limited to batch may not ask for a target tighter than batch's own
    with pytest.raises(APIError):
        _resolve(_config(), ApiKeyConfig(BATCH_KEY, slo_classes=("batch",)), ttft_s=1.0)


def test_classes_off_schedules_every_request_as_standard_but_still_checks() -> None:
    config = _config(enabled=False)
    got = _resolve(config, priority="interactive", ttft_s=0.3)
    assert (got.priority, got.ttft_s, got.tbt_s, got.targets) == (1, None, None, SLO)
    with pytest.raises(APIError):
        _resolve(config, ApiKeyConfig(BATCH_KEY, slo_classes=("batch",)), priority="standard")


# ---- through the HTTP front ----------------------------------------------------------


async def test_the_front_answers_field_errors_and_passes_the_class_on() -> None:
    market = market_dir()
    keys = (ApiKeyConfig(KEY), ApiKeyConfig(BATCH_KEY, slo_classes=("batch",)))
    config = Config(models=(ModelConfig(MODEL, market / MODEL),), proxy=ProxyConfig(api_keys=keys),
                    slo=SLOConfig(*SLO))  # fmt: skip
    backend = ScriptedBackend()
    backend.token_ids = [5, 6]
    answers: list[tuple[int, Any]] = []
    bodies: list[tuple[str, dict[str, Any], str]] = [
        (KEY, {"priority": "urgent"}, "/v1/completions"),
        (KEY, {"ttft_ms": -1}, "/v1/chat/completions"),
        (BATCH_KEY, {"priority": "interactive"}, "/v1/completions"),
        (KEY, {"priority": "interactive"}, "/v1/completions"),
        (BATCH_KEY, {"tbt_ms": 500}, "/v1/chat/completions"),
    ]
    async with front(config, backend) as client:
        for key, extra, path in bodies:
            prompt = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                      else {"prompt": "hi"})  # fmt: skip
            resp = await client.post(path, json={"model": MODEL, "max_tokens": 2, **prompt,
                                                 **extra},
                                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            answers.append((resp.status, await resp.json()))
    statuses = [status for status, _ in answers]
    assert statuses == [400, 400, 403, 200, 200]
    params = [body["error"]["param"] for status, body in answers if status != 200]
    assert params == ["priority", "ttft_ms", "priority"]
    assert answers[0][1]["error"]["type"] == "invalid_request_error"
    interactive, batch = backend.submitted
    assert (interactive.slo_class, interactive.priority, interactive.ttft_s) == (
        "interactive", 0, 1.0)
    assert (batch.slo_class, batch.priority, batch.tbt_s) == ("batch", 2, 0.5)


# ---- admission by class ---------------------------------------------------------------


def _gate(bound: int = 100, max_deferred: int = 8) -> ClassAdmission:
    shedder = Shedder(class_table(_config(), *SLO), max_deferred)
    return ClassAdmission(AdmissionControl(Bounds(prefill_tokens=bound)), shedder)


def _req(rid: str, priority: int, prompt: int = 20, arrival: float = 0.0) -> Request:
    return Request(rid, MODEL, arrival, prompt, 1, priority=priority,
                   ttft_s=(1.0, 2.0, 10.0)[priority])  # fmt: skip


def _offer(gate: ClassAdmission, request: Request) -> Verdict:
    verdict = gate.decide(request)
    if verdict is Verdict.ADMIT:
        gate.admit(request)
    return verdict


def test_the_lowest_class_is_shed_first_never_the_highest() -> None:
    gate = _gate()
    assert _offer(gate, _req("b0", 2, 40)) is Verdict.ADMIT  # 40 held
    assert _offer(gate, _req("b1", 2, 20)) is Verdict.DEFER  # batch: past 0.5 x 100
    assert _offer(gate, _req("s0", 1, 50)) is Verdict.ADMIT  # 90 held
    assert _offer(gate, _req("s1", 1, 20)) is Verdict.REFUSE  # standard: past 100
    assert _offer(gate, _req("i0", 0, 30)) is Verdict.ADMIT  # interactive: up to 125
    assert _offer(gate, _req("i1", 0, 10)) is Verdict.REFUSE
    assert gate.num_deferred == 1
    assert gate.admission.refused["prefill_tokens"] == 0  # decisions count nothing
    assert "prefill tokens" in gate.why(_req("s1", 1, 20))


def test_deferred_requests_leave_in_deadline_order_as_room_is_freed() -> None:
    gate = _gate()
    gate.admit(_req("big", 1, 90))
    for rid, arrival in (("late", 0.5), ("early", 0.0), ("gone", 0.2)):
        assert gate.decide(_req(rid, 2, 20, arrival)) is Verdict.DEFER
    assert gate.release() == []  # nothing freed
    assert gate.cancel("gone") and not gate.cancel("gone")
    gate.admission.release("big")
    out = [r.request_id for r in gate.release()]
    assert out == ["early", "late"]  # 20 + 20 <= 0.5 x 100, admitted one by one
    assert gate.admission.snapshot()["prefill_tokens"] == 40
    assert gate.num_deferred == 0


def test_release_stops_at_the_bound() -> None:
    gate = _gate()
    gate.admit(_req("big", 1, 90))
    for k in range(4):
        gate.decide(_req(f"b{k}", 2, 20, float(k)))
    gate.admission.release("big")
    assert [r.request_id for r in gate.release()] == ["b0", "b1"]  # 60 > 50 stops it
    assert gate.num_deferred == 2


def test_without_classes_every_request_is_held_to_the_whole_bound() -> None:
    gate = ClassAdmission(AdmissionControl(Bounds(prefill_tokens=100)), None)
    assert _offer(gate, _req("b0", 2, 90)) is Verdict.ADMIT
    assert _offer(gate, _req("i0", 0, 20)) is Verdict.REFUSE  # no headroom for any class
    assert gate.release() == [] and gate.num_deferred == 0
