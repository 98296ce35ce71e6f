#!/usr/bin/env python3
"""The images' entrypoint (``aegaeon-container``): one Aegaeon service as this container's PID 1.

    aegaeon-container cachemgr|prefill|decode|proxy   run that service (compose.yaml)
    aegaeon-container plan                           plan the node once (compose's plan)
    aegaeon-container mps                            the CUDA MPS control daemon
    aegaeon-container health [URL]                   GET /health of it (the HEALTHCHECK)
    aegaeon-container ARGS...                        any other ``aegaeon`` command

For a service it writes the deployment's effective config for this container to
``/tmp/aegaeon/config.yaml`` and then *execs* ``aegaeon SERVICE`` (no init above
it: a service whose parent is PID 1 takes itself for orphaned and stops).
Settings, from the environment compose passes:

- ``AEGAEON_CONFIG``: the deployment YAML, or ``embedded``: the embedded default
  of ``aegaeon serve`` (one prefill, one decode instance on the CPU) over
  ``AEGAEON_MARKET``.
- ``AEGAEON_PREFILL_INSTANCES`` / ``AEGAEON_DECODE_INSTANCES``: instance counts
  (override the file's, so ``--scale`` and the config agree); ``AEGAEON_TP``: the
  tensor-parallel size of every instance (``prefill.tp``/``decode.tp``; each worker
  container is then a group of that many GPUs, its followers inside it).
- ``AEGAEON_INDEX``: this worker's instance index. Unset: the compose replica
  number less one (the container's name, ``<project>-<service>-<n>``, found by
  a reverse lookup of its own address on the compose network), else 0.
- ``AEGAEON_HTTP_PORT``: where this container's ``/health``, ``/ready`` and
  ``/metrics`` listen (on 0.0.0.0). Defaults: cachemgr 9100, prefill 9200,
  decode 9300; the proxy serves them on its API port (``proxy.port``). Every
  replica of a kind uses the same port in its own network namespace, so one
  Prometheus DNS lookup per service finds them all.
- ``AEGAEON_GPUS``: ``all`` or CUDA indices (``0,1``): place and size from the
  machine, as ``aegaeon serve --gpus`` (docs/gpu.md). The ``plan`` service plans
  the whole node once, before anything holds GPU memory, and writes
  ``RUN_DIR/planned.yaml`` (``aegaeon plan``, with the cachemgr's /dev/shm from
  ``AEGAEON_SHM_SIZE``); every container reads that one plan. Unset: the file's
  devices and sizes, and ``AEGAEON_KIND_GPUS``; the plan service removes a plan
  an earlier run left.
- ``AEGAEON_KIND_GPUS``: without ``AEGAEON_GPUS``, on a GPU, the devices
  (nvidia-smi numbers) a kind's instances take in turn (instance i: the i-th,
  round robin; ``tp`` consecutive ones for a tensor-parallel instance). Unset:
  prefill i takes device i, decode j device ``prefill instances + j``, modulo the
  devices the container sees (``/dev/nvidia<N>``).

Device numbers mean the same in every container: each worker container sees every
GPU (compose reserves ``count: all``; ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, nvidia-smi's
order) and runs on ``cuda:<N>`` of its config, never on a renumbered
``CUDA_VISIBLE_DEVICES``: a CUDA IPC event names its device by that number. The
cachemgr runs with ``CUDA_VISIBLE_DEVICES=""``: it opens the host mirrors of the
workers' events, no CUDA.

MPS: a worker on a GPU waits up to ``AEGAEON_MPS_WAIT_S`` (default 20) for the
``mps`` service's control pipe in ``RUN_DIR/mps`` and then runs as its client
(``CUDA_MPS_PIPE_DIRECTORY``); without it (``AEGAEON_MPS=0``, or no daemon came
up), it runs without MPS and says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SERVICES = ("cachemgr", "prefill", "decode", "proxy")
WORKERS = ("prefill", "decode")
DEFAULT_PORTS = {"cachemgr": 9100, "prefill": 9200, "decode": 9300}
STATE_DIR = Path("/tmp/aegaeon")
HEALTH_FILE = STATE_DIR / "health-url"
DEFAULT_CONFIG = "/etc/aegaeon/config.yaml"
DEFAULT_MARKET = "/data/market"
DEFAULT_RUN_DIR = "/run/aegaeon"


class SettingError(Exception):
    """A setting this container cannot run with (one line on stderr, exit status 2)."""


def replica_number(container_name: str) -> int | None:
    """The compose replica number in a container name: ``proj-prefill-2`` (compose v2),
    ``proj_prefill_2`` (1.x), ``proj-prefill-2.proj_default`` (a reverse lookup)."""
    match = re.search(r"[-_](\d+)$", container_name.split(".", 1)[0])
    return int(match.group(1)) if match else None


DOCKER_DNS = ("127.0.0.11", 53)  # the embedded resolver of every user-defined network


def _dns_name(packet: bytes, offset: int) -> tuple[str, int]:
    """The (possibly compressed) domain name at ``offset`` and the offset after it."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # a bound on pointer loops
        length = packet[offset]
        if length & 0xC0 == 0xC0:  # a pointer to an earlier name
            end = offset + 2 if end is None else end
            offset = int.from_bytes(packet[offset : offset + 2], "big") & 0x3FFF
        elif length == 0:
            return ".".join(labels), offset + 1 if end is None else end
        else:
            labels.append(packet[offset + 1 : offset + 1 + length].decode())
            offset += 1 + length
    raise ValueError("DNS name loops")


