"""Every environment variable the project reads, read here and nowhere else.

Each ``AEGAEON_*`` value is checked as it is read: a value outside what a
variable takes is an :class:`EnvError` naming the variable and the values it
allows, so every command answers it in one line before it starts anything
(``aegaeon_cli.main`` reads the environment first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "AEGAEON_API_KEY"
# AEGAEON_ISA: the native kernels' levels (aegaeon_engine.isa.LEVELS, checked in the tests)
ISA_LEVELS = ("avx2", "avx512", "amx", "neon")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
FLAG_VALUES = _TRUE + _FALSE


class EnvError(ValueError):
    """An environment variable with a value it does not take; names both and what it takes."""

    def __init__(self, name: str, value: str, allowed: str) -> None:
        super().__init__(f"{name}={value!r}: {allowed}")
        self.name = name


@dataclass(frozen=True)
class Env:
    log_level: str
    log_json: bool | None  # None: JSON when stderr is not a TTY
    market_dir: Path | None
    run_dir: Path | None
    native_kernels: bool  # AEGAEON_NATIVE=0 forces the engine's torch-only path
    isa: str | None  # AEGAEON_ISA: the native kernels' level (avx2, avx512, amx, neon); None: best
    cache_dir: Path  # $XDG_CACHE_HOME/aegaeon: builds kept across runs (native kernels)
    profile_cache: bool  # AEGAEON_PROFILE_CACHE=0: every worker start measures its profile
    # AEGAEON_ADVERTISE_HOST: the host name other services and `aegaeon serve` are
    # told to reach a side HTTP server at when it binds every interface
    # (0.0.0.0); None: this machine's host name (a container's, in compose).
    advertise_host: str | None = None
    # AEGAEON_CLIENTS_DIR: where `scripts/install-bench-clients` put the benchmark
    # clients' environments (`aegaeon bench clients`); default: the cache directory
    clients_dir: Path | None = None
    # AEGAEON_API_KEY: the key the bench commands and scripts/prometheus send a node
    # (Authorization: Bearer KEY) when no --api-key is given
    api_key: str | None = None
    # AEGAEON_CHAOS_PRIVATE_SHM: set by `aegaeon bench chaos` in the run it re-executes
    # in a private /dev/shm of this size (never by a user)
    chaos_private_shm: str | None = None


def _get(name: str) -> str | None:
    """The variable's value, None when unset or empty (an empty value means unset)."""
    value = os.environ.get(name)
    return value if value else None


def _flag(name: str) -> bool | None:
    value = _get(name)
    if value is None:
        return None
    word = value.strip().lower()
    if word not in FLAG_VALUES:
        raise EnvError(name, value, f"one of {', '.join(FLAG_VALUES)}")
    return word in _TRUE


def _choice(name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    value = _get(name)
    if value is None or not value.strip():
        return default
    word = value.strip().lower()
    if word not in choices:
        raise EnvError(name, value, f"one of {', '.join(choices)}")
    return word


def _host(name: str) -> str | None:
    value = _get(name)
    if value is None or not value.strip():
        return None
    host = value.strip()
    if "://" in host or any(c.isspace() for c in host) or "/" in host:
        raise EnvError(name, value, "a host name or IP address (no scheme, path or spaces)")
    return host


def read_env() -> Env:
    """The project's settings from the environment (``AEGAEON_*``); EnvError for a bad value."""
    market = _get("AEGAEON_MARKET")
    run_dir = _get("AEGAEON_RUN_DIR")
    clients = _get("AEGAEON_CLIENTS_DIR")
    xdg_cache = _get("XDG_CACHE_HOME")
    return Env(
        log_level=_choice("AEGAEON_LOG_LEVEL", LOG_LEVELS, "info") or "info",
        log_json=_flag("AEGAEON_LOG_JSON"),
        market_dir=Path(market) if market else None,
        run_dir=Path(run_dir) if run_dir else None,
        native_kernels=_flag("AEGAEON_NATIVE") is not False,
        isa=_choice("AEGAEON_ISA", ISA_LEVELS, None),
        profile_cache=_flag("AEGAEON_PROFILE_CACHE") is not False,
        cache_dir=(Path(xdg_cache) if xdg_cache else Path.home() / ".cache") / "aegaeon",
        advertise_host=_host("AEGAEON_ADVERTISE_HOST"),
        clients_dir=Path(clients) if clients else None,
        api_key=(_get(API_KEY_ENV) or "").strip() or None,
        chaos_private_shm=_get("AEGAEON_CHAOS_PRIVATE_SHM"),
    )
