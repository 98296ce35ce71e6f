"""What a deployment needs of the machine, checked before anything starts (issue 48),
with the CUDA count given: the GPU machine's answers without a GPU."""

from __future__ import annotations

import pytest
from aegaeon_common.config import Config, ConfigError, config_from_dict
from aegaeon_common.env import EnvError
from aegaeon_runtime import preflight
from aegaeon_runtime.preflight import CudaDevices, check_machine, instance_devices, one_instance

MODELS = [{"name": "a", "path": "x"}]


def _config(**sections: object) -> Config:
    return config_from_dict({"models": MODELS, **sections}, source="c.yaml")


def _never() -> CudaDevices:
    raise AssertionError("CUDA asked about for a CPU deployment")


def test_cuda_devices_are_counted_against_what_is_visible() -> None:
    config = _config(prefill={"device": "cuda"},
                     decode={"instances": 2, "devices": ["cuda:0", "cuda:1"]})  # fmt: skip
    placed = instance_devices(config)
    assert [(p.name, p.field, p.device) for p in placed] == [
        ("prefill-0", "prefill.device", "cuda"), ("decode-0", "decode.devices", "cuda:0"),
        ("decode-1", "decode.devices", "cuda:1")]  # fmt: skip
    check_machine(config, placed, lambda: CudaDevices(2))
    with pytest.raises(ConfigError, match=r"^c\.yaml: decode\.devices: decode-1 is on 'cuda:1' "
                       r"but 1 CUDA device\(s\) are visible \(cuda:0\.\.cuda:0\)$"):
        check_machine(config, placed, lambda: CudaDevices(1))
    with pytest.raises(ConfigError, match=r"^c\.yaml: prefill\.device: prefill-0 is on 'cuda' "
                       r"but no CUDA device is visible \(no driver\); use cpu$"):
        check_machine(config, placed, lambda: CudaDevices(0, "no driver"))


def test_a_cpu_deployment_never_asks_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    config = _config()
    check_machine(config, instance_devices(config), _never)


def test_request_level_workers_are_all_decode_instances() -> None:
    config = _config(scheduler={"policy": "request-level"}, prefill={"instances": 2},
                     decode={"instances": 1, "devices": ["cpu", "cuda:3"]})  # fmt: skip
    names = [(p.name, p.device) for p in instance_devices(config)]
    assert names == [("decode-0", "cpu"), ("decode-1", "cuda:3"), ("decode-2", "cpu")]
    with pytest.raises(ConfigError, match="the config has no prefill instance"):
        one_instance(config, "prefill", 0)
    assert one_instance(config, "decode", 1)[0].device == "cuda:3"


def test_an_isa_level_this_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from aegaeon_engine import isa

    monkeypatch.setattr(isa, "supported_levels", lambda: ("avx2",))
    monkeypatch.setenv("AEGAEON_ISA", "amx")
    config = _config()
    with pytest.raises(EnvError, match=r"^AEGAEON_ISA='amx': this CPU \(.*\) supports avx2; "):
        check_machine(config, instance_devices(config), _never)
    monkeypatch.setenv("AEGAEON_NATIVE", "0")  # no native kernels: the level is moot
    check_machine(config, instance_devices(config), _never)
    monkeypatch.setenv("AEGAEON_NATIVE", "1")
    monkeypatch.setenv("AEGAEON_ISA", "avx2")
    check_machine(config, instance_devices(config), _never)


def test_no_driver_is_known_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "DRIVER_PATHS", ("/nonexistent/nvidiactl",))
    found = preflight.no_driver()
    assert found is not None and found.count == 0 and "/nonexistent/nvidiactl" in found.why_none
    monkeypatch.setattr(preflight, "DRIVER_PATHS", ("/proc/self",))
    assert preflight.no_driver() is None  # a driver is there: torch must be asked