def reverse_lookup(address: str, server: tuple[str, int] = DOCKER_DNS) -> str | None:
    """The PTR name of an IPv4 ``address`` from ``server`` (Docker's DNS knows the
    container's name; /etc/hosts, which the resolver reads first, only its id).

    Asked directly, not through ``socket.gethostbyaddr``: the C resolver answers
    from /etc/hosts first, where Docker writes this address with the container's
    id, never its compose name. One PTR question is all this needs; dnspython
    would ask it the same way and is not in the image."""
    query_id = int.from_bytes(os.urandom(2), "big")
    qname = ".".join(reversed(address.split("."))) + ".in-addr.arpa"
    question = b"".join(bytes([len(p)]) + p.encode() for p in qname.split(".")) + b"\0"
    packet = query_id.to_bytes(2, "big") + bytes.fromhex("0100 0001 0000 0000 0000")
    packet += question + bytes.fromhex("000c 0001")  # PTR, IN
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.sendto(packet, server)
            reply = sock.recv(4096)
        except OSError:
            return None
    if len(reply) < 12 or int.from_bytes(reply[:2], "big") != query_id:
        return None
    answers = int.from_bytes(reply[6:8], "big")
    offset = 12 + len(question) + 4
    for _ in range(answers):
        _, offset = _dns_name(reply, offset)
        rtype = int.from_bytes(reply[offset : offset + 2], "big")
        length = int.from_bytes(reply[offset + 8 : offset + 10], "big")
        if rtype == 12:
            return _dns_name(reply, offset + 10)[0]
        offset += 10 + length
    return None


