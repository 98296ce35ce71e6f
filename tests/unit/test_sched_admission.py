"""Admission bookkeeping (pure): bounds per model and in total, release on every ending,
a request larger than a bound still served alone; bounds derived from the instances;
the config keys that set them."""

from __future__ import annotations

import pytest
from aegaeon_common.config import ConfigError, api_key_entries, config_from_dict
from aegaeon_sched.admission import AdmissionControl, Bounds, derive_bounds
from hypothesis import given, settings
from hypothesis import strategies as st


def test_prefill_tokens_are_held_until_the_first_token() -> None:
    adm = AdmissionControl(Bounds(prefill_tokens=100))
    assert adm.refusal("a", 60, 1) is None
    adm.admit("r1", "a", 60, 1)
    why = adm.refusal("b", 50, 1)
    assert why is not None and why.startswith("prefill tokens")
    adm.prefilled("r1")  # its prompt left the queue; its KV stays reserved
    assert adm.refusal("b", 50, 1) is None
    assert adm.snapshot()["prefill_tokens"] == 0 and adm.snapshot()["kv_blocks"] == 4


def test_kv_blocks_per_model_and_total() -> None:
    adm = AdmissionControl(Bounds(kv_blocks=10, kv_blocks_per_model=6))
    adm.admit("r1", "a", 32, 32)  # 4 blocks
    assert adm.refusal("a", 16, 32) is not None  # a: 4 + 3 > 6
    assert adm.refusal("b", 16, 32) is None  # b: 3, total 7
    adm.admit("r2", "b", 16, 80)  # 6 blocks: total 10
    assert adm.refusal("c", 1, 1) is not None  # total: 10 + 1 > 10
    adm.release("r1")
    assert adm.refusal("c", 1, 1) is None
    assert adm.refused == {"kv_blocks_per_model": 1, "kv_blocks": 1}


def test_a_request_larger_than_a_bound_is_served_alone() -> None:
    adm = AdmissionControl(Bounds(prefill_tokens=10, kv_blocks=2))
    assert adm.refusal("a", 500, 500) is None  # nothing held: admitted, not refused forever
    adm.admit("r1", "a", 500, 500)
    assert adm.refusal("a", 1, 1) is not None


def test_a_requeued_request_holds_its_prompt_again() -> None:
    adm = AdmissionControl(Bounds())
    adm.admit("r1", "a", 40, 8)
    adm.prefilled("r1")
    adm.requeued("r1", 40)
    assert adm.snapshot()["prefill_tokens"] == 40
    adm.release("r1")
    adm.release("r1")  # idempotent
    assert adm.snapshot() | {"bounds": None} == {
        "requests": 0, "prefill_tokens": 0, "kv_blocks": 0, "bounds": None, "refused": {}}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "prefilled", "requeued", "release"]),
                          st.integers(0, 5), st.sampled_from("ab"), st.integers(1, 300),
                          st.integers(1, 300)), max_size=60))  # fmt: skip
def test_counts_return_to_zero_whatever_the_order(
    ops: list[tuple[str, int, str, int, int]],
) -> None:
    adm = AdmissionControl(Bounds(prefill_tokens=500, kv_blocks=40))
    for op, rid, model, prompt, out in ops:
        name = f"r{rid}"
        if op == "admit":
            adm.admit(name, model, prompt, out)
        elif op == "prefilled":
            adm.prefilled(name)
        elif op == "requeued":
            adm.requeued(name, prompt)
        else:
            adm.release(name)
        snap = adm.snapshot()
        assert snap["prefill_tokens"] >= 0 and snap["kv_blocks"] >= 0  # type: ignore[operator]
    for rid in range(6):
        adm.release(f"r{rid}")
    snap = adm.snapshot()
    assert (snap["requests"], snap["prefill_tokens"], snap["kv_blocks"]) == (0, 0, 0)


def test_bounds_derived_from_the_instances_unless_configured() -> None:
    derived = derive_bounds(Bounds(), ttft_s=2.0, prefill_s_per_token=[0.001, 0.002],
                            decode_capacity_tokens=[{"a": 1600, "b": 3200}, {"a": 800}])
    assert derived == Bounds(prefill_tokens=3000, prefill_tokens_per_model=3000,
                             kv_blocks=150, kv_blocks_per_model=150)
    set_ = derive_bounds(Bounds(prefill_tokens=7, kv_blocks_per_model=3), ttft_s=2.0,
                         prefill_s_per_token=[0.001], decode_capacity_tokens=[{"a": 160}])
    assert set_ == Bounds(7, 7, 10, 3)
    assert derive_bounds(Bounds(), ttft_s=1.0, prefill_s_per_token=[],
                         decode_capacity_tokens=[]) == Bounds()  # fmt: skip
    # the host's KV cache adds its blocks to the devices'
    host = derive_bounds(Bounds(), ttft_s=1.0, prefill_s_per_token=[],
                         decode_capacity_tokens=[{"a": 160}], host_kv_tokens=1600)
    assert (host.kv_blocks, host.kv_blocks_per_model) == (110, 110)
    # each of many proxy replicas admits its share of a derived bound, a configured one whole
    shared = derive_bounds(Bounds(prefill_tokens=7), ttft_s=2.0, prefill_s_per_token=[0.001],
                           decode_capacity_tokens=[{"a": 1600}], replicas=3)
    assert shared == Bounds(7, 7, 33, 33)


