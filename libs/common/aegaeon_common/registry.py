"""What the nodes and the proxy replicas write in the shared store, and under which keys.

Records are msgspec structs in msgpack with a version field first (new fields
only with defaults), like the wire. Keys (each under the store's namespace):

- ``instances``: set of instance ids (instances add; anyone removes the dead).
- ``instance:{id}``: :class:`InstanceRecord` (who, where, models, profile, load),
  rewritten by the instance every heartbeat, TTL ``store.heartbeat_ttl``.
- ``proxies`` / ``proxy:{id}``: the replicas, likewise (:class:`ProxyRecord`).
- ``req:{request id}``: :class:`RequestMeta` (model, proxy, instance, state,
  tokens sent), by its proxy; TTL the request deadline plus a minute.
- ``proxyreqs:{proxy id}``: set of that replica's open request ids.
- ``pq:{id}:{incarnation}`` / ``dw:{id}:{incarnation}``: the instance's prefill
  queue / decode work list (the ``PrefillQueue`` / ``DecodeWorkList`` itself, a
  msgspec struct: ``aegaeon_sched.shared``), written only by dispatch
  transactions; TTL an hour past the last write.
- ``reap:{proxy id}``: a lease on cleaning up after a dead replica.
- ``modelsettings:{model}``: :class:`ModelSettingsRecord`, a model's live settings
  as the last ``PATCH /v1/aegaeon/models`` on any replica left them; every replica
  applies it (no TTL: a replica that starts takes it too; a deployment that shares
  a Redis with another uses its own ``store.namespace``).
- ``servedmodels``: :class:`ServedModelsRecord`, the models added (``POST
  /v1/aegaeon/models``) and removed (``DELETE``) at run time on any replica;
  every replica follows it (no TTL, as the settings).
- ``unavailablemodels``: :class:`UnavailableModelsRecord`, the models whose
  checkpoint a cachemgr or an instance could not read (quarantined) until a
  ``POST /v1/aegaeon/models/{model}/reload`` lifted it; every replica follows it.
- ``baseline``: a request-level baseline's picture (``aegaeon_sched.shared_baselines``:
  each instance's model and running requests, the queues), written only by its
  decisions' transactions (one node).
- ``epoch``: a random token, written by the first participant that finds it
  absent (no TTL): a store that restarted empty has a new one, and everyone who
  held the old one knows its records were lost (:class:`StoreEpoch`).

An instance id is ``{node}/{kind}-{index}`` (``{kind}-{index}`` on one node).
Queue keys carry the instance's incarnation, so a restarted instance starts
from an empty queue, as the process itself does.

Who rebuilds what after a loss (docs/interfaces.md, "Many nodes"): every record
with a TTL is rewritten by its writer at its next beat; an instance whose id
the ``instances`` index lost adds it again and, when the epoch changed, merges
its own queues back into ``pq:``/``dw:``; a replica rewrites its requests'
metadata; the settings, the served set and the unavailable models (not soft:
nobody re-derives them at once) are written back by every replica that knows
them, the newest version winning (``aegaeon_proxy.cluster.shared_records``).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from aegaeon_common.config import Config, ModelSettings
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.store import MemoryStore, Store

INSTANCES = "instances"
BASELINE = "baseline"
PROXIES = "proxies"
QUEUE_TTL_S = 3600.0


class InstanceLoadInfo(msgspec.Struct, frozen=True):
    """An instance's load at its last heartbeat."""

    active_model: str | None = None
    queued: int = 0  # prefill requests queued (prefill) / requests in the work list
    running: int = 0
    prefill_s: float = 0.0  # seconds spent prefilling since start (hybrid decode share)
    prefill_tokens: int = 0  # prompt tokens prefilled since start (its prefill velocity)
    kv_blocks_in_use: int = 0
    open_sequences: int = 0
    kv_used_bytes: int = 0  # device KV: bytes of live blocks, of the usable region
    kv_capacity_bytes: int = 0
    # the models on its device and its count of changes to them (InstanceStats')
    resident_models: list[str] = msgspec.field(default_factory=list)
    residency_version: int = 0
    velocity: dict[str, float] = msgspec.field(default_factory=dict)  # tokens/s by stage


def load_of(stats: InstanceStats) -> InstanceLoadInfo:
    """An instance's load as its heartbeat (``InstanceStats``) gives it."""
    counters = stats.counters
    return InstanceLoadInfo(
        active_model=stats.active_model, queued=stats.queued, running=stats.running,
        prefill_s=float(counters.get("prefill_s", 0.0)),
        prefill_tokens=int(counters.get("prefill_tokens", 0)),
        kv_blocks_in_use=int(counters.get("kv_blocks_in_use", 0)),
        open_sequences=int(counters.get("open_sequences", 0)),
        kv_used_bytes=int(counters.get("kv_used_bytes", 0)),
        kv_capacity_bytes=int(counters.get("kv_capacity_bytes", 0)),
        resident_models=list(stats.resident_models), residency_version=stats.residency_version,
        velocity=dict(stats.velocity),
    )  # fmt: skip