def own_container_name() -> str | None:
    """This container's name on its compose network (``proj-prefill-2``), or None."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    name = reverse_lookup(address)
    return name.split(".", 1)[0] if name else None


def instance_index(env: Mapping[str, str], container_name: str | None) -> int:
    if env.get("AEGAEON_INDEX", "").strip():
        return int(env["AEGAEON_INDEX"])
    number = replica_number(container_name) if container_name else None
    return number - 1 if number else 0


def gpu_for(kind: str, index: int, prefill_instances: int, env: Mapping[str, str],
            num_devices: int, tp: int = 1) -> list[str] | None:
    """The devices (nvidia-smi numbers) instance ``index`` of ``kind`` runs on (``tp`` of
    them, its group's ranks in order), or None without a GPU."""
    listed = [g.strip() for g in env.get("AEGAEON_KIND_GPUS", "").split(",") if g.strip()]
    if listed:
        return [listed[(index * tp + r) % len(listed)] for r in range(tp)]
    if num_devices <= 0:
        return None
    slot = index if kind == "prefill" else prefill_instances + index
    return [str((slot * tp + r) % num_devices) for r in range(tp)]


def kind_devices(kind: str, count: int, prefill_instances: int, env: Mapping[str, str],
                 num_devices: int, tp: int = 1) -> list[str] | None:
    """Every instance's devices of ``kind`` in turn, as the config's ``devices`` (the
    same list in every replica of the kind), or None without a GPU."""
    groups = [gpu_for(kind, i, prefill_instances, env, num_devices, tp) for i in range(count)]
    if any(g is None for g in groups):
        return None
    return [f"cuda:{d}" for group in groups if group is not None for d in group]


def visible_devices() -> int:
    return sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def plan_path(env: Mapping[str, str]) -> Path:
    """Where the ``plan`` service writes the node's plan (the shared run volume)."""
    return Path(env.get("AEGAEON_RUN_DIR", DEFAULT_RUN_DIR)) / "planned.yaml"


def load_raw(env: Mapping[str, str]) -> dict[str, Any]:
    """The deployment as plain data: with ``AEGAEON_GPUS``, the node's plan (the ``plan``
    service's); else the mounted file, or the embedded default."""
    import yaml

    if env.get("AEGAEON_GPUS", "").strip():
        path = plan_path(env)
        try:
            planned = yaml.safe_load(path.read_text())
        except OSError:
            raise SettingError(f"AEGAEON_GPUS is set but there is no plan at {path} (compose's "
                               "plan service writes it before the other services start: "
                               "see its log)") from None  # fmt: skip
        if not isinstance(planned, dict):
            raise SettingError(f"{path}: not a map")
        return planned
    return load_file(env)


def load_file(env: Mapping[str, str]) -> dict[str, Any]:
    """The mounted file (or the embedded default) as plain data, its paths absolute, its
    ``instance`` section folded into the roles' and ``AEGAEON_TP`` applied."""
    source = env.get("AEGAEON_CONFIG", DEFAULT_CONFIG)
    market = Path(env.get("AEGAEON_MARKET", DEFAULT_MARKET))
    if source == "embedded":
        from aegaeon_cli.serve import default_config_dict

        if not (market / "market.json").is_file():
            raise SettingError(f"no market at {market} (mount one: AEGAEON_MARKET_DIR in compose)")
        return with_tp(default_config_dict(market, 8000), env)
    from aegaeon_common.config import read_config_file

    path = Path(source)
    raw = read_config_file(path)  # ConfigError; `instance`'s keys in each role's section
    # relative paths in the file are relative to it, as load_config reads them
    if raw.get("market"):
        raw["market"] = str((path.parent / str(raw["market"])).resolve())
    for model in raw.get("models") or []:
        if isinstance(model, dict) and model.get("path"):
            model["path"] = str((path.parent / str(model["path"])).resolve())
    return with_tp(raw, env)


def with_tp(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``raw`` with ``AEGAEON_TP`` (if set) as every instance section's ``tp``."""
    text = env.get("AEGAEON_TP", "").strip()
    if not text:
        return raw
    if not text.isdigit() or int(text) < 1:
        raise SettingError(f"AEGAEON_TP={text!r}: a whole number >= 1")
    from aegaeon_cli.machine import with_tp as sections_with_tp

    return sections_with_tp(raw, int(text))


def effective_config(raw: dict[str, Any], kind: str, index: int, port: int,
                     env: Mapping[str, str]) -> dict[str, Any]:
    """``raw`` as this container runs it: shared run dir, instance counts, this
    service's side HTTP server on 0.0.0.0:``port``, the proxy on every interface."""
    out = dict(raw)
    out["run_dir"] = env.get("AEGAEON_RUN_DIR", DEFAULT_RUN_DIR)
    for worker in WORKERS:
        section = dict(out.get(worker) or {})
        count = env.get(f"AEGAEON_{worker.upper()}_INSTANCES", "").strip()
        if count:
            section["instances"] = int(count)
        out[worker] = section
    out["proxy"] = {**(out.get("proxy") or {}), "host": "0.0.0.0"}
    if kind == "cachemgr":
        out["cachemgr"] = {**(out.get("cachemgr") or {}), "http_host": "0.0.0.0",
                           "http_port": port}
    elif kind in WORKERS:
        # instance i binds http_port + i; in its own network namespace every replica
        # takes the same port
        out[kind] = {**out[kind], "http_host": "0.0.0.0", "http_port": port - index}
    return out


def plan_node(env: Mapping[str, str]) -> int:
    """compose's ``plan`` service: with ``AEGAEON_GPUS``, plan the whole node once (every
    instance on the GPUs this container sees, the cachemgr within ``AEGAEON_SHM_SIZE``)
    and write it to :func:`plan_path` for every container; without, remove a plan an
    earlier run left (the file's devices and sizes apply)."""
    path = plan_path(env)
    spec = env.get("AEGAEON_GPUS", "").strip()
    if not spec:
        path.unlink(missing_ok=True)
        print("aegaeon-container plan: AEGAEON_GPUS unset: the config file's devices and "
              "sizes", file=sys.stderr, flush=True)  # fmt: skip
        return 0
    if env.get("AEGAEON_KIND_GPUS", "").strip():
        raise SettingError("AEGAEON_GPUS places every instance: unset AEGAEON_PREFILL_GPUS / "
                           "AEGAEON_DECODE_GPUS (AEGAEON_KIND_GPUS), or AEGAEON_GPUS")
    from aegaeon_cli.machine import Assumed, explicit_counts, planned_yaml, sized
    from aegaeon_cli.plan import docker_size
    from aegaeon_common.config import config_from_dict

    raw = load_file(env)
    for worker in WORKERS:
        count = env.get(f"AEGAEON_{worker.upper()}_INSTANCES", "").strip()
        if count:
            raw[worker] = {**(raw.get(worker) or {}), "instances": int(count)}
    raw["run_dir"] = env.get("AEGAEON_RUN_DIR", DEFAULT_RUN_DIR)
    shm = env.get("AEGAEON_SHM_SIZE", "").strip()
    assumed = Assumed(shm_bytes=docker_size(shm)) if shm else None
    parsed = config_from_dict(raw, source="compose")
    config, out, plan = sized(raw, parsed, spec, explicit_counts(raw), assumed=assumed)
    text = planned_yaml(out, config, plan)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(plan.describe(), file=sys.stderr, flush=True)
    print(f"aegaeon-container plan: wrote {path}", file=sys.stderr, flush=True)
    return 0


def mps_env(env: dict[str, str], wait_s: float | None = None) -> bool:
    """Make this worker a client of the ``mps`` service's daemon when it runs (its
    control pipe in the run volume), waiting up to ``AEGAEON_MPS_WAIT_S`` for it;
    False: no MPS (turned off, or no daemon came up)."""
    if env.get("AEGAEON_MPS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    pipe = Path(env.get("AEGAEON_RUN_DIR", DEFAULT_RUN_DIR)) / "mps"
    wait = float(env.get("AEGAEON_MPS_WAIT_S") or 20.0) if wait_s is None else wait_s
    deadline = time.monotonic() + wait
    while not (pipe / "control").exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe)
    env["CUDA_MPS_LOG_DIRECTORY"] = str(pipe.with_name("mps-log"))
    return True


def run_mps(env: dict[str, str]) -> int:
    """compose's ``mps`` service: the CUDA MPS control daemon in the foreground, its pipe
    directory in the shared run volume (the workers find it there); where the driver has
    no ``nvidia-cuda-mps-control``, say so and end (the workers run without MPS)."""
    import shutil

    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        print("aegaeon-container mps: no nvidia-cuda-mps-control (the NVIDIA Container "
              "Toolkit mounts it with the driver): the workers run without MPS",
              file=sys.stderr, flush=True)  # fmt: skip
        return 0
    pipe = Path(env.get("AEGAEON_RUN_DIR", DEFAULT_RUN_DIR)) / "mps"
    logs = pipe.with_name("mps-log")
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = str(pipe), str(logs)
    os.execvpe(binary, [binary, "-f"], env)
    return 127  # not reached


def service_argv(kind: str, index: int, raw: dict[str, Any], config_path: Path) -> list[str]:
    """The ``aegaeon`` command line of this container's service."""
    argv = ["aegaeon", kind, "--config", str(config_path)]
    if kind not in WORKERS:
        return argv
    from aegaeon_common.config import UNIFIED_POLICIES

    policy = (raw.get("scheduler") or {}).get("policy", "aegaeon")
    if policy in UNIFIED_POLICIES:
        # request-level baselines: every worker is a unified (decode) instance, the
        # prefill containers first (aegaeon_cli.node)
        prefill_instances = int(raw["prefill"].get("instances", 1))
        return [*argv[:1], "decode", *argv[2:], "--index",
                str(index if kind == "prefill" else prefill_instances + index)]
    return [*argv, "--index", str(index)]


def run_service(kind: str, args: list[str], env: dict[str, str]) -> int:
    import yaml

    raw = load_raw(env)
    container = own_container_name()
    index = instance_index(env, container) if kind in WORKERS else 0
    if kind == "proxy":
        port = int((raw.get("proxy") or {}).get("port", 8000))
    else:
        port = int(env.get("AEGAEON_HTTP_PORT") or DEFAULT_PORTS[kind])
    config = effective_config(raw, kind, index, port, env)
    mps = False
    if kind in WORKERS:
        count = int(config[kind].get("instances", 1))
        if index >= count:
            raise SettingError(
                f"{kind} instance {index} (container {container}), but the deployment has "
                f"{count}: the replica count and AEGAEON_{kind.upper()}_INSTANCES must agree "
                f"(compose: set AEGAEON_{kind.upper()}_INSTANCES, or AEGAEON_CPU_"
                f"{kind.upper()}_INSTANCES for the cpu profile, instead of --scale)")
        device = str(config[kind].get("device", "cpu"))
        if device.startswith("cuda") and not config[kind].get("devices"):
            devices = kind_devices(kind, count, int(config["prefill"].get("instances", 1)), env,
                                   visible_devices(), int(config[kind].get("tp", 1)))
            if devices is not None:
                config[kind] = {**config[kind], "devices": devices}
        if device.startswith("cuda"):
            mps = mps_env(env)
    if container and not env.get("AEGAEON_ADVERTISE_HOST"):
        env["AEGAEON_ADVERTISE_HOST"] = container  # resolvable by the compose network's DNS
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    config_path = STATE_DIR / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    HEALTH_FILE.write_text(f"http://127.0.0.1:{port}/health")
    argv = [*service_argv(kind, index, config, config_path), *args]
    devices = (config.get(kind) or {}).get("devices") if kind in WORKERS else None
    print(json.dumps({"event": "container_start", "service": kind, "index": index,
                      "container": container, "argv": argv, "devices": devices, "mps": mps,
                      "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES")}),
          file=sys.stderr, flush=True)  # fmt: skip
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


def health(args: list[str]) -> int:
    """GET /health (of ``args[0]`` or of the service this container started): 0 when 200.

    A 503 that says the service is ``stalled`` (an instance whose compute thread made no
    progress for ``health.stall_s``) also ends that service (SIGKILL to the pid its
    body names, in this container's PID namespace): Docker marks a container unhealthy
    but never restarts it for that, while its ``restart`` policy restarts one that
    exited."""
    if args:
        url = args[0]
    elif HEALTH_FILE.is_file():
        url = HEALTH_FILE.read_text().strip()
    else:
        print("no service started in this container", file=sys.stderr)
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        end_if_stalled(url, exc)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


def end_if_stalled(url: str, answer: urllib.error.HTTPError) -> bool:
    """SIGKILL the service whose /health answered ``answer`` if it says it stalled."""
    try:
        body = json.loads(answer.read() or b"{}")
    except ValueError:
        body = {}
    if answer.code != 503 or not isinstance(body, dict) or body.get("status") != "stalled":
        print(f"{url}: {answer.code}", file=sys.stderr)
        return False
    pid = body.get("pid")
    print(f"{url}: stalled ({body.get('reason')}): ending pid {pid} for a restart",
          file=sys.stderr)
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as exc:
            print(f"{url}: could not end pid {pid}: {exc.strerror}", file=sys.stderr)
            return False
    return True


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "health":
        return health(rest)
    if command == "mps":
        return run_mps(dict(os.environ))
    if command in (*SERVICES, "plan"):
        try:
            if command == "plan":
                return plan_node(dict(os.environ))
            return run_service(command, rest, dict(os.environ))
        except (SettingError, ValueError) as exc:  # ConfigError, PlacementError too
            print(f"aegaeon-container {command}: {exc}", file=sys.stderr)
            return 2
    os.execvp("aegaeon", ["aegaeon", *argv])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
