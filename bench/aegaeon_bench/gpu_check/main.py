"""``scripts/gpu-check``: the GPU path in one run, for a machine with one NVIDIA GPU.

Three modes:

- ``--prepare`` (here, with the package registry): fetch the wheels the GPU
  machine lacks into ``.whl/`` and print the exact device-tool invocation
  (``gpu_check.prepare``).
- no flag (on the GPU machine, no network, its ``python3`` with torch CUDA):
  install the carried wheels, then, each step with its own timeout and all
  within ``--budget-s``: the GPU and its copy limits (``gpu_probe``), a
  market, the ``gpu``-marked tests, the containers' boundaries without Docker
  (``namespaces``: cachemgr, prefill, decode and proxy in PID and mount
  namespaces of their own, the cachemgr without a GPU, KV hand-offs with CUDA
  events in flight; freed blocks and refused frees counted), the
  tensor-parallel tests over NCCL
  (only where it finds more than one device), ``aegaeon bench engine`` and ``aegaeon
  bench switch`` on CUDA, and ``aegaeon serve`` (one prefill + one decode
  instance sharing the GPU, four models) under ``aegaeon bench serve``
  (``gpu_check.serve``); last, a check that nothing was left running.
- ``--dry-run`` (any CPU, CI): the same sequence on the CPU in seconds,
  offline, proving the plumbing.

``--scenario paper`` runs the paper's comparison instead of the steps above
(``gpu_check.paper``: eight 7-8B models generated in memory, every policy
interleaved rate by rate at rates the simulator predicts from one capacity
probe; ``--device cpu`` its CPU-scale version, ``--dry-run`` too), with its
``paper`` section in the same JSON.

``--scenario engine`` measures the decode step on the GPU (``gpu_check.engine``:
llama-3.1-8b bf16 and FP8, llama-3.2-3b, eager and on CUDA graphs, against the
HBM roofline and transformers on the same GPU; then the FP8 switch through the
Model Cache), within ``ENGINE_BUDGET_S``, with its ``engine`` section in the
JSON; ``--dry-run`` runs the same plan on tiny models on the CPU.

A failed or timed-out step is recorded (status, duration, the tail of its
stderr) and the next one still runs. Results: ``gpu-check.json`` (one object:
the machine, each step's status, duration and parsed results, the
highlights) and ``gpu-check-logs.tar.gz`` in ``--out`` (default ``$OUT``,
else ``runs/gpu-check-<time>``). Exit status 0 when every step is ok.

Standard library only at the top: the wheels are installed by this module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.paper import POLICIES as PAPER_POLICIES
from aegaeon_bench.gpu_check.prepare import applies, requirement_name
from aegaeon_bench.gpu_check.run import (
    Runner,
    StepResult,
    last_json_line,
    market_models,
    pack_logs,
    processes_mentioning,
    shm_segments,
)
from aegaeon_bench.gpu_check.serve import ServePlan, run_serve_step, start_mps, stop_mps

ROOT = Path(__file__).resolve().parents[3]
WHEELS = ROOT / ".whl"
FORMAT_VERSION = 1
BUDGET_S = 450.0  # the device run has ~8 minutes of command time: this leaves the margin
# a dry run takes ~110 s on an idle 2-core CPU (the namespaces step ~45 of them) and
# ~200 s beside the rest of the test suite; its caps stop a hang, not a slow step
DRY_BUDGET_S = 330.0
DRY_STEP_S = 120.0
SERVE_LOAD_S = 120.0
TP_TESTS = "tests/unit/test_engine_tp.py"  # the tensor_parallel step's (NCCL where >1 device)
NAMESPACE_TESTS = "tests/integration/test_container_namespaces.py"  # the namespaces step's
SERVE_OVERHEAD_S = 90.0  # startup, grace and stop around the load, on a GPU machine
# --scenario engine: one command of at most 5 minutes on one H100 (its dry run: a cap that
# stops a hang; the plan itself takes well under a minute on an idle CPU)
ENGINE_BUDGET_S = 290.0
ENGINE_DRY_BUDGET_S = 150.0
ENGINE_STEP_S = 220.0  # the measurement, transformers included; the FP8 switch after it


def package_dirs(root: Path = ROOT) -> list[Path]:
    """The source folders of the project's packages (pyproject's ``packages.find.where``)."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    where = data["tool"]["setuptools"]["packages"]["find"]["where"]
    return [root / w for w in where]


