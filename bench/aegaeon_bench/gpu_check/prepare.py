"""``scripts/gpu-check --prepare``: the wheels the GPU machine lacks, and how to run the check.

The GPU machine has no network; its ``python3`` (3.12, torch CUDA) holds
``PREINSTALLED`` (the device tool's KINDS.md, "Python packages already
there"). The project's runtime dependencies (pyproject) that are not among
them are fetched here as CPython 3.12 manylinux x86-64 wheels, at the
version installed in this environment, into ``.whl/`` (ignored by git; one
version per package; a wheel already there is kept). Each wheel's own
requirements are checked against the same lists. Then the sizes of what
travels and the device invocation (command and carry) are printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

TREE_LIMIT_BYTES = 64 << 20
RUN_TIMEOUT_S = 570
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
# The GPU machine's image, as the device tool's KINDS.md lists it (names normalised).
_PREINSTALLED_TEXT = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
PREINSTALLED = frozenset(_PREINSTALLED_TEXT.split())


def normalize(name: str) -> str:
    """PEP 503 names: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def applies(spec: str) -> bool:
    """False for requirements behind an extra or a marker that excludes Linux / 3.12."""
    marker = spec.partition(";")[2]
    if not marker:
        return True
    if "extra" in marker or "pypy" in marker:
        return False
    if re.search(r"sys_platform\s*==\s*['\"](win32|darwin)", marker):
        return False
    match = re.search(r'python_version\s*<\s*"(\d+)\.(\d+)"', marker)
    return not (match and (int(match.group(1)), int(match.group(2))) <= (3, 12))


def missing_packages(root: Path) -> list[str]:
    """The runtime dependencies the GPU machine lacks (normalised names)."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    names = {requirement_name(d) for d in data["project"]["dependencies"] if applies(d)}
    return sorted(names - PREINSTALLED)


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def fetch(root: Path, names: list[str]) -> list[Path]:
    """One wheel per name into ``root/.whl`` at this environment's version."""
    target = root / ".whl"
    target.mkdir(exist_ok=True)
    wheels = []
    for name in names:
        version = metadata.version(name)
        have = [w for w in target.glob("*.whl") if _wheel_name(w)[0] == name]
        for stale in (w for w in have if _wheel_name(w)[1] != version):
            stale.unlink()  # one version per package, or the install fails
        kept = [w for w in have if w.exists()]
        if kept:
            wheels += kept
            continue
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms,
               "-d", str(target), f"{name}=={version}"]
        print(f"prepare: fetching {name}=={version}", flush=True)
        subprocess.run(cmd, check=True)
        wheels += [w for w in target.glob("*.whl") if _wheel_name(w)[0] == name]
    return wheels


def unmet_requirements(wheels: list[Path]) -> dict[str, list[str]]:
    """Per wheel, its requirements found neither on the GPU machine nor among the wheels."""
    carried = {_wheel_name(w)[0] for w in wheels}
    unmet: dict[str, list[str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        needs = [line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("Requires-Dist:")]
        missing = [n for n in needs if applies(n)
                   and requirement_name(n) not in PREINSTALLED | carried]
        if missing:
            unmet[wheel.name] = missing
    return unmet


def travelling_bytes(root: Path) -> dict[str, int]:
    """Bytes that travel: tracked files, untracked files git does not ignore, ``.whl``."""
    def sizes(*args: str) -> int:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=root, capture_output=True,
                             check=True).stdout.split(b"\0")
        paths = (root / p.decode() for p in out if p)
        return sum(p.stat().st_size for p in paths if p.is_file())

    whl = sum(p.stat().st_size for p in (root / ".whl").glob("*") if p.is_file())
    return {"tracked": sizes(), "untracked": sizes("--others", "--exclude-standard"),
            "wheels": whl}


def invocation() -> dict[str, object]:
    """What the operator passes to the device tool's ``run``."""
    return {"command": "bash scripts/gpu-check", "carry": [".whl"], "timeout_s": RUN_TIMEOUT_S}


def prepare(root: Path) -> int:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=root,
                             check=False).returncode == 0
    if not ignored:
        print("prepare: .whl/ is not ignored by git (it must travel only as a carried path); "
              "add /.whl/ to .gitignore or .git/info/exclude", file=sys.stderr)
        return 2
    names = missing_packages(root)
    print(f"prepare: the GPU machine lacks {', '.join(names) or 'nothing'}", flush=True)
    try:
        wheels = fetch(root, names)
    except (subprocess.CalledProcessError, metadata.PackageNotFoundError) as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 1
    for wheel in wheels:
        print(f"  {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB)")
    for wheel_name, needs in unmet_requirements(wheels).items():
        print(f"prepare: warning: {wheel_name} needs {', '.join(needs)}, not on the GPU machine",
              file=sys.stderr)
    sizes = travelling_bytes(root)
    total = sum(sizes.values())
    print("prepare: travels " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
          + f" = {total / 2**20:.1f} MiB of {TREE_LIMIT_BYTES >> 20} MiB")
    if total > TREE_LIMIT_BYTES:
        print("prepare: too much travels: ignore or remove untracked files", file=sys.stderr)
        return 1
    print("prepare: on the GPU machine, run (device tool `run`):")
    print(json.dumps(invocation()))
    return 0