class InstanceRecord(msgspec.Struct, frozen=True):
    """One instance as the registry holds it (rewritten whole every heartbeat)."""

    v: int
    instance_id: str
    node: str
    kind: str  # "prefill" | "decode"
    index: int
    address: str  # its command socket (tcp://host:port)
    incarnation: int
    pid: int
    capacity_tokens: dict[str, int]  # the models it serves -> device KV room in tokens
    max_batch_size: int
    latency: LatencyProfile | None = None
    http_url: str = ""
    draining: bool = False
    load: InstanceLoadInfo = msgspec.field(default_factory=InstanceLoadInfo)
    # its node's cachemgr: where the replicas send the operator's model flags (and ask
    # for Model Cache stats), and its side HTTP server (health, ready, metrics)
    cachemgr_address: str = ""
    cachemgr_http_url: str = ""

    @property
    def models(self) -> list[str]:
        return sorted(self.capacity_tokens)


def record_of(config: Config, hello: InstanceHello, instance_id: str,
              http_url: str = "") -> InstanceRecord:  # fmt: skip
    """The record of the instance that said ``hello`` (no load yet), as whoever writes
    it (the instance itself with many nodes, one node's proxy for it) writes it."""
    kind, index = hello.kind, hello.index
    return InstanceRecord(
        v=1, instance_id=instance_id, node=config.node.name, kind=kind, index=index,
        address=config.instance_address(kind, index), incarnation=hello.incarnation, pid=hello.pid,
        capacity_tokens=dict(hello.capacity_tokens), max_batch_size=hello.max_batch_size,
        latency=hello.latency, http_url=http_url, cachemgr_address=config.cachemgr_address,
    )  # fmt: skip


class ProxyRecord(msgspec.Struct, frozen=True):
    v: int
    proxy_id: str
    report_address: str  # where instances send this replica's requests' tokens
    pid: int
    host: str = ""
    # prompt tokens/s arriving at this replica (its accepted requests): the roles'
    # decider sums them (``RolesRecord``)
    arrival_tokens_per_s: float = 0.0


class ModelSettingsRecord(msgspec.Struct, frozen=True):
    """A model's live settings, shared by the proxy replicas."""

    v: int
    model: str
    settings: ModelSettings
    proxy: str = ""  # the replica that wrote it
    # which write this is (``cluster.shared_records``: the newest wins, whoever writes
    # it back after a store loss)
    version: int = 0


class ServedModelsRecord(msgspec.Struct, frozen=True):
    """The models added and removed at run time, shared by the proxy replicas: name
    -> its checkpoint directory (added), or None (removed). A model the config
    names and this does not is served as configured."""

    v: int
    models: dict[str, str | None] = msgspec.field(default_factory=dict)
    proxy: str = ""  # the replica that wrote it last
    version: int = 0  # as ModelSettingsRecord's
    # the LoRA adapters among ``models``: name -> the served model it adapts
    bases: dict[str, str] = msgspec.field(default_factory=dict)


SERVED_MODELS = "servedmodels"


class UnavailableModelsRecord(msgspec.Struct, frozen=True):
    """The models whose checkpoint cannot be read, shared by the proxy replicas: name ->
    why (the file and what is wrong). ``lifted``: name -> when (wall clock, seconds) a
    reload last lifted its quarantine; a cachemgr's report asked for before then is old
    news and quarantines nothing."""

    v: int
    models: dict[str, str] = msgspec.field(default_factory=dict)
    lifted: dict[str, float] = msgspec.field(default_factory=dict)
    proxy: str = ""  # the replica that wrote it last
    version: int = 0  # as ModelSettingsRecord's


UNAVAILABLE_MODELS = "unavailablemodels"


class RolesRecord(msgspec.Struct, frozen=True):
    """Which instances take prefill work (with ``roles.enabled``): instance id ->
    ``"prefill"`` or ``"decode"``, decided by the replica holding :data:`ROLES_LEASE`;
    an instance not named keeps its configured role (its kind)."""

    v: int
    roles: dict[str, str] = msgspec.field(default_factory=dict)
    proxy: str = ""  # the replica that decided them
    changes: list[dict[str, Any]] = msgspec.field(default_factory=list)  # the last few


ROLES = "roles"
ROLES_LEASE = "roles-lease"  # held (TTL) by the one replica that decides the roles
EPOCH = "epoch"


REQUEST_STATES = ("queued", "prefilled", "decoding")


class RequestMeta(msgspec.Struct, frozen=True):
    """A request in flight, as any replica may read it (the reaper does)."""

    v: int
    request_id: str
    model: str
    proxy: str
    instance: str  # where it is now ("" while it waits for one)
    state: str  # one of REQUEST_STATES
    tokens_sent: int
    arrival_s: float
    queue: str = ""  # the shared queue key it sits in (pq:... / dw:...), "" while none


def instance_key(instance_id: str) -> str:
    return f"instance:{instance_id}"


def proxy_key(proxy_id: str) -> str:
    return f"proxy:{proxy_id}"


def request_key(request_id: str) -> str:
    return f"req:{request_id}"


def proxy_requests_key(proxy_id: str) -> str:
    return f"proxyreqs:{proxy_id}"