def step_env(work: Path, site: Path | None, device: str) -> dict[str, str]:
    """The steps' environment: the sources (and installed wheels) on the path, offline."""
    paths = ([str(site)] if site else []) + [str(p) for p in package_dirs()]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmp),  # every temporary run dir below ours: the leak check sees it
        "AEGAEON_NATIVE": "0",  # CPU kernels: no 20 s build for engines that run on CUDA
        "AEGAEON_LOG_JSON": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
        "AEGAEON_GPU_CHECK_DEVICE": device,
    })  # fmt: skip
    return env


IMPORT_NAMES = {"pyzmq": "zmq", "pyyaml": "yaml", "prometheus-client": "prometheus_client"}


def runtime_modules(root: Path = ROOT) -> list[str]:
    """The import names of pyproject's dependencies (for this platform)."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    names = [requirement_name(d) for d in data["project"]["dependencies"] if applies(d)]
    return [IMPORT_NAMES.get(name, name.replace("-", "_")) for name in names]


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test modules that mark tests ``gpu`` (relative paths)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def cuda_device_count(env: Mapping[str, str]) -> int:
    """CUDA devices torch sees under the steps' environment (0 when it cannot tell)."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        proc = subprocess.run(_py("-c", code), env=env, capture_output=True, text=True,
                              timeout=60, check=False)
        return int(proc.stdout.split()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return 0


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failures of a pytest JUnit XML report."""
    tree = ET.parse(path)
    suite = tree.getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    assert suite is not None
    cases: dict[str, list[str]] = {"passed": [], "skipped": [], "failed": []}
    failures = []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        bad = next((c for c in case if c.tag in ("failure", "error")), None)
        if bad is not None:
            cases["failed"].append(name)
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            failures.append({"test": name, "message": text.strip()[-1500:]})
        elif case.find("skipped") is not None:
            cases["skipped"].append(name)
        else:
            cases["passed"].append(name)
    return {"tests": sum(len(v) for v in cases.values()), "passed": len(cases["passed"]),
            "skipped": len(cases["skipped"]), "failed": len(cases["failed"]),
            "passed_tests": cases["passed"], "skipped_tests": cases["skipped"][:40],
            "failures": failures}  # fmt: skip


def _json_results(out: Path, _err: Path) -> Any:
    return last_json_line(out)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aegaeon_cli.main", *args]


class Check:
    """One run of the sequence (module docstring)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.dry = bool(args.dry_run)
        self.device = "cpu" if self.dry else args.device
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        budget = args.budget_s or default_budget_s(args.scenario, self.dry, self.device)
        self.started = time.time()
        self.runner = Runner(self.logs, time.monotonic() + budget, {}, ROOT, say=self.say)
        self.market = Path(args.market).resolve() if args.market else work / "market"
        self.site: Path | None = None
        self.sections: dict[str, Any] = {}  # a scenario's own part of the JSON

    def say(self, message: str) -> None:
        print(message, flush=True)

    # ---- steps -----------------------------------------------------------------------
    def install(self) -> None:
        wheels = sorted(WHEELS.glob("*.whl"))
        if self.dry and not self.args.install_wheels:
            self.runner.skip("install", "dry run: the project's own environment is used")
            return
        if not wheels:
            self.runner.skip("install", f"no wheels in {WHEELS} (run scripts/gpu-check "
                             "--prepare, and carry .whl)")
            return
        site = self.work / "site"
        argv = _py("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site),
                   *map(str, wheels))
        result = self.runner.command("install", argv, 120,
                                     parse=lambda _o, _e: [w.name for w in wheels])
        if result.status == "ok":
            self.site = site

    def imports(self) -> None:
        """Every runtime dependency importable, with its version (else the error)."""
        code = ("import importlib, json, sys\n"
                "mods = sys.argv[1:]\nout = {}\n"
                "for m in mods:\n"
                "    try:\n"
                "        mod = importlib.import_module(m)\n"
                "        out[m] = str(getattr(mod, '__version__', getattr(mod, 'VERSION', 'ok')))\n"
                "    except Exception as exc:\n"
                "        out[m] = 'MISSING: ' + type(exc).__name__ + ': ' + str(exc)\n"
                "print(json.dumps(out))\n"
                "sys.exit(1 if any(v.startswith('MISSING') for v in out.values()) else 0)\n")
        mods = [*runtime_modules(), "transformers", "pytest", "pytest_timeout", "hypothesis",
                "aegaeon_cli.main", "aegaeon_runtime.worker", "aegaeon_proxy.app"]
        self.runner.command("imports", _py("-c", code, *mods), 60, parse=_json_results)

    def probe(self) -> None:
        argv = _py("-m", "aegaeon_bench.gpu_check.probe", "--device", self.device, "--json",
                   *(("--mib", "16", "--repeats", "2") if self.dry else ()))
        self.runner.command("probe", argv, 30 if self.dry else 60, reserve_s=self.reserve(),
                            parse=_json_results)

    def make_market(self, size: str | None = None) -> bool:
        """The market (``ensure_market``: one already there and current is kept as it is);
        ``size``: ``ensure_market``'s arguments (default: the check's)."""
        size = size or ("num_models=4, profile='small'" if self.dry else "num_models=8")
        code = ("import sys\nfrom aegaeon_market import ensure_market\n"
                f"ensure_market(sys.argv[1], {size}, progress=False)\n")
        argv = _py("-c", code, str(self.market))
        result = self.runner.command(
            "market", argv, DRY_STEP_S if self.dry else 120, reserve_s=self.reserve(),
            parse=lambda _o, _e: market_models(self.market))
        return result.status == "ok"

    def gpu_tests(self) -> None:
        files = [f for f in gpu_test_files() if f != TP_TESTS]  # its own step
        xml = self.logs / "gpu-tests.xml"
        argv = _py("-m", "pytest", "-q", "-m", "gpu", "-o", f"cache_dir={self.work / 'pytest'}",
                   "--timeout", "45", "-rfE", "--durations=8", f"--junitxml={xml}",
                   "-W", "ignore::DeprecationWarning", *files)
        result = self.runner.command("gpu_tests", argv, DRY_STEP_S if self.dry else 110,
                                     reserve_s=self.reserve(),
                                     parse=lambda _o, _e: parse_junit(xml) if xml.is_file()
                                     else None)
        result.results = {"files": files, **(result.results or {})}

    def namespaces(self) -> None:
        """The containers' boundaries without Docker (``NAMESPACE_TESTS``) on this device:
        on a GPU the workers' KV copies are CUDA copies whose events reach the GPU-less
        cachemgr as host mirrors; its counts (blocks freed at once and after an event,
        refused frees) are the step's results. Skipped where it cannot make namespaces
        (not root, no ``unshare``). The dry run serves its own small market there (built
        by then) instead of the test building one in the step's fresh pytest cache."""
        xml = self.logs / "namespaces.xml"
        report = self.logs / "namespaces.json"
        argv = _py("-m", "pytest", "-q", "-o", f"cache_dir={self.work / 'pytest'}",
                   "--timeout", "300", "-rfEs", f"--junitxml={xml}",
                   "-W", "ignore::DeprecationWarning", NAMESPACE_TESTS)

        def parse(_out: Path, _err: Path) -> Any:
            tests = parse_junit(xml) if xml.is_file() else {}
            counts = json.loads(report.read_text()) if report.is_file() else None
            return {**tests, "counts": counts}

        env = {**self.runner.env, "AEGAEON_NAMESPACE_REPORT": str(report)}
        if self.dry:
            env["AEGAEON_NAMESPACE_MARKET"] = str(self.market)
        result = self.runner.command("namespaces", argv, DRY_STEP_S if self.dry else 180,
                                     reserve_s=self.reserve(), parse=parse, env=env)
        if result.status == "ok" and not (result.results or {}).get("counts"):
            result.status, result.error = "skipped", "the test skipped (root and unshare needed)"

    def tensor_parallel(self) -> None:
        """``tests/unit/test_engine_tp.py``'s NCCL tests (TP=2 on cuda:0 and cuda:1 against
        one engine) where the machine has more than one CUDA device; skipped with one
        (CI runs the same tests over gloo on the CPU)."""
        name = "tensor_parallel"
        if self.dry:
            self.runner.skip(name, "dry run: CI runs the same tests over gloo")
            return
        count = cuda_device_count(self.runner.env)
        if count < 2:
            self.runner.skip(name, f"{count} CUDA device{'s' * (count != 1)}: TP=2 needs 2")
            return
        xml = self.logs / "tensor-parallel.xml"
        argv = _py("-m", "pytest", "-q", "-m", "gpu", "-o", f"cache_dir={self.work / 'pytest'}",
                   "--timeout", "150", "-rfE", f"--junitxml={xml}",
                   "-W", "ignore::DeprecationWarning", TP_TESTS)
        self.runner.command(name, argv, 180, reserve_s=self.reserve(),
                            parse=lambda _o, _e: parse_junit(xml) if xml.is_file() else None)

    def bench_engine(self) -> None:
        size = (("--repeats", "1", "--prompt-len", "16", "--new-tokens", "4",
                 "--no-transformers") if self.dry else ("--repeats", "3"))
        argv = _cli("bench", "engine", "--device", self.device, "--market", str(self.market),
                    "--no-vllm", "--json", *size)
        self.runner.command("bench_engine", argv, DRY_STEP_S if self.dry else 80,
                            reserve_s=self.reserve(), parse=_json_results)

    def bench_switch(self) -> None:
        from aegaeon_bench.gpu_check.fp8 import switch_argv

        models = sorted(market_models(self.market), key=lambda e: int(e["params"]))
        # a dry run's two smallest; else the four largest: bytes, not latency
        names = [e["name"] for e in (models[:2] if self.dry else models[-4:])]
        argv = switch_argv(sys.executable, self.market, self.device, *names, dry=self.dry)
        self.runner.command("bench_switch", argv, DRY_STEP_S if self.dry else 90,
                            reserve_s=self.reserve(), parse=_json_results)

    def fp8_switch(self) -> None:
        """``llama-3.1-8b`` written in FP8 on the machine into a market of its own beside a
        copy of the check market's smallest model, then ``bench switch`` between the two
        (``gpu_check.fp8``): wake-to-first-token against the 0.2 s target, bytes moved
        against bf16's."""
        from aegaeon_bench.gpu_check.fp8 import build_argv, smallest_model, summarize, switch_argv

        market = self.work / "fp8-market"
        small = self.market / smallest_model(market_models(self.market))
        built = self.runner.command("fp8_model", build_argv(sys.executable, market, small,
                                                            self.dry),
                                    DRY_STEP_S if self.dry else 150, reserve_s=self.reserve(),
                                    parse=_json_results)
        if built.status != "ok" or not built.results:
            self.runner.skip("fp8_switch", "the FP8 model was not written")
            return
        argv = switch_argv(sys.executable, market, self.device, str(built.results["model"]),
                           str(built.results["small_model"]), dry=self.dry)
        self.runner.command("fp8_switch", argv, DRY_STEP_S if self.dry else 150,
                            reserve_s=self.reserve(),
                            parse=lambda out, _e: summarize(built.results, last_json_line(out)))

    def serve(self, name: str = "serve") -> None:
        left = self.runner.left_s() - 5
        if self.dry:  # the seed's four requests (as at 0.5 RPS over 4 s) arriving in 2 s,
            # their lengths x0.1 of ShareGPT's (a GPU's x0.25: tokens a CPU decodes slowly)
            plan = ServePlan("cpu", load_s=2.0, grace_s=10.0, startup_s=60.0, rps=1.0,
                             scale=0.1, profile_s=self.args.profile_s)
        else:
            load = max(min(self.args.serve_load_s, left - SERVE_OVERHEAD_S), 20.0)
            device = self.device if ":" in self.device else f"{self.device}:0"
            plan = ServePlan(device, load_s=load, grace_s=15.0, startup_s=90.0,
                             profile_s=self.args.profile_s)
        if left < plan.load_s + 20:
            self.runner.skip(name, f"{left:.0f} s left")
            return
        run_serve_step(self.runner, self.market, self.work, plan, name)

    def serve_mps(self) -> None:
        """The serving step again with both instances as clients of one CUDA MPS server:
        without it two processes' kernels time-slice the GPU instead of sharing it."""
        if self.dry or shutil.which("nvidia-cuda-mps-control") is None:
            self.runner.skip("serve_mps", "dry run" if self.dry else "no nvidia-cuda-mps-control")
            return
        env, why = start_mps(self.runner.env, self.work)
        if env is None:
            self.runner.skip("serve_mps", why)
            return
        saved, self.runner.env = self.runner.env, env
        try:
            self.serve("serve_mps")
        finally:
            self.runner.env = saved
            stop_mps(env, self.work, self.logs)

    def engine(self) -> None:
        """``--scenario engine`` (module docstring): the decode step's measurement, then the
        FP8 switch through the Model Cache (GPU only: the dry run leaves it to the default
        scenario's dry run)."""
        cap = DRY_STEP_S if self.dry else ENGINE_STEP_S
        argv = _py("-m", "aegaeon_bench.gpu_check.engine", "--device", self.device, "--json",
                   "--budget-s", str(round(self.runner.budget(cap) * 0.8)),
                   *(("--tiny",) if self.dry else ()))
        result = self.runner.command("engine_bench", argv, cap, parse=_json_results)
        section: dict[str, Any] = dict(result.results or {})
        if self.dry:
            self.runner.skip("fp8_switch", "dry run: the default scenario's dry run runs it")
        elif self.make_market("num_models=2, profile='small'"):
            self.fp8_switch()
            fp8 = next((r for r in self.runner.results if r.name == "fp8_switch"), None)
            section["fp8_switch"] = fp8.results if fp8 is not None else None
        self.sections["engine"] = section

    def reserve(self) -> float:
        """Seconds kept for the serving step while earlier steps run (none: the engine
        scenario serves nothing)."""
        if self.args.scenario == "engine":
            return 0.0
        return 30.0 if self.dry else self.args.serve_load_s + 80.0

    def leaks(self, shm_before: set[str]) -> None:
        def check(result: StepResult) -> None:
            left = processes_mentioning(str(self.work))
            new_shm = sorted(shm_segments() - shm_before)
            result.results = {"processes": left, "new_shm_segments": new_shm}
            if left:
                result.status, result.error = "failed", f"{len(left)} processes left running"

        self.runner.call("leaks", check)

    def run(self) -> list[StepResult]:
        shm_before = shm_segments()
        self.install()
        self.runner.env = step_env(self.work, self.site, self.device)
        if self.args.scenario == "paper":
            from aegaeon_bench.gpu_check.paper import run_paper

            self.sections["paper"] = run_paper(self.runner, self.work, self.market, self.dry,
                                               self.device,
                                               tuple(self.args.paper_policies.split(",")),
                                               self.args.paper_load_s)
            self.leaks(shm_before)
            return self.runner.results
        if self.args.scenario == "engine":
            self.probe()
            self.engine()
            self.leaks(shm_before)
            return self.runner.results
        self.imports()
        self.probe()
        steps = {"gpu_tests": self.gpu_tests, "namespaces": self.namespaces,
                 "tensor_parallel": self.tensor_parallel,
                 "bench_engine": self.bench_engine,
                 "bench_switch": self.bench_switch, "fp8_switch": self.fp8_switch,
                 "serve": self.serve,
                 "serve_mps": self.serve_mps}  # fmt: skip
        chosen = self.args.steps.split(",") if self.args.steps else [
            name for name in steps if name != "serve_mps" or self.args.mps]
        unknown = sorted(set(chosen) - set(steps))
        if unknown:
            raise SystemExit(f"gpu-check: unknown steps {unknown}; known: {sorted(steps)}")
        if self.make_market():
            for name in chosen:
                steps[name]()
        else:
            for name in chosen:
                self.runner.skip(name, "no market")
        self.leaks(shm_before)
        return self.runner.results


def machine(results: list[StepResult]) -> dict[str, Any]:
    """The GPU, driver and torch (from the probe, else the imports step or the paper
    scenario's models step)."""
    probe = next((r.results for r in results if r.name == "probe"), None) or {}
    imports = next((r.results for r in results if r.name == "imports"), None) or {}
    models = next((r.results for r in results if r.name == "paper_models"), None) or {}
    probe = probe or {**(models.get("machine") or {}), "torch": models.get("torch"),
                      "torch_cuda": models.get("torch_cuda")}
    smi = probe.get("nvidia_smi") or {}
    gpu = probe.get("gpu") or models.get("gpu") or {}
    return {
        "gpu": gpu.get("name") or smi.get("name"), "driver": smi.get("driver_version"),
        "gpu_memory_bytes": gpu.get("memory_bytes") or gpu.get("total_bytes"),
        "capability": gpu.get("capability"),
        "pcie": (f"gen {smi['pcie.link.gen.current']} x{smi['pcie.link.width.current']}"
                 if "pcie.link.gen.current" in smi else None),
        "torch": probe.get("torch") or imports.get("torch"), "cuda": probe.get("torch_cuda"),
        "python": probe.get("python") or sys.version.split()[0], "cpu": probe.get("cpu"),
        "cpu_count": probe.get("cpu_count") or os.cpu_count(),
    }  # fmt: skip


def highlights(results: list[StepResult]) -> dict[str, Any]:
    """The few numbers each step is for (see ``gpu_check.report``)."""
    from aegaeon_bench.gpu_check.report import step_highlights

    return {r.name: step_highlights(r.name, r.results) for r in results
            if r.results is not None}


def write_outputs(out: Path, check: Check, results: list[StepResult]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "version": FORMAT_VERSION, "dry_run": check.dry, "device": check.device,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(check.started)),
        "total_s": round(time.time() - check.started, 1),
        "ok": all(r.status in ("ok", "skipped") for r in results)
        and any(r.status == "ok" for r in results),
        "machine": machine(results), "highlights": highlights(results),
        "steps": [r.to_dict() for r in results],
        "scenario": check.args.scenario, **check.sections,
    }  # fmt: skip
    path = out / "gpu-check.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    (check.logs / "gpu-check.json").write_text(path.read_text())
    pack_logs([check.logs], out / "gpu-check-logs.tar.gz")
    return path


