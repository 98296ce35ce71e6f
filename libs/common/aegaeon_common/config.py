"""One YAML file describes the models and the instances of a deployment.

Frozen msgspec structs, decoded and validated on load; a bad file fails with a
:class:`ConfigError` naming the file and the field. A field's own range or
choices are in its type (``Literal``, ``Annotated[..., msgspec.Meta(...)]``:
msgspec checks them as it decodes); checks across fields and sections are
below. Socket addresses and shared-memory names are derived here, never
written as literals elsewhere.

Minimal file (everything else has a default)::

    market: ./market          # every model in it is served
    decode: {instances: 1, device_memory: 600MiB, kv_memory: 256MiB}

Without ``dtype`` a deployment serves in the dtype its market records for its
models (`serving_dtype`), so a float32 checkpoint is served in float32.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import yaml

from aegaeon_common.config_parse import ConfigError, build_section, parse_bytes, plain
from aegaeon_common.dtypes import DTYPES
from aegaeon_common.env import read_env
from aegaeon_common.market_index import MANIFEST, MarketError, read_manifest

# The baselines run every worker as a unified instance (prefill + decode).
# request-level / -sjf: ServerlessLLM / ServerlessLLM+ as the paper evaluated
# them (requests bound to an instance at arrival), switching with this system's
# own switcher; -global: an idealised global queue; request-level-charged:
# request-level whose every scale-up pays ServerlessLLM's load path
# (``baseline.load_gb_s``, ``baseline.init_s``); static-mux: MuxServe, the
# models that fit stay resident, the rest refused (aegaeon_sched.factory.POLICIES).
UnifiedPolicy = Literal[
    "request-level", "request-level-sjf", "request-level-global", "request-level-global-sjf",
    "request-level-charged", "static-mux",
]
PolicyName = Literal["aegaeon", UnifiedPolicy]
WeightsMode = Literal["auto", "copy", "map"]
StoreKind = Literal["memory", "redis"]
UNIFIED_POLICIES: tuple[str, ...] = get_args(UnifiedPolicy)
POLICIES: tuple[str, ...] = get_args(PolicyName)
WEIGHTS_MODES: tuple[str, ...] = get_args(WeightsMode)

# field ranges, checked by msgspec as a section decodes
Positive = Annotated[float, msgspec.Meta(gt=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, lt=65536)]  # 0: an ephemeral port
DEVICE = re.compile(r"(cpu|cuda)(:[0-9]+)?")  # what the workers run on (torch's names)

__all__ = [
    "DTYPES",
    "POLICIES",
    "UNIFIED_POLICIES",
    "WEIGHTS_MODES",
    "ApiKeyConfig",
    "BaselineConfig",
    "CacheConfig",
    "Config",
    "ConfigError",
    "HealthConfig",
    "InstancesConfig",
    "ModelConfig",
    "ModelSettings",
    "NodeConfig",
    "ProxyConfig",
    "RolesConfig",
    "SLOClassConfig",
    "SLOClassesConfig",
    "SLOConfig",
    "SchedulerConfig",
    "SecurityConfig",
    "StoreConfig",
    "fold_instance",
    "load_config",
    "market_dtype",
    "market_models",
    "parse_bytes",
    "read_config_file",
    "serving_dtype",
]


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A servable model: its name in the API and its checkpoint directory. With ``base``,
    a LoRA adapter of that served model: ``path`` is its PEFT adapter directory; it is
    served on its base's weights (one switching unit with it) and its own A, B."""

    name: str
    path: Path
    ttft_s: float | None = None  # per-model SLO override
    tbt_s: float | None = None
    base: str | None = None

    @property
    def unit(self) -> str:
        """The model whose weights serve it: its base, else itself."""
        return self.base or self.name


class SLOConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Default targets (paper: TTFT 10 s, TBT 100 ms)."""

    ttft_s: float = 10.0
    tbt_s: float = 0.1


SLO_CLASS_NAMES = ("interactive", "standard", "batch")  # aegaeon_sched.priority, by rank


class SLOClassConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One SLO class (request field ``priority``); null: the default of
    ``aegaeon_sched.priority`` (targets as multiples of ``slo``: interactive
    0.5x TTFT, batch 5x TTFT and 4x TBT; admit fractions 1.25 / 1.0 / 0.5;
    only batch deferred)."""

    ttft_s: Positive | None = msgspec.field(default=None, name="ttft")
    tbt_s: Positive | None = msgspec.field(default=None, name="tbt")
    # the share of each admission bound this class may fill before it is shed
    admit_fraction: Positive | None = None
    defer: bool | None = None  # past it: wait in the proxy (true) or 429 (false)


class SLOClassesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request SLO classes and priorities (past the paper, HyperFlexis).

    ``enabled: false`` schedules every request as ``standard`` (the paper's one
    SLO per deployment); the request fields are still checked.
    """

    enabled: bool = True
    interactive: SLOClassConfig = msgspec.field(default_factory=SLOClassConfig)
    standard: SLOClassConfig = msgspec.field(default_factory=SLOClassConfig)
    batch: SLOClassConfig = msgspec.field(default_factory=SLOClassConfig)
    max_deferred: Count = 256  # requests waiting in the proxy (deferred) at most


class RolesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill/decode role switching by token velocity (``aegaeon_sched.roles``).

    With ``enabled`` every instance can prefill and decode (decode instances run
    the hybrid loop) and the proxy moves instances between the roles.
    """

    enabled: bool = False
    high_util: float = 0.8  # convert a decoder when prefill demand > this x capacity
    low_util: float = 0.5  # back when demand < this x the capacity left without it
    up_hold_s: Seconds = 0.5
    down_hold_s: Seconds = 5.0
    min_dwell_s: Seconds = 3.0
    # queued prompt tokens count as demand of backlog / horizon (null: TTFT / 2)
    backlog_horizon_s: float | None = None
    decode_high: float = 0.9
    # a decoder converts only with decode demand (Eq. 3's S) at most this: the
    # work it holds stalls behind every prefill (busy decoders stay decoders)
    convert_max_demand: float = 0.2
    min_prefill: AtLeastOne = 1
    min_decode: Count = 0


class ModelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-model lifecycle and SLO limits (``model_settings: {NAME|"*": {...}}``);
    changed at run time by ``PATCH /v1/aegaeon/models/{model}``."""

    pin: bool = False  # an operator pin: never evicted from the Model Cache
    preload: bool = False  # in the Model Cache at start (before the prewarm list)
    max_concurrency: AtLeastOne | None = None  # requests in flight; past it a 429
    slo_classes: tuple[str, ...] = ()  # classes a request may ask for (empty: every one)
    min_ttft_s: Positive | None = None  # the tightest explicit ttft_ms a request may ask
    min_tbt_s: Positive | None = None


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: PolicyName = "aegaeon"
    max_group_size: int = 8  # MAX_GPSIZE of Algorithm 1
    q_max_s: float = 4.0  # Q_MAX of Eq. 3
    # Beyond the paper: each decode round's quotas sum to at most this x the
    # TTFT target (aegaeon_sched.quota); null: Eq. 3 as published.
    round_ttft_fraction: float | None = 0.7
    max_batch_size: int = 32
    prefetch: bool = True
    switch_beta: float = 0.625  # Eq. 4 correction factor
    # Beyond the paper: prefill instances decode when no prefill waits (hybrid).
    prefill_decodes_when_idle: bool = True
    # A decode instance holds a turn's tokens up to this x the TBT target and
    # sends them together, never past a deadline (aegaeon_runtime.decode.emit); 0: every
    # step's tokens as they come.
    token_hold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class BaselineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a scale-up costs the ``request-level-charged`` baseline (ServerlessLLM as the
    paper measured it): the model's bytes over a load path of ``load_gb_s`` (the paper's
    artifact charges 16 GB/s) plus ``init_s`` of engine start-up. A scale-up that this
    system's switcher finishes sooner waits out the rest; its switch record says how
    much (``charged_s``). No other policy is charged."""

    load_gb_s: Positive = 16.0
    init_s: Seconds = 0.0


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The node's cachemgr: Model Cache budget and unified CPU KV cache."""

    model_cache_bytes: int = 4 << 30
    kv_cache_bytes: int = 1 << 30
    slab_bytes: int = 4 << 20
    event_slots: int = 256
    prewarm: tuple[str, ...] = ("*",)  # model names, "*" = all
    # The side HTTP server (/health, /ready, /metrics): 0 = an ephemeral port
    # (the embedded default; the bound address goes to RUN_DIR/cachemgr.http).
    http_host: str = "127.0.0.1"
    http_port: Port = 0


class InstancesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A homogeneous set of worker instances (prefill or decode)."""

    instances: Count = 1
    device: str = "cpu"
    # One device per instance (instance i: devices[i], round and round), as `--gpus`
    # places them (aegaeon_sched.placement); empty: every instance on ``device``.
    # With ``tp`` > 1 an instance takes ``tp`` consecutive entries (its group).
    devices: tuple[str, ...] = ()
    # Tensor parallelism: each instance is a group of ``tp`` devices (one process per
    # device, one set of weights sharded across them; aegaeon_runtime.tp). The prefill
    # and decode sections must agree: the Model Cache holds one layout of each model.
    tp: AtLeastOne = 1
    # the whole buffer: weights arena + KV region
    device_memory_bytes: int = 512 << 20
    kv_memory_bytes: int = 128 << 20  # KV region at the top of the buffer
    threads: AtLeastOne = 1
    # Where the engine reads a model's weights: "copy" (scale-up copies them from
    # the Model Cache into the worker's buffer, as a GPU must), "map" (the engine
    # reads the Model Cache's shared memory in place: CPU only, a switch copies
    # nothing), "auto" (map on CPU, copy elsewhere).
    weights: WeightsMode = "auto"
    # Where LoRA adapters of the active model sit on the device when weights are
    # copied (a GPU): a region of the buffer below the KV region, taken from the
    # weights arena; null: 1/16 of device_memory when the deployment serves adapters,
    # else none (set it to load adapters at run time into such a deployment). With
    # weights mapped (CPU) adapters are read in place.
    adapter_memory_bytes: int | None = None
    # Decode steps on a CUDA device replay CUDA graphs (aegaeon_engine.graphs; docs/gpu.md):
    # false runs them eager. Nothing changes on the CPU.
    cuda_graphs: bool = True
    # Each instance's side HTTP server (/health, /ready, /metrics): instance i
    # binds http_port + i; 0 = ephemeral ports (the bound address goes to
    # RUN_DIR/<kind>-<i>.http). Containers set http_host 0.0.0.0.
    http_host: str = "127.0.0.1"
    http_port: Port = 0

    def device_of(self, index: int) -> str:
        """The device instance ``index`` runs on (its group's first: the group's rank 0)."""
        return self.group_devices(index)[0]

    def group_devices(self, index: int) -> tuple[str, ...]:
        """The ``tp`` devices of instance ``index``'s group, rank 0 first: ``devices``
        taken ``tp`` at a time (round and round); without ``devices``, ``device`` for
        every rank on the CPU, ``cuda:0..tp-1`` for a bare ``cuda``."""
        if self.devices:
            return tuple(self.devices[(index * self.tp + r) % len(self.devices)]
                         for r in range(self.tp))  # fmt: skip
        if self.tp > 1 and self.device == "cuda":
            return tuple(f"cuda:{r}" for r in range(self.tp))
        return (self.device,) * self.tp

    def http_port_of(self, index: int) -> int:
        """Instance ``index``'s side HTTP port (0: ephemeral)."""
        return self.http_port + index if self.http_port else 0

    @property
    def adapter_region_bytes(self) -> int:
        """Bytes of the device buffer's adapter region (copied weights only; the default
        is resolved at load, see ``adapter_memory_bytes``)."""
        return self.adapter_memory_bytes or 0

    def with_adapter_default(self, serves_adapters: bool) -> InstancesConfig:
        """This section with ``adapter_memory`` resolved: its own, else 1/16 of
        ``device_memory`` when the deployment serves LoRA adapters, else 0."""
        if self.adapter_memory_bytes is not None:
            return self
        default = self.device_memory_bytes // 16 if serves_adapters else 0
        return msgspec.structs.replace(self, adapter_memory_bytes=default)

    @property
    def maps_weights(self) -> bool:
        """True when the engine reads weights in place from the Model Cache."""
        return self.weights == "map" or (self.weights == "auto" and self.device.startswith("cpu"))


class ApiKeyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One API key the proxy accepts (``Authorization: Bearer KEY``); ``models``
    limits it to those models (empty: every model); ``name`` is what logs show.

    A user key (``admin`` false) reaches the API (inference, ``/v1/models``); an
    admin key also what changes or reveals the node (``/v1/aegaeon/*``, ``/metrics``,
    ``/sleep``...: the proxy's routes declare which) and is never limited to models.
    """

    key: str
    models: tuple[str, ...] = ()
    name: str = ""
    admin: bool = False
    # SLO classes this key may ask for (empty: every one) and the tightest explicit
    # targets (request fields ttft_ms / tbt_ms); null: no floor
    slo_classes: tuple[str, ...] = ()
    min_ttft_s: float | None = None
    min_tbt_s: float | None = None

    def __repr__(self) -> str:  # the key never reaches a log line or a traceback
        return (f"ApiKeyConfig(name={self.name!r}, models={self.models!r}, "
                f"admin={self.admin!r}, key=<hidden>)")  # fmt: skip


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: AtLeastOne = 1 << 20
    max_queued_requests: AtLeastOne = 512
    # The server's deadline for every request (a request's own `timeout` may only
    # shorten it): past it the request ends with a `deadline_exceeded` error.
    request_timeout_s: Positive = 600.0
    # Admission (429 + Retry-After before any work is spent): prompt tokens queued
    # for prefill and KV blocks (16 tokens of prompt + max_tokens) reserved by the
    # requests admitted, in total and per model. null: derived from the instances
    # once they announce themselves (prefill: what the prefill instances prefill
    # within the TTFT target; KV: the decode instances' device KV capacity).
    max_prefill_tokens: AtLeastOne | None = None
    max_prefill_tokens_per_model: AtLeastOne | None = None
    max_kv_blocks: AtLeastOne | None = None
    max_kv_blocks_per_model: AtLeastOne | None = None
    retry_after_s: Positive = 1.0
    # A request past the admission bounds (with SLO classes, its class's share of them)
    # waits for room, earliest first-token deadline first and the highest class first,
    # then, late, until admission_max_wait (below), and only then is a 429 (true); or
    # is a 429 at once unless its class defers (false; slo_classes.*.defer). Waiting keeps
    # goodput when many clients ignore Retry-After: a refusal costs a parse and a
    # tokenization, and a client that retries at once makes as many as the proxy answers.
    admission_wait: bool = True
    # How long that wait may last (YAML `admission_max_wait`, seconds after arrival;
    # null: until the request's first-token deadline). A waiter past its deadline is
    # late: it waits on behind every on-time waiter (aegaeon_sched.shedding), so it
    # takes no room from requests that can still meet their TTFT, and a burst's late
    # requests are served once it passes instead of each being a 429 that a client
    # ignoring Retry-After (closed-loop benchmark clients) turns into a new request at
    # once, on the cores the node needs (docs/results.md, issue 26).
    admission_max_wait_s: Positive | None = 60.0
    # Slow clients: a request body must arrive within read_timeout, a write to a
    # client that does not read must complete within write_timeout (else cut).
    read_timeout_s: Positive = 30.0
    write_timeout_s: Positive = 30.0
    # An idle keep-alive connection is closed after this (nginx's default; the
    # HTTP server's own would hold a client's idle connection for an hour).
    keepalive_timeout_s: Positive = 75.0
    # Kernel send buffer of each client connection (SO_SNDBUF; 0: the kernel's
    # autotuning, up to tcp_wmem's max, 4 MiB here): what a client that stops
    # reading can pin, and how soon the proxy notices it (write_timeout).
    send_buffer_bytes: Count = 256 << 10
    # API keys (empty, with no admin_keys: no authentication). Each: {key, models?,
    # name?, admin?} or a string; admin_keys: more keys, each an admin key.
    api_keys: tuple[ApiKeyConfig, ...] = ()
    admin_keys: tuple[ApiKeyConfig, ...] = ()
    # /metrics and /v1/aegaeon/* on their own port (null: on the API port); with keys
    # configured they need an admin key there too.
    admin_host: str = "127.0.0.1"
    admin_port: Port | None = None
    # The last N per-request timings, model switches and decode turns kept for
    # /v1/aegaeon/stats (benchmarks read them); memory grows until each is full.
    stats_records: AtLeastOne = 2000

    @property
    def keys(self) -> tuple[ApiKeyConfig, ...]:
        """Every key the proxy accepts: ``api_keys``, then ``admin_keys`` as admin keys."""
        admins = tuple(msgspec.structs.replace(k, admin=True) for k in self.admin_keys)
        return self.api_keys + admins


class SecurityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the node's services reach each other (``addresses``).

    By default every socket is ``ipc://`` in ``run_dir`` (made 0700). A ``tcp://``
    address must be on the loopback unless ``curve_key_file`` is set: a ZeroMQ
    CURVE certificate (``aegaeon keys curve FILE``) every service of the node
    holds; sockets then encrypt and accept only peers that prove they hold it.
    """

    curve_key_file: Path | None = None


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """This machine's place in a deployment of many nodes (beyond one machine).

    ``advertise_address`` (a host name or IP the other machines reach this one
    at) puts the instances' command sockets on tcp: instance *i* of the prefill
    kind at ``base_port + i``, decode instance *j* at ``base_port + P + j`` (P:
    the prefill instances), and a proxy replica's report socket at
    ``proxy_report_port`` (0: an ephemeral port, announced in the store).
    ``bind_address`` is what those sockets bind (default: the advertised
    address; ``0.0.0.0`` in a container). null: ipc:// in the run directory,
    one machine. ``name`` names the node in the registry (default ``local``).
    """

    name: str = "local"
    advertise_address: str | None = None
    bind_address: str | None = None
    base_port: Annotated[int, msgspec.Meta(ge=1, lt=65536)] = 5600
    proxy_report_port: Port = 0


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the proxy layer and the nodes share state (``aegaeon_common.store``).

    ``memory``: inside the one proxy (the embedded default; no Redis).
    ``redis``: the instance registry, loads, dispatch state and request metadata
    in Redis at ``url`` (password from ``password_file`` when set), every key
    under ``namespace``; an instance or proxy whose heartbeat key is older than
    ``heartbeat_ttl_s`` is dead.
    """

    kind: StoreKind = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "aegaeon"
    password_file: Path | None = None
    heartbeat_ttl_s: Annotated[float, msgspec.Meta(ge=1.0)] = 3.0  # 2 heartbeats


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Liveness that means it: an instance's ``/health`` answers 503 (``stalled``) once
    its compute thread has made no progress for ``stall_s`` while it has work (queued
    prefills, decoding requests, commands waiting); the proxy marks it down at once
    and the supervisor (``aegaeon serve``), Docker's health check and Kubernetes'
    liveness probe restart it."""

    stall_s: Positive = 30.0


class Config(msgspec.Struct, frozen=True):
    """A whole deployment. Build with :func:`load_config`."""

    models: tuple[ModelConfig, ...]
    market_dir: Path | None = None
    dtype: str = "bfloat16"
    slo: SLOConfig = msgspec.field(default_factory=SLOConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    baseline: BaselineConfig = msgspec.field(default_factory=BaselineConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    prefill: InstancesConfig = msgspec.field(default_factory=InstancesConfig)
    decode: InstancesConfig = msgspec.field(default_factory=InstancesConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    slo_classes: SLOClassesConfig = msgspec.field(default_factory=SLOClassesConfig)
    roles: RolesConfig = msgspec.field(default_factory=RolesConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    # per model ("*": every model without its own entry)
    model_settings: dict[str, ModelSettings] = msgspec.field(default_factory=dict)
    run_dir: Path = Path("/tmp/aegaeon")
    # address overrides, e.g. tcp:// in containers
    addresses: dict[str, str] = msgspec.field(default_factory=dict)
    # SIGTERM: a service turns unready, stops taking work and finishes what it
    # holds within this many seconds, then exits (supervisors wait a little longer).
    drain_timeout_s: float = 30.0
    source: str = "<defaults>"

    # ---- derived names -------------------------------------------------
    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def unit_of(self, name: str) -> str:
        """The switching unit of model ``name``: its base for a LoRA adapter, else itself."""
        model = self.model(name)
        return model.unit if model is not None else name

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    def settings_of(self, name: str) -> ModelSettings:
        """``model_settings`` of a model: its own entry, else ``"*"``, else the defaults."""
        return self.model_settings.get(name) or self.model_settings.get("*") or ModelSettings()

    @property
    def role_switching(self) -> bool:
        """True when instances move between the prefill and decode roles (every
        instance prefills and decodes: decode instances run the hybrid loop)."""
        return self.hybrid_prefill and self.roles.enabled

    def _address(self, key: str) -> str:
        return self.addresses.get(key) or f"ipc://{self.run_dir / (key + '.sock')}"

    @property
    def distributed(self) -> bool:
        """True when the proxy layer and the nodes share state in Redis (many nodes)."""
        return self.store.kind == "redis"

    def instance_port(self, kind: str, index: int) -> int:
        """The tcp port of an instance's command socket (``node.base_port``)."""
        offset = index if kind == "prefill" else self.prefill.instances + index
        return self.node.base_port + offset

    def _instance_address(self, kind: str, index: int, host: str | None) -> str:
        key = f"{kind}-{index}"
        if key in self.addresses or host is None:
            return self._address(key)
        return f"tcp://{host}:{self.instance_port(kind, index)}"

    def instance_bind_address(self, kind: str, index: int) -> str:
        """What an instance binds its command socket to (``node.bind_address``)."""
        node = self.node
        return self._instance_address(kind, index, node.bind_address or node.advertise_address)

    @property
    def unified(self) -> bool:
        """True when every worker is a unified instance (request-level policies)."""
        return self.scheduler.policy in UNIFIED_POLICIES

    @property
    def worker_instances(self) -> list[tuple[str, int]]:
        """``(kind, index)`` of every worker instance a node starts, in start order
        (request-level policies: every worker is a unified instance, a decode process
        that also prefills, so both kinds of policy use the same workers)."""
        if self.unified:
            return [("decode", i) for i in range(self.prefill.instances + self.decode.instances)]
        return ([("prefill", i) for i in range(self.prefill.instances)]
                + [("decode", i) for i in range(self.decode.instances)])  # fmt: skip

    @property
    def hybrid_prefill(self) -> bool:
        """True when prefill instances also decode (Aegaeon policy only)."""
        return not self.unified and self.scheduler.prefill_decodes_when_idle

    @property
    def proxy_address(self) -> str:
        """Where instances push their messages to the proxy."""
        return self._address("proxy")

    @property
    def cachemgr_address(self) -> str:
        return self._address("cachemgr")

    def instance_address(self, kind: str, index: int) -> str:
        """Where instance ``kind-index`` is reached (advertised)."""
        return self._instance_address(kind, index, self.node.advertise_address)

    def prefill_address(self, index: int) -> str:
        return self.instance_address("prefill", index)

    def decode_address(self, index: int) -> str:
        return self.instance_address("decode", index)

    @property
    def run_id(self) -> str:
        """Short id of this deployment, used in shared-memory names."""
        return hashlib.sha1(str(self.run_dir.resolve()).encode()).hexdigest()[:8]

    @property
    def shm_prefix(self) -> str:
        return f"aegaeon-{self.run_id}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for logs and for handing the exact config to children)."""
        out = plain(self)
        assert isinstance(out, dict)
        return out


_SECTIONS: dict[str, type] = {
    "slo": SLOConfig,
    "scheduler": SchedulerConfig,
    "baseline": BaselineConfig,
    "cachemgr": CacheConfig,
    "prefill": InstancesConfig,
    "decode": InstancesConfig,
    "proxy": ProxyConfig,
    "security": SecurityConfig,
    "node": NodeConfig,
    "store": StoreConfig,
    "slo_classes": SLOClassesConfig,
    "roles": RolesConfig,
    "health": HealthConfig,
}
_TOP_KEYS = {"market", "models", "dtype", "run_dir", "addresses", "drain_timeout",
             "model_settings", "instance", *_SECTIONS}  # fmt: skip
# What a role's own section says of itself alone: its count, its devices, and its side
# HTTP ports (instance i binds http_port + i: shared, the two roles' would collide).
_PER_ROLE = ("instances", "devices", "http_port")


def fold_instance(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``raw`` with its ``instance`` section folded into ``prefill`` and ``decode``: each
    key of ``instance`` (``tp``, ``device``, ``device_memory``, ``kv_memory``,
    ``threads``, ``weights``, ``cuda_graphs``, ``http_host``) applies to both roles
    unless a role's own section gives it. The one place the shared defaults resolve;
    ``raw`` without ``instance`` comes back as it is. ConfigError names ``instance.KEY``."""
    shared = raw.get("instance")
    if shared is None:
        return raw
    if not isinstance(shared, dict):
        raise ConfigError(source, "instance", "must be a map")
    for key in shared:
        if str(key) in _PER_ROLE:
            raise ConfigError(source, f"instance.{key}", "set per role, in prefill and decode")
    section = build_section(InstancesConfig, shared, source, "instance")  # names instance.KEY
    given = {_canonical(str(k)) for k in shared}
    if {"device_memory_bytes", "kv_memory_bytes"} <= given and (
            section.kv_memory_bytes >= section.device_memory_bytes):
        raise ConfigError(source, "instance.kv_memory", "must be smaller than device_memory")
    values = {k: v for k, v in plain(section).items() if k in given}
    out = {k: v for k, v in raw.items() if k != "instance"}
    for kind in ("prefill", "decode"):
        own = raw.get(kind) or {}
        if not isinstance(own, dict):
            raise ConfigError(source, kind, "must be a map")
        mine = {_canonical(str(k)) for k in own}
        out[kind] = {**{k: v for k, v in values.items() if k not in mine}, **own}
    return out


def _canonical(key: str) -> str:
    """An instance field's name as written (``device_memory``) or in full (``_bytes``)."""
    fields = {f.name for f in msgspec.structs.fields(InstancesConfig)}
    return key if key in fields or f"{key}_bytes" not in fields else f"{key}_bytes"


def serving_dtype(recorded: list[str]) -> str:
    """The dtype a deployment serves its models in, from the dtypes they are stored in.

    One dtype serves every model of a deployment. The dtype the models share;
    float32 when they differ (it holds bfloat16 and float16 values exactly, so
    no model is served below its own precision); bfloat16 when none is recorded.
    """
    kinds = set(recorded)
    if not kinds:
        return "bfloat16"
    return kinds.pop() if len(kinds) == 1 else "float32"


def _checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a checkpoint's ``config.json`` names (``dtype`` or ``torch_dtype``), if any."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the model's own checks report a broken checkpoint
    if not isinstance(config, dict):
        return None
    name = str(config.get("dtype") or config.get("torch_dtype") or "").removeprefix("torch.")
    return name if name in DTYPES else None


def market_dtype(market: Path) -> str:
    """The dtype a deployment of ``market`` serves in when its config names none."""
    return serving_dtype(_market_models(market, str(market / "market.json"))[1])


def market_models(market: Path) -> list[ModelConfig]:
    """The models ``market.json`` lists now (read on every call: the proxy's
    ``POST /v1/aegaeon/models`` adds one without a restart); ConfigError if unreadable."""
    return _market_models(market, str(market / "market.json"))[0]


def _market_models(market: Path, source: str) -> tuple[list[ModelConfig], list[str]]:
    """The market's models and their stored dtypes (``market.json``'s, else each
    checkpoint's ``config.json``)."""
    index = market / MANIFEST
    if not index.exists():
        problem = f"{index} not found (run `aegaeon market create`)"
        raise ConfigError(source, "market", problem)
    try:
        entries = read_manifest(market).entries
    except MarketError as exc:
        raise ConfigError(str(index), "models", f"malformed market index ({exc})") from None
    models = [ModelConfig(name=e.name, path=market / e.path.relative_to(market.resolve()),
                          base=e.base or None)
              if e.path.is_relative_to(market.resolve())
              else ModelConfig(name=e.name, path=e.path, base=e.base or None)
              for e in entries]  # fmt: skip
    # adapters are served in their base's dtype: only models decide the market's
    recorded = [e.dtype if e.dtype in DTYPES else _checkpoint_dtype(m.path)
                for e, m in zip(entries, models, strict=True) if not e.adapter]
    return models, [d for d in recorded if d is not None]


def _check_adapters(models: list[ModelConfig], source: str) -> None:
    """Every LoRA adapter's base is a served model that is no adapter itself."""
    full = {m.name for m in models if m.base is None}
    for i, m in enumerate(models):
        if m.base is not None and m.base not in full:
            raise ConfigError(source, f"models[{i}].base", f"adapter {m.name!r}: its base "
                              f"{m.base!r} is not a served model (served: "
                              f"{', '.join(sorted(full)) or 'none'})")


def _models(raw: Any, base: Path, source: str) -> list[ModelConfig]:
    if not isinstance(raw, list):
        raise ConfigError(source, "models", "must be a list of {name, path}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(source, f"models[{i}]", "must be a map with name and path")
        fields = dict(item)
        if "path" in fields:
            fields["path"] = str(base / str(fields["path"]))
        out.append(build_section(ModelConfig, fields, source, f"models[{i}]"))
    return out


def config_from_dict(
    raw: dict[str, Any], source: str = "<dict>", base: Path | None = None
) -> Config:
    """Validate plain data (a parsed YAML file) into a :class:`Config`."""
    base = base or Path.cwd()
    if not isinstance(raw, dict):
        raise ConfigError(source, "<top>", "must be a map")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        known = ", ".join(sorted(_TOP_KEYS))
        raise ConfigError(source, unknown[0], f"unknown key (known: {known})")
    raw = fold_instance(raw, source)
    env = read_env()
    market_raw = raw.get("market")
    market = (base / str(market_raw)).resolve() if market_raw else env.market_dir
    models = _models(raw["models"], base, source) if raw.get("models") else []
    stored: list[str] = []
    if not models:
        if market is None:
            raise ConfigError(source, "models", "no models: give `models` or `market`")
        models, stored = _market_models(market, source)
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(source, "models", f"duplicate model name {dupes[0]!r}")
    _check_adapters(models, source)
    # an explicit dtype wins; else the market's (a float32 checkpoint served in
    # bfloat16 drifts from its reference after a few tokens)
    dtype = str(raw["dtype"]) if raw.get("dtype") is not None else serving_dtype(stored)
    if dtype not in DTYPES:
        raise ConfigError(source, "dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    raw_sections = {key: raw.get(key) or {} for key in _SECTIONS}
    raw_sections["proxy"] = _proxy_raw(raw_sections["proxy"], source)
    sections: dict[str, Any] = {
        key: build_section(cls, raw_sections[key], source, key) for key, cls in _SECTIONS.items()
    }
    _check_proxy(sections["proxy"], names, source)
    sched: SchedulerConfig = sections["scheduler"]
    for key in ("prefill", "decode"):
        inst: InstancesConfig = sections[key].with_adapter_default(
            any(m.base is not None for m in models))
        sections[key] = inst
        if inst.kv_memory_bytes >= inst.device_memory_bytes:
            raise ConfigError(source, f"{key}.kv_memory", "must be smaller than device_memory")
        if inst.adapter_region_bytes < 0 or (not inst.maps_weights and inst.kv_memory_bytes
                                             + inst.adapter_region_bytes
                                             >= inst.device_memory_bytes):  # fmt: skip
            raise ConfigError(source, f"{key}.adapter_memory", "must be >= 0 and leave room "
                              "for weights beside kv_memory in device_memory")
        for field, device in [("device", inst.device), *(("devices", d) for d in inst.devices)]:
            if not DEVICE.fullmatch(device):
                raise ConfigError(source, f"{key}.{field}", f"{device!r} is not a device "
                                  "(cpu, cuda or cuda:N)")  # fmt: skip
            if inst.weights == "map" and not device.startswith("cpu"):
                raise ConfigError(
                    source, f"{key}.weights", f"'map' needs a CPU device, not {device!r}"
                )
        _check_group(inst, key, source)
    if sections["prefill"].tp != sections["decode"].tp:
        raise ConfigError(source, "decode.tp", f"{sections['decode'].tp} differs from prefill.tp "
                          f"({sections['prefill'].tp}): the Model Cache holds each model in "
                          "one tensor-parallel layout, which every instance reads")  # fmt: skip
    run_raw = raw.get("run_dir")
    run_dir = Path(str(run_raw)) if run_raw else (env.run_dir or Path("/tmp") / "aegaeon")
    addresses = raw.get("addresses") or {}
    if not isinstance(addresses, dict) or not all(isinstance(v, str) for v in addresses.values()):
        raise ConfigError(source, "addresses", "must map names to zmq addresses")
    _check_addresses(addresses, sections["security"], source)
    _check_node(sections["node"], sections["store"], sections["security"], sched, source)
    drain_raw = raw.get("drain_timeout", 30.0)
    if isinstance(drain_raw, bool) or not isinstance(drain_raw, int | float) or drain_raw < 0:
        raise ConfigError(source, "drain_timeout", "must be a number of seconds >= 0")
    _check_roles(sections["roles"], source)
    model_settings = _model_settings(raw.get("model_settings"), names, source)
    # every section is a field of the same name; ``cachemgr`` is ``Config.cache``
    fields = {"cache" if key == "cachemgr" else key: v for key, v in sections.items()}
    return Config(
        models=tuple(models),
        market_dir=market,
        dtype=dtype,
        run_dir=run_dir,
        addresses={str(k): v for k, v in addresses.items()},
        drain_timeout_s=float(drain_raw),
        model_settings=model_settings,
        source=source,
        **fields,
    )


def _check_group(inst: InstancesConfig, key: str, source: str) -> None:
    """A tensor-parallel group's devices: distinct accelerators (the CPU may hold many
    ranks), on one kind of device."""
    if inst.tp == 1:
        return
    field = f"{key}.devices" if inst.devices else f"{key}.device"
    for index in range(max(inst.instances, 1)):
        group = inst.group_devices(index)
        kinds = {d.partition(":")[0] for d in group}
        if len(kinds) > 1:
            raise ConfigError(source, field, f"instance {index}'s tensor-parallel group "
                              f"{list(group)} mixes devices")  # fmt: skip
        if kinds != {"cpu"} and len(set(group)) < len(group):
            raise ConfigError(source, field, f"instance {index}'s tensor-parallel group "
                              f"{list(group)} repeats a device (tp {inst.tp}: give "
                              f"{inst.tp} devices per instance)")  # fmt: skip


def _check_roles(roles: RolesConfig, source: str) -> None:
    if not 0 < roles.low_util < roles.high_util:
        raise ConfigError(source, "roles.low_util", "need 0 < low_util < high_util")


def check_slo_classes(names: tuple[str, ...], source: str, where: str) -> None:
    """Raise a ConfigError unless every one of ``names`` is an SLO class."""
    unknown = [n for n in names if n not in SLO_CLASS_NAMES]
    if unknown:
        raise ConfigError(source, where, f"{unknown[0]!r} is not one of {SLO_CLASS_NAMES}")


def _model_settings(raw: Any, models: list[str], source: str) -> dict[str, ModelSettings]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(source, "model_settings", "must map model names (or '*') to settings")
    out: dict[str, ModelSettings] = {}
    for name, section in raw.items():
        where = f"model_settings.{name}"
        if name != "*" and name not in models:
            raise ConfigError(source, where, f"unknown model {name!r}")
        settings = build_section(ModelSettings, section or {}, source, where)
        check_slo_classes(settings.slo_classes, source, f"{where}.slo_classes")
        out[str(name)] = settings
    return out


def _proxy_raw(raw: Any, source: str) -> Any:
    """``proxy.api_keys`` and ``proxy.admin_keys`` may list bare strings: each
    becomes ``{key: ...}``."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for field in ("api_keys", "admin_keys"):
        if field not in raw:
            continue
        keys = raw[field] if raw[field] is not None else []
        if not isinstance(keys, list):
            raise ConfigError(source, f"proxy.{field}", "must be a list of keys or {key, ...}")
        out[field] = [{"key": k} if isinstance(k, str) else k for k in keys]
    return out


def _check_proxy(proxy: ProxyConfig, models: list[str], source: str) -> None:
    if proxy.admin_port and proxy.admin_port == proxy.port:
        raise ConfigError(source, "proxy.admin_port", "must differ from proxy.port")
    seen: set[str] = set()
    listed = [(f"proxy.api_keys[{i}]", e) for i, e in enumerate(proxy.api_keys)]
    listed += [(f"proxy.admin_keys[{i}]", e) for i, e in enumerate(proxy.admin_keys)]
    for where, entry in listed:
        if len(entry.key) < 8 or any(c.isspace() for c in entry.key):
            raise ConfigError(source, where, "a key has at least 8 characters and no spaces")
        if entry.key in seen:
            raise ConfigError(source, where, "duplicate key")
        seen.add(entry.key)
        admin = entry.admin or where.startswith("proxy.admin_keys")
        if admin and entry.models:  # it administers every model: a limit would be a lie
            raise ConfigError(source, f"{where}.models", "an admin key is not limited to models")
        unknown = [m for m in entry.models if m not in models]
        if unknown:
            raise ConfigError(source, f"{where}.models", f"unknown model {unknown[0]!r}")
        check_slo_classes(entry.slo_classes, source, f"{where}.slo_classes")


def api_key_entries(
    args: list[str], files: list[Path], *, admin: bool = False
) -> list[dict[str, Any]]:
    """``--api-key KEY[:MODEL,MODEL...]`` values and ``--api-key-file FILE`` lines
    (the same form, one a line, ``#`` comments) as ``proxy.api_keys`` entries.
    A file keeps keys out of the process list; a key holding ':' goes in the config.
    ``admin``: ``--admin-key KEY`` / ``--admin-key-file``: each line a whole key, an
    admin key (``{key, admin: true}``)."""
    lines = list(args)
    for path in files:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(str(path), "<file>", f"cannot read ({exc.strerror})") from None
        lines += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    entries: list[dict[str, Any]] = []
    if admin:
        return [{"key": line, "admin": True} for line in lines]
    for line in lines:
        key, sep, models = line.partition(":")
        entry: dict[str, Any] = {"key": key}
        if sep:
            entry["models"] = [m.strip() for m in models.split(",") if m.strip()]
        entries.append(entry)
    return entries


def with_api_keys(config: Config, entries: list[dict[str, Any]], source: str) -> Config:
    """``config`` with ``entries`` added to its API keys (validated as in a file)."""
    if not entries:
        return config
    keys = build_section(ProxyConfig, {"api_keys": entries}, source, "proxy").api_keys
    proxy = msgspec.structs.replace(config.proxy, api_keys=config.proxy.api_keys + keys)
    _check_proxy(proxy, list(config.model_names), source)
    return msgspec.structs.replace(config, proxy=proxy)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _check_addresses(addresses: dict[str, str], security: SecurityConfig, source: str) -> None:
    """ipc:// anywhere; tcp:// on the loopback, or anywhere once CURVE is configured."""
    for name, address in addresses.items():
        scheme, _, rest = address.partition("://")
        if scheme == "ipc":
            continue
        if scheme != "tcp":
            raise ConfigError(source, f"addresses.{name}", f"{address!r}: ipc:// or tcp:// only")
        host = rest.rpartition(":")[0]
        if host not in LOOPBACK_HOSTS and security.curve_key_file is None:
            raise ConfigError(
                source, f"addresses.{name}",
                f"{address!r} leaves this host: set security.curve_key_file (CURVE) "
                "or bind tcp:// to 127.0.0.1",
            )  # fmt: skip
    key_file = security.curve_key_file
    if key_file is not None and not key_file.is_file():
        raise ConfigError(source, "security.curve_key_file", f"{key_file} is not a file")


def _check_node(
    node: NodeConfig,
    store: StoreConfig,
    security: SecurityConfig,
    sched: SchedulerConfig,
    source: str,
) -> None:
    """The ``node`` and ``store`` sections (see their docstrings)."""
    if not node.name or any(c in node.name for c in " /:\t\n"):
        raise ConfigError(source, "node.name", f"{node.name!r}: a non-empty name without "
                          "spaces, '/' or ':'")  # fmt: skip
    for field in ("advertise_address", "bind_address"):
        host = getattr(node, field)
        if host is not None and (not host or "://" in host or " " in host):
            raise ConfigError(source, f"node.{field}", f"{host!r}: a host name or IP, no scheme")
    if node.advertise_address is not None and security.curve_key_file is None:
        for host in (node.advertise_address, node.bind_address or node.advertise_address):
            if host not in LOOPBACK_HOSTS and host != "0.0.0.0":
                raise ConfigError(
                    source, "node.advertise_address",
                    f"{host!r} leaves this host: set security.curve_key_file (CURVE) "
                    "or use 127.0.0.1",
                )  # fmt: skip
    if not store.namespace or any(c in store.namespace for c in " :\t\n"):
        raise ConfigError(source, "store.namespace", "a non-empty name without spaces or ':'")
    if store.kind == "redis":
        scheme = store.url.partition("://")[0]
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(source, "store.url", f"{store.url.partition('@')[2] or scheme!r}:"
                              " a redis://, rediss:// or unix:// URL")  # fmt: skip
        if store.password_file is not None and not store.password_file.is_file():
            raise ConfigError(source, "store.password_file", f"{store.password_file} is not a file")
        if node.advertise_address is None:
            raise ConfigError(source, "node.advertise_address", "store.kind redis (many nodes) "
                              "needs the address other machines reach this one at")  # fmt: skip
        if sched.policy != "aegaeon":
            raise ConfigError(source, "scheduler.policy", "many nodes (store.kind redis) run "
                              "the aegaeon policy only; the baselines are single-node")  # fmt: skip


def read_config_file(path: Path | str) -> dict[str, Any]:
    """A config file's plain data: ConfigError unless it can be read, parses as YAML (the
    error's line and column named) and holds a mapping (an empty file: ``{}``); its
    ``instance`` section folded into ``prefill`` and ``decode`` (:func:`fold_instance`),
    so whoever edits or reads a role's section sees what that role runs."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(str(path), "<file>", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "<file>", "a directory, not a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "<file>", f"not text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(str(path), "<file>", f"cannot read ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(str(path), *_yaml_problem(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "<yaml>", f"not valid YAML ({exc})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "<top>", f"must be a mapping of sections (like `proxy: "
                          f"{{port: 8000}}`), not a YAML {_yaml_kind(raw)}")  # fmt: skip
    return fold_instance(raw, str(path))


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(exc: yaml.MarkedYAMLError) -> tuple[str, str]:
    """Where a YAML error is (line and column, as editors count) and what it is, with
    what was open when it happened (``while parsing a flow mapping`` at ...)."""
    mark = exc.problem_mark or exc.context_mark
    problem = " ".join(str(exc.problem or exc.context or "").split())
    if exc.context and exc.context_mark and exc.problem_mark and (
            _at(exc.context_mark) != _at(exc.problem_mark)):
        problem += f" ({exc.context} at {_at(exc.context_mark)})"
    return (_at(mark) if mark else "<yaml>"), f"not valid YAML: {problem}"


def _yaml_kind(value: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number",
            bool: "boolean"}.get(type(value), type(value).__name__)  # fmt: skip


def load_config(path: Path | str) -> Config:
    """Load and validate a YAML config file."""
    path = Path(path)
    raw = read_config_file(path)
    return config_from_dict(raw, source=str(path), base=path.parent.resolve())


def load_config_or_exit(path: Path | str, command: str) -> Config:
    """:func:`load_config` for a command's entry: a bad file is one clean line on
    stderr (``aegaeon COMMAND: FILE: FIELD: problem``) and exit status 2."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"aegaeon {command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # the process's tcp:// sockets use the node's CURVE certificate, if one is set
    from aegaeon_common.transport import configure_security

    key_file = config.security.curve_key_file
    try:
        configure_security(key_file)
    except (OSError, ValueError) as exc:
        print(f"aegaeon {command}: {path}: security.curve_key_file: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return config