def prefill_queue_key(instance_id: str, incarnation: int) -> str:
    return f"pq:{instance_id}:{incarnation}"


def work_list_key(instance_id: str, incarnation: int) -> str:
    return f"dw:{instance_id}:{incarnation}"


def reap_key(proxy_id: str) -> str:
    return f"reap:{proxy_id}"


def model_settings_key(model: str) -> str:
    return f"modelsettings:{model}"


def instance_id(node: str, kind: str, index: int) -> str:
    """An instance's id in a registry many nodes share: ``{node}/{kind}-{index}``. On
    one node (the proxy writes its instances' records, ``aegaeon_proxy.cluster.
    local_registrar``) the id is ``{kind}-{index}``, the name the node's own
    services, logs and metrics know it by."""
    return f"{node}/{kind}-{index}"


_encoder = msgspec.msgpack.Encoder()


def encode(record: msgspec.Struct) -> bytes:
    return _encoder.encode(record)


# A record's bytes back (``msgspec.DecodeError`` / ``ValidationError`` for a bad one).
decode_instance = msgspec.msgpack.Decoder(InstanceRecord).decode
decode_request = msgspec.msgpack.Decoder(RequestMeta).decode
decode_model_settings = msgspec.msgpack.Decoder(ModelSettingsRecord).decode
decode_served_models = msgspec.msgpack.Decoder(ServedModelsRecord).decode
decode_unavailable_models = msgspec.msgpack.Decoder(UnavailableModelsRecord).decode
decode_roles = msgspec.msgpack.Decoder(RolesRecord).decode


def with_change(raw: bytes | None, name: str, path: str | None, proxy: str,
                version: int = 0, base: str | None = None) -> ServedModelsRecord:
    """The shared record ``raw`` (None: none yet) with ``name`` added at ``path`` (a LoRA
    adapter: of ``base``) or, with None, removed."""
    record = decode_served_models(raw) if raw is not None else ServedModelsRecord(v=1)
    bases = {n: b for n, b in record.bases.items() if n != name}
    if path is not None and base is not None:
        bases[name] = base
    return ServedModelsRecord(v=1, models={**record.models, name: path}, proxy=proxy,
                              version=version, bases=bases)  # fmt: skip


def with_unavailable(raw: bytes | None, name: str, why: str | None, asked_at: float,
                     proxy: str, version: int = 0) -> UnavailableModelsRecord | None:  # fmt: skip
    """The shared record ``raw`` with ``name`` unavailable (``why``, from a report asked
    for at ``asked_at``) or lifted (None, by a reload that began at ``asked_at``); None
    when that changes nothing (already there, or a report older than the last lift)."""
    record = (decode_unavailable_models(raw) if raw is not None
              else UnavailableModelsRecord(v=1))  # fmt: skip
    models, lifted = dict(record.models), dict(record.lifted)
    if why is None:
        lifted[name] = max(asked_at, lifted.get(name, 0.0))
        models.pop(name, None)
    elif name in models or asked_at < lifted.get(name, 0.0):
        return None
    else:
        models[name] = why
    return UnavailableModelsRecord(v=1, models=models, lifted=lifted, proxy=proxy,
                                   version=version)  # fmt: skip


def served_changes(record: ServedModelsRecord,
                   applied: dict[str, str | None]) -> list[tuple[str, str | None]]:  # fmt: skip
    """What ``record`` changed since ``applied`` (what a replica applied last): (name,
    path) added, (name, None) removed, in the record's order."""
    return [(n, p) for n, p in record.models.items() if n not in applied or applied[n] != p]


def decode_baseline(raw: bytes | None) -> Any:
    """The request-level baseline's stored picture (the :data:`BASELINE` key) as plain
    data (``aegaeon_sched.shared_baselines``); None for an absent key. (``pq:`` /
    ``dw:`` decode into their queues: ``aegaeon_sched.shared``.)"""
    return None if raw is None else msgspec.msgpack.decode(raw)


def encode_baseline(state: Any) -> bytes:
    return msgspec.msgpack.encode(state)


class StoreEpoch:
    """Which life of the store this is (the ``epoch`` key): tells a store that restarted
    empty from one that was only slow or paused (its records expired, nothing lost)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.value: bytes | None = None

    async def check(self) -> bool:
        """Read the epoch, writing a new one if it is absent; True when it differs from the
        one read last (never at the first read). Raises ``StoreError``."""
        raw = await self.store.get(EPOCH)
        if raw is None:
            mine = secrets.token_hex(8).encode()

            def take(values: list[bytes | None]) -> tuple[dict[str, bytes | None], bytes]:
                found = values[0]
                return ({EPOCH: mine}, mine) if found is None else ({}, found)

            raw = await self.store.transact([EPOCH], take)
        changed = self.value is not None and raw != self.value
        self.value = raw
        return changed


def open_store(config: Config) -> Store:
    """The store ``config.store`` names (not yet started)."""
    if config.store.kind == "redis":
        from aegaeon_common.store_redis import RedisStore

        return RedisStore(config.store.url, config.store.namespace, config.store.password_file)
    return MemoryStore()