def default_budget_s(scenario: str, dry: bool, device: str = "cuda") -> float:
    if scenario == "engine":
        return ENGINE_DRY_BUDGET_S if dry else ENGINE_BUDGET_S
    if scenario == "paper":
        from aegaeon_bench.gpu_check.paper import BUDGET_S as PAPER_S
        from aegaeon_bench.gpu_check.paper import CPU_BUDGET_S as PAPER_CPU_S
        from aegaeon_bench.gpu_check.paper import DRY_BUDGET_S as PAPER_DRY_S

        if dry:
            return PAPER_DRY_S
        return PAPER_CPU_S if device.startswith("cpu") else PAPER_S
    return DRY_BUDGET_S if dry else BUDGET_S


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT / "runs" / time.strftime("gpu-check-%Y%m%d-%H%M%S")


def build_parser() -> argparse.ArgumentParser:
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
    try:  # mistakes in one line where the project is installed (a bare GPU machine has
        # only this folder on its path until the wheels are in: argparse's own there)
        from aegaeon_common.usage import OneLineParser

        parser_class = OneLineParser
    except ImportError:
        pass
    parser = parser_class(prog="scripts/gpu-check", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true",
                      help="fetch the wheels into .whl/ and print the device invocation")
    mode.add_argument("--dry-run", action="store_true", help="the sequence on the CPU, fast")
    parser.add_argument("--scenario", choices=("default", "paper", "engine"),
                        default="default",
                        help="default: the steps below; paper: eight 7-8B models generated in "
                        "memory on the device, every policy interleaved rate by rate at rates "
                        "the simulator predicts around each one's 90%% crossing, the "
                        "artifact's SLO (aegaeon_bench.gpu_check.paper; with --device cpu "
                        "and no --dry-run its CPU-scale version); engine: the decode step "
                        "against the HBM roofline and transformers, eager and on CUDA graphs "
                        "(aegaeon_bench.gpu_check.engine)")
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else "
                        "runs/gpu-check-<time>)")
    parser.add_argument("--device", default="cuda", help="the GPU (default cuda)")
    parser.add_argument("--market", type=Path, help="an existing market (default: build one)")
    parser.add_argument("--budget-s", type=float, help=f"every step within this (default "
                        f"{BUDGET_S:g}, dry run {DRY_BUDGET_S:g})")
    parser.add_argument("--install-wheels", action="store_true",
                        help="dry run: install .whl/ into a temporary folder as well")
    parser.add_argument("--steps", help="comma-separated steps after the probe and market "
                        "(default: gpu_tests,tensor_parallel,bench_engine,bench_switch,"
                        "fp8_switch,serve[,serve_mps])")
    parser.add_argument("--mps", action="store_true",
                        help="also serve with both instances under one CUDA MPS server")
    parser.add_argument("--serve-load-s", type=float, default=SERVE_LOAD_S,
                        help=f"seconds of load in a serving step (default {SERVE_LOAD_S:g})")
    parser.add_argument("--paper-policies", default=",".join(PAPER_POLICIES),
                        help="--scenario paper: the policies to run, comma-separated, in "
                        "priority order (what a short budget keeps first; default "
                        f"{','.join(PAPER_POLICIES)})")
    parser.add_argument("--paper-load-s", type=float, default=None,
                        help="--scenario paper: at least this many seconds of arrivals per "
                        "rate (default: 60 on a device or --device cpu, 4 in a dry run)")
    parser.add_argument("--profile-s", type=float, default=0.0,
                        help="py-spy each worker this long during a serving step (needs py-spy "
                        "in .whl/ or on PATH; default 0: off)")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the work folder (market, run dirs) for a look")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    chosen = args.paper_policies.split(",")
    unknown = sorted(set(chosen) - set(PAPER_POLICIES))
    if unknown:
        parser.error(f"--paper-policies: unknown {', '.join(unknown)} (choose from "
                     f"{', '.join(PAPER_POLICIES)})")
    if len(set(chosen)) != len(chosen):
        parser.error(f"--paper-policies: {args.paper_policies}: a policy is named twice")
    if args.paper_load_s is not None and not args.paper_load_s > 0:
        parser.error(f"--paper-load-s: must be > 0, got {args.paper_load_s:g}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s: must be > 0, got {args.budget_s:g}")
    if args.prepare:
        from aegaeon_bench.gpu_check.prepare import prepare

        return prepare(ROOT)
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="aegaeon-gpu-check-"))
    check = Check(args, work)
    check.say(f"gpu-check: {'dry run on the CPU' if check.dry else check.device}, work in "
              f"{work}")
    try:
        results = check.run()
    except KeyboardInterrupt:
        results = check.runner.results
        check.runner.results.append(StepResult("interrupted", "error", error="Ctrl-C"))
    out = args.out or default_out()
    path = write_outputs(out, check, results)
    from aegaeon_bench.gpu_check.report import print_summary

    print_summary(json.loads(path.read_text()))
    print(f"gpu-check: wrote {path} and {out / 'gpu-check-logs.tar.gz'}", flush=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r.status in ("ok", "skipped") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
