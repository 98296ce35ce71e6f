"""The environment: every AEGAEON_* variable read in aegaeon_common.env, each value checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from aegaeon_common.env import ISA_LEVELS, EnvError, read_env
from aegaeon_engine.isa import LEVELS

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("libs", "services", "tools", "bench", "sim", "scripts")
# a read of a variable: os.environ.get("AEGAEON_..."), os.getenv(...), os.environ["AEGAEON_..."]
# (not an assignment, and not a child's environment built with the name as a key)
READ = re.compile(r"""(environ\.get|getenv)\(\s*["']AEGAEON_"""
                  r"""|environ\[["']AEGAEON_\w+["']\](?!\s*=)""")


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("AEGAEON_ISA", "avx9", "one of avx2, avx512, amx, neon"),
    ("AEGAEON_LOG_LEVEL", "verbose", "one of debug, info, warning, error, critical"),
    ("AEGAEON_LOG_JSON", "2", "one of 1, true, yes, on, 0, false, no, off"),
    ("AEGAEON_NATIVE", "none", "one of 1, true"),
    ("AEGAEON_PROFILE_CACHE", "later", "one of 1, true"),
    ("AEGAEON_ADVERTISE_HOST", "tcp://node-1", "a host name or IP address"),
])  # fmt: skip
def test_a_bad_value_names_the_variable_and_what_it_takes(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, allowed: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvError) as caught:
        read_env()
    assert str(caught.value).startswith(f"{name}={value!r}: {allowed}")
    assert caught.value.name == name


def test_good_values_and_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AEGAEON_ISA", "AEGAEON_LOG_LEVEL", "AEGAEON_LOG_JSON", "AEGAEON_NATIVE",
                 "AEGAEON_CLIENTS_DIR", "AEGAEON_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    env = read_env()
    assert (env.isa, env.log_level, env.log_json, env.native_kernels) == (
        None, "info", None, True)
    assert env.clients_dir is None and env.api_key is None
    monkeypatch.setenv("AEGAEON_ISA", " AVX2 ")
    monkeypatch.setenv("AEGAEON_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("AEGAEON_LOG_JSON", "Off")
    monkeypatch.setenv("AEGAEON_NATIVE", "0")
    monkeypatch.setenv("AEGAEON_CLIENTS_DIR", str(tmp_path))
    env = read_env()
    assert (env.isa, env.log_level, env.log_json, env.native_kernels) == (
        "avx2", "warning", False, False)
    assert env.clients_dir == tmp_path
    monkeypatch.setenv("AEGAEON_ISA", "")  # empty: unset
    assert read_env().isa is None


def test_isa_names_are_the_engines_levels() -> None:
    assert tuple(level.name for level in LEVELS) == ISA_LEVELS


def test_the_environment_is_read_in_one_module() -> None:
    """STYLE's rule, checked: no product module but aegaeon_common.env reads AEGAEON_*."""
    readers = []
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            if path.name == "env.py" and path.parent.name == "aegaeon_common":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if READ.search(line):
                    readers.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not readers, "\n".join(readers)