def _config(**proxy: object) -> object:
    return config_from_dict({"models": [{"name": "a", "path": "/x"}], "proxy": proxy})


def test_proxy_reliability_keys_validate() -> None:
    config = _config(max_prefill_tokens=100, max_kv_blocks_per_model=5, retry_after=2,
                     read_timeout=3, write_timeout=4, request_timeout=5, admin_port=9001,
                     api_keys=["sk-plain-123", {"key": "sk-limited-1", "models": ["a"]}])
    proxy = config.proxy  # type: ignore[attr-defined]
    assert (proxy.max_prefill_tokens, proxy.max_kv_blocks_per_model) == (100, 5)
    assert (proxy.retry_after_s, proxy.read_timeout_s, proxy.write_timeout_s) == (2, 3, 4)
    assert [k.models for k in proxy.api_keys] == [(), ("a",)]
    for bad, field in [({"max_kv_blocks": 0}, "proxy.max_kv_blocks"),
                       ({"write_timeout": 0}, "proxy.write_timeout"),
                       ({"admin_port": 8000}, "proxy.admin_port"),
                       ({"api_keys": ["short"]}, "proxy.api_keys[0]"),
                       # the README's rule: at least 8 characters, no spaces anywhere
                       ({"api_keys": ["sk-with space"]}, "proxy.api_keys[0]"),
                       ({"api_keys": ["sk-tab\tinside"]}, "proxy.api_keys[0]"),
                       ({"api_keys": ["sk-same-123", "sk-same-123"]}, "proxy.api_keys[1]"),
                       ({"api_keys": [{"key": "sk-limited-1", "models": ["zz"]}]},
                        "proxy.api_keys[0].models"),
                       ({"api_keys": "sk-notalist"}, "proxy.api_keys"),
                       ({"admin_keys": ["short"]}, "proxy.admin_keys[0]"),
                       ({"admin_keys": "sk-notalist"}, "proxy.admin_keys"),
                       ({"api_keys": ["sk-same-123"], "admin_keys": ["sk-same-123"]},
                        "proxy.admin_keys[0]"),
                       ({"admin_keys": [{"key": "sk-admin-123", "models": ["a"]}]},
                        "proxy.admin_keys[0].models"),
                       ({"api_keys": [{"key": "sk-admin-123", "admin": True, "models": ["a"]}]},
                        "proxy.api_keys[0].models"),
                       ({"api_keys": [{"key": "sk-admin-123", "admin": "yes"}]},
                        "proxy.api_keys[0].admin")]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            _config(**bad)
        assert info.value.field == field, (bad, info.value)


def test_admin_keys_three_ways() -> None:
    """``proxy.admin_keys``, ``{key, admin: true}`` in ``proxy.api_keys``: admin keys;
    the rest user keys. ``proxy.keys`` is the one list the proxy checks."""
    config = _config(api_keys=["sk-user-123", {"key": "sk-admin-1", "admin": True}],
                     admin_keys=["sk-admin-2", {"key": "sk-admin-3", "name": "ops"}])
    proxy = config.proxy  # type: ignore[attr-defined]
    assert [(k.key, k.admin) for k in proxy.keys] == [
        ("sk-user-123", False), ("sk-admin-1", True), ("sk-admin-2", True), ("sk-admin-3", True)]
    assert "sk-admin" not in repr(proxy.keys)  # a key never reaches a log line


def test_tcp_addresses_stay_on_the_loopback_without_curve() -> None:
    base = {"models": [{"name": "a", "path": "/x"}]}
    config_from_dict({**base, "addresses": {"proxy": "tcp://127.0.0.1:5555"}})
    with pytest.raises(ConfigError) as info:
        config_from_dict({**base, "addresses": {"proxy": "tcp://0.0.0.0:5555"}})
    assert info.value.field == "addresses.proxy" and "CURVE" in info.value.problem


def test_api_key_arguments() -> None:
    assert api_key_entries(["sk-a-1234567", "sk-b-1234567:m1, m2"], []) == [
        {"key": "sk-a-1234567"}, {"key": "sk-b-1234567", "models": ["m1", "m2"]}]
