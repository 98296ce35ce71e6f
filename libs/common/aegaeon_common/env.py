"""Every environment variable the project reads, read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "AEGAEON_API_KEY"


@dataclass(frozen=True)
class Env:
    log_level: str
    log_json: bool | None  # None: JSON when stderr is not a TTY
    market_dir: Path | None
    run_dir: Path | None
    threads: int | None
    native_kernels: bool  # AEGAEON_NATIVE=0 forces the engine's torch-only path
    isa: str | None  # AEGAEON_ISA: the native kernels' level (avx2, avx512, amx, neon); None: best
    cache_dir: Path  # $XDG_CACHE_HOME/aegaeon: builds kept across runs (native kernels)
    profile_cache: bool  # AEGAEON_PROFILE_CACHE=0: every worker start measures its profile
    # AEGAEON_ADVERTISE_HOST: the host name other services and `aegaeon serve` are
    # told to reach a side HTTP server at when it binds every interface
    # (0.0.0.0); None: this machine's host name (a container's, in compose).
    advertise_host: str | None = None
    # AEGAEON_API_KEY: the key the bench commands and scripts/prometheus send a node
    # (Authorization: Bearer KEY) when no --api-key is given
    api_key: str | None = None


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def read_env() -> Env:
    """The project's settings from the environment (``AEGAEON_*``)."""
    market = os.environ.get("AEGAEON_MARKET")
    run_dir = os.environ.get("AEGAEON_RUN_DIR")
    threads = os.environ.get("AEGAEON_THREADS")
    xdg_cache = os.environ.get("XDG_CACHE_HOME")
    return Env(
        log_level=os.environ.get("AEGAEON_LOG_LEVEL", "info").lower(),
        log_json=_flag(os.environ.get("AEGAEON_LOG_JSON")),
        market_dir=Path(market) if market else None,
        run_dir=Path(run_dir) if run_dir else None,
        threads=int(threads) if threads else None,
        native_kernels=_flag(os.environ.get("AEGAEON_NATIVE")) is not False,
        isa=os.environ.get("AEGAEON_ISA", "").strip().lower() or None,
        profile_cache=_flag(os.environ.get("AEGAEON_PROFILE_CACHE")) is not False,
        cache_dir=(Path(xdg_cache) if xdg_cache else Path.home() / ".cache") / "aegaeon",
        advertise_host=os.environ.get("AEGAEON_ADVERTISE_HOST", "").strip() or None,
        api_key=os.environ.get(API_KEY_ENV, "").strip() or None,
    )
