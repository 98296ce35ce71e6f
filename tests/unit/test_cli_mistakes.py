"""Issue 48: every command-line, config and environment mistake is one line, exit code 2.

A table of the mistakes people make, across every entry point (``aegaeon serve``,
``node``, ``proxy``, ``plan``, ``market``, ``bench``, ``sim``, each service's own
command, ``scripts/*``): each answers with exactly one line on stderr naming what
is wrong, exit code 2, no traceback, and nothing started -- no process left, no
shared memory, no service log in the run directory. Rows run in this process
(``aegaeon_cli.main.main``) where that is how the check is reached; the rows the
issue filed, and the scripts, run as a user runs them (a process of its own,
in a session of its own, so anything it started would be found).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from aegaeon_cli.main import main
from aegaeon_runtime.preflight import no_driver

REPO = Path(__file__).resolve().parents[2]
# the issue's row: `cuda` where no CUDA device is visible; on a GPU machine, one past them
CUDA = "cuda" if no_driver() is not None else "cuda:99"
SERVE_CONFIG = "market: {market}\nrun_dir: {dir}/run\n"
SERVE = ("serve", "--market", "{market}", "--run-dir", "{dir}/run")  # a market, a run dir


@dataclass(frozen=True)
class Mistake:
    """One row: the command line (``{dir}``: the row's folder, ``{market}``: a market),
    what the one line must say (a regex), the environment it adds and the files it
    writes into ``{dir}`` first. ``own_process``: run as a user does, in a process."""

    name: str
    argv: tuple[str, ...]
    says: str
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    own_process: bool = False


def _serve(config: str, *, says: str, name: str, own_process: bool = False) -> Mistake:
    """``aegaeon serve --config {dir}/c.yaml``: ``config`` after the market and run dir."""
    return Mistake(name, ("serve", "--config", "{dir}/c.yaml"), says,
                   files={"c.yaml": SERVE_CONFIG + config}, own_process=own_process)


ISSUE_ROWS = [
    Mistake("serve-config-missing", ("serve", "--config", "{dir}/missing.yaml"),
            r"^aegaeon serve: .*missing\.yaml: <file>: no such file$", own_process=True),
    Mistake("serve-config-is-a-list", ("serve", "--config", "{dir}/list.yaml"),
            r"list\.yaml: <top>: must be a mapping .* not a YAML list$",
            files={"list.yaml": "- a\n"}, own_process=True),
    Mistake("serve-config-yaml-syntax", ("serve", "--config", "{dir}/bad.yaml"),
            r"bad\.yaml: line 2, column 1: not valid YAML: expected ',' or '\}'.*"
            r"flow mapping at line 1, column 8\)$",
            files={"bad.yaml": "proxy: {port: 8171\n"}, own_process=True),
    Mistake("serve-isa-bogus", SERVE,
            r"^aegaeon: AEGAEON_ISA='bogus': one of avx2, avx512, amx, neon$",
            env={"AEGAEON_ISA": "bogus"}, own_process=True),
    _serve(f"prefill: {{device: '{CUDA}'}}\n", name="serve-cuda-without-gpu",
           says=r"c\.yaml: prefill\.device: prefill-0 is on 'cuda(:99)?' but (no CUDA device is "
                r"visible|\d+ CUDA device\(s\) are visible)", own_process=True),
]

ROWS = [
    # the command line
    Mistake("unknown-command", ("serve-all",), r"^aegaeon: error: argument COMMAND: invalid "
            r"choice: 'serve-all'"),
    Mistake("serve-port-not-a-number", ("serve", "--port", "80o0"),
            r"^aegaeon serve: error: argument --port: expected a port number, got '80o0'"),
    Mistake("serve-port-out-of-range", ("serve", "--port", "99999"),
            r"argument --port: a port is 0\.\.65535, got 99999"),
    Mistake("serve-nodes-zero", ("serve", "--nodes", "0"), r"argument --nodes: must be at least 1"),
    Mistake("serve-proxies-without-nodes", ("serve", "--proxies", "3"),
            r"^aegaeon serve: --proxies goes with --nodes N"),
    Mistake("serve-gpus-with-nodes", ("serve", "--gpus", "all", "--nodes", "2"),
            r"^aegaeon serve: --gpus places one node's instances"),
    Mistake("serve-gpus-bad-spec", (*SERVE, "--gpus", "first"), r"^aegaeon serve: --gpus"),
    Mistake("serve-policy-unknown", (*SERVE, "--policy", "fastest"),
            r"scheduler\.policy: .*\(one of aegaeon, request-level"),
    Mistake("serve-api-key-file-missing", (*SERVE, "--api-key-file", "{dir}/keys"),
            r"keys: <file>: cannot read"),
    Mistake("serve-run-dir-is-a-file", ("serve", "--market", "{market}", "--run-dir",
                                        "{dir}/c.yaml"), r"^aegaeon serve: run directory .*c\.yaml",
            files={"c.yaml": ""}),
    Mistake("serve-config-is-a-directory", ("serve", "--config", "{dir}"),
            r": <file>: a directory, not a YAML file$"),
    # the config's sections
    _serve("schedular: {policy: aegaeon}\n", name="config-unknown-key",
           says=r"c\.yaml: schedular: unknown key \(known: "),
    _serve("proxy: {port: -1}\n", name="config-proxy-port",
           says=r"proxy\.port: Expected `int` >= 0"),
    _serve("proxy: {api_keys: [short]}\n", name="config-api-key-short",
           says=r"proxy\.api_keys\[0\]: a key has at least 8 characters"),
    _serve("decode: {device_memory: 512MiB, kv_memory: 1GiB}\n", name="config-kv-too-big",
           says=r"decode\.kv_memory: must be smaller than device_memory"),
    _serve("prefill: {device: gpu}\n", name="config-device-name",
           says=r"prefill\.device: 'gpu' is not a device \(cpu, cuda or cuda:N\)"),
    _serve("decode: {devices: [cpu, tpu0]}\n", name="config-devices-name",
           says=r"decode\.devices: 'tpu0' is not a device"),
    _serve(f"decode: {{instances: 2, devices: [cpu, '{CUDA}']}}\n", name="config-devices-cuda",
           says=r"decode\.devices: decode-1 is on 'cuda(:99)?'"),
    _serve("prefill: {device_memory: lots}\n", name="config-size-unit",
           says=r"prefill\.device_memory: 'lots' is not a size"),
    _serve("drain_timeout: -3\n", name="config-drain-timeout",
           says=r"drain_timeout: must be a number of seconds >= 0"),
    _serve("dtype: float8\n", name="config-dtype", says=r"dtype: 'float8' is not one of"),
    _serve("roles: {low_util: 0.9, high_util: 0.5}\n", name="config-roles",
           says=r"roles\.low_util: need 0 < low_util < high_util"),
    _serve("addresses: {proxy: 'tcp://10.1.2.3:5555'}\n", name="config-address-leaves-host",
           says=r"addresses\.proxy: .* leaves this host: set security\.curve_key_file"),
    _serve("security: {curve_key_file: nokey}\n", name="config-curve-key-missing",
           says=r"security\.curve_key_file: .*nokey is not a file"),
    _serve("model_settings: {nope: {pin: true}}\n", name="config-settings-unknown-model",
           says=r"model_settings\.nope: unknown model 'nope'"),
    _serve("scheduler: {token_hold: 3}\n", name="config-token-hold",
           says=r"scheduler\.token_hold: Expected `float` <= 1"),
    _serve("slo_classes: {gold: {ttft: 1}}\n", name="config-slo-class",
           says=r"slo_classes\.gold: unknown field"),
    _serve("store: {kind: redis, url: 'http://cache:6379'}\n", name="config-store-url",
           says=r"store\.url: 'http': a redis://, rediss:// or unix:// URL"),
    # the environment
    Mistake("env-profile-cache", SERVE,
            r"^aegaeon: AEGAEON_PROFILE_CACHE='never': one of 1, true, yes, on, 0, false, no, "
            r"off$", env={"AEGAEON_PROFILE_CACHE": "never"}),
    Mistake("env-log-level", ("market", "list", "--market", "{market}"),
            r"^aegaeon: AEGAEON_LOG_LEVEL='loud': one of debug, info, warning, error, critical$",
            env={"AEGAEON_LOG_LEVEL": "loud"}),
    Mistake("env-native-flag", ("sim", "--theorem"), r"AEGAEON_NATIVE='maybe': one of 1, true",
            env={"AEGAEON_NATIVE": "maybe"}),
    Mistake("env-log-json", ("proxy", "--config", "{dir}/c.yaml"),
            r"AEGAEON_LOG_JSON='yes please': one of", env={"AEGAEON_LOG_JSON": "yes please"}),
    Mistake("env-advertise-host", ("cachemgr", "--config", "{dir}/c.yaml"),
            r"AEGAEON_ADVERTISE_HOST='http://node-1/': a host name or IP address",
            env={"AEGAEON_ADVERTISE_HOST": "http://node-1/"}),
    Mistake("env-isa-this-cpu-lacks", SERVE,
            r"^aegaeon serve: AEGAEON_ISA='(neon|avx2)': this CPU \(.*\) supports ",
            env={"AEGAEON_ISA": "neon" if os.uname().machine == "x86_64" else "avx2"}),
    # each service's own command
    Mistake("node-without-store", ("node", "--config", "{dir}/c.yaml"),
            r"^aegaeon node: .*c\.yaml: store\.kind: a node of many needs the shared store",
            files={"c.yaml": SERVE_CONFIG}),
    Mistake("node-config-missing", ("node", "--config", "{dir}/none.yaml"),
            r"^aegaeon node: .*none\.yaml: <file>: no such file$"),
    Mistake("proxy-api-key-short", ("proxy", "--config", "{dir}/c.yaml", "--api-key", "abc"),
            r"^aegaeon proxy: --api-key/--admin-key: proxy\.api_keys\[0\]: a key has at least 8",
            files={"c.yaml": SERVE_CONFIG}),
    Mistake("prefill-index-past-the-config", ("prefill", "--config", "{dir}/c.yaml",
                                              "--index", "4"),
            r"^aegaeon prefill: .*c\.yaml: prefill\.instances: --index 4: the config has 1 "
            r"prefill instance", files={"c.yaml": SERVE_CONFIG}),
    Mistake("decode-on-missing-cuda", ("decode", "--config", "{dir}/c.yaml"),
            r"^aegaeon decode: .*c\.yaml: decode\.device: decode-0 is on 'cuda",
            files={"c.yaml": SERVE_CONFIG + f"decode: {{device: '{CUDA}'}}\n"}),
    Mistake("cachemgr-config-a-list", ("cachemgr", "--config", "{dir}/c.yaml"),
            r"^aegaeon cachemgr: .*c\.yaml: <top>: must be a mapping",
            files={"c.yaml": "- cachemgr\n"}),
    Mistake("plan-only-unknown", ("plan", "--gpus", "all", "--only", "router"),
            r"argument --only: invalid choice: 'router'"),
    Mistake("plan-config-yaml", ("plan", "--only", "cachemgr", "--config", "{dir}/c.yaml"),
            r"^aegaeon plan: .*c\.yaml: line 3, column 2: not valid YAML: expected <block end>, "
            r"but found '<block mapping start>' \(while parsing a block mapping at line 1, "
            r"column 1\)$",
            files={"c.yaml": "cachemgr:\n  slab: 4MiB\n bad: 2\n"}),
    Mistake("keys-without-file", ("keys", "curve"),
            r"the following arguments are required: file"),
    # market, bench, sim
    Mistake("market-create-no-models", ("market", "create", "--models", "0"),
            r"^aegaeon market create: error: argument --models: must be at least 1"),
    Mistake("market-gc-bad-age", ("market", "gc", "--stale-after", "soon"),
            r"argument --stale-after: expected a duration like 90s"),
    Mistake("market-add-unknown-preset", ("market", "add", "--market", "{dir}/m", "--random",
                                          "llama-9", "--name", "x"),
            r"^aegaeon market add: error: --random 'llama-9': unknown preset"),
    Mistake("bench-engine-unknown-model", ("bench", "engine", "--market", "{market}",
                                           "--model", "nope"),
            r"^aegaeon bench engine: error: .*no model named 'nope'"),
    Mistake("bench-chaos-config-missing", ("bench", "chaos", "--market", "{market}", "--config",
                                           "{dir}/none.yaml"),
            r"^aegaeon bench chaos: .*none\.yaml: <file>: no such file$"),
    Mistake("bench-chaos-store-fault-on-one-node", ("bench", "chaos", "--market", "{market}",
                                                    "--faults", "store-kill"),
            r"^aegaeon bench chaos: fault store-kill is a fault of many nodes"),
    Mistake("bench-chaos-no-node", ("bench", "chaos", "--market", "{market}", "--nodes", "0"),
            r"^aegaeon bench chaos: --nodes 0 --proxies 1: at least one node and one proxy$"),
    Mistake("bench-sweep-config-a-list", ("bench", "sweep", "--market", "{market}", "--config",
                                          "{dir}/c.yaml", "--out", "{dir}/out"),
            r"^aegaeon bench sweep: .*c\.yaml: <top>: must be a mapping",
            files={"c.yaml": "- 1\n"}),
    Mistake("bench-overload-cuda", ("bench", "overload", "--market", "{market}", "--rps", "1",
                                    "--config", "{dir}/c.yaml"),
            r"^aegaeon bench overload: .*c\.yaml: decode\.device: decode-0 is on 'cuda",
            files={"c.yaml": f"decode: {{device: '{CUDA}'}}\n"}),
    Mistake("sim-policy-unknown", ("sim", "--policy", "fastest"),
            r"^aegaeon sim: error: argument --policy: invalid choice: 'fastest'"),
    Mistake("sim-rps-negative", ("sim", "--policy", "aegaeon", "--rps", "-1"),
            r"argument --rps: must be > 0"),
    Mistake("sim-figure-policies", ("sim", "--figure", "11a", "--policies", "aegaeon,vllm"),
            r"argument --policies: unknown policy 'vllm'"),
    # the scripts
    Mistake("script-gpu-check-flag", ("scripts/gpu-check", "--dry-rum"),
            r"^scripts/gpu-check: error: unrecognized arguments: --dry-rum", own_process=True),
    Mistake("script-images-step", ("scripts/images", "cpu", "gpus"),
            r"^scripts/images: unknown step 'gpus'", own_process=True),
    Mistake("script-serve-port", ("scripts/serve", "--port", "http"),
            r"^aegaeon serve: error: argument --port", own_process=True),
    Mistake("script-prometheus-port", ("-m", "aegaeon_bench.serve.prometheus", "--port", "x"),
            r"^scripts/prometheus: error: argument --port", own_process=True),
]


def _fill(text: str, folder: Path, market: Path) -> str:
    return text.replace("{dir}", str(folder)).replace("{market}", str(market))


def _shm_of(run_dir: Path) -> list[str]:
    """Segments of a node whose run directory is ``run_dir`` (``Config.shm_prefix``)."""
    run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"aegaeon-{run_id}")]


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not started, f"processes left: {started}"
    return code, capsys.readouterr().err


def _own_process(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    if argv[0].startswith("scripts/"):
        command = [str(REPO / argv[0]), *argv[1:]]
    elif argv[0] == "-m":
        command = [sys.executable, *argv]
    else:
        command = [sys.executable, "-m", "aegaeon_cli.main", *argv]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != proc.pid and os.getsid(p.pid) == proc.pid:
                left.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    assert not left, f"processes of its session left: {left}"
    return proc.returncode, err


@pytest.mark.parametrize("row", ISSUE_ROWS + ROWS, ids=lambda r: r.name)
def test_a_mistake_is_one_line_and_starts_nothing(
    row: Mistake, small_market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, text in row.files.items():
        (tmp_path / name).write_text(_fill(text, tmp_path, small_market))
    argv = [_fill(a, tmp_path, small_market) for a in row.argv]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no sweep of a real cache
    if row.own_process:
        code, err = _own_process(argv, {"XDG_CACHE_HOME": str(tmp_path / "cache"), **row.env})
    else:
        for key, value in row.env.items():
            monkeypatch.setenv(key, value)
        code, err = _in_process(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert re.search(row.says, lines[0]), lines[0]
    run_dir = tmp_path / "run"
    assert not _shm_of(run_dir)
    assert not list(run_dir.glob("*.log")) and not list(run_dir.glob("*.sock"))


def test_the_table_covers_every_entry_point() -> None:
    """The issue asks for its rows and at least 20 more, from every entry point."""
    assert len(ROWS) >= 20
    first = {r.argv[0] if r.argv[0] != "-m" else "scripts/prometheus" for r in ISSUE_ROWS + ROWS}
    assert {"serve", "node", "proxy", "plan", "market", "bench", "sim", "prefill", "decode",
            "cachemgr", "scripts/gpu-check", "scripts/images", "scripts/serve"} <= first
