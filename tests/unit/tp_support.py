"""Run tensor-parallel groups of real processes for the tests (and scripts/gpu-check).

``run_group`` hosts a TCPStore on a free port (port 0: the kernel picks it, so
no two groups race for one), starts ``size`` ranks as ``python tp_support.py
ARGS.json`` (JSON in, JSON out: nothing pickled), waits for all of them and
returns rank 0's results. A rank's jobs (``JOBS``):

- ``greedy``: load the rank's shard straight from the checkpoint, greedy
  tokens of the prompts (prefill each, then batched decode);
- ``logits``: the same load in ``dtype``, a prompt's last logits;
- ``switch``: a TP model's shard copied from a Model Cache file (every shard
  back to back, ``fill_tp_layout``) into the rank's one weight buffer; part of
  its decode, then rank 0 alone switches to a single-device model (its bytes
  into the same buffer) and decodes it, then the group switches back and
  finishes the TP model's sequences from their KV; with ``mirror`` the same
  driven by rank 0 alone through ``TPDriver``, the other ranks in ``follow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

Job = dict[str, Any]


def run_group(size: int, jobs: Sequence[Job], work_dir: Path, device: str = "cpu",
              timeout_s: float = 300.0) -> list[Any]:
    """Run ``jobs`` on a ``size``-rank group; rank 0's result of each job, in order.
    ``device`` ``cpu`` runs every rank on the CPU over gloo, ``cuda`` rank ``r`` on
    ``cuda:r`` over NCCL.

    A rank that fails ends the others at once (they would wait in a collective);
    each rank's output is in ``work_dir/rank<r>.log``, quoted on failure."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    procs: list[subprocess.Popen[bytes]] = []
    outs = [work_dir / f"rank{r}.json" for r in range(size)]
    logs = [work_dir / f"rank{r}.log" for r in range(size)]
    try:
        for rank in range(size):
            args = {"port": store.port, "rank": rank, "size": size, "device": device,
                    "jobs": list(jobs), "out": str(outs[rank])}
            arg_file = work_dir / f"rank{rank}-args.json"
            arg_file.write_text(json.dumps(args))
            with logs[rank].open("wb") as log:
                procs.append(subprocess.Popen([sys.executable, __file__, str(arg_file)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # a rank still running: past the deadline, or a peer failed
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            tail = logs[rank].read_text(errors="replace")[-4000:]
            raise AssertionError(f"rank {rank} of {size} exited {p.returncode}:\n{tail}")
    results: list[Any] = json.loads(outs[0].read_text())
    return results


# -- inside a rank ---------------------------------------------------------------------------


def _greedy(engine: Any, prompts: Sequence[Sequence[int]], num_tokens: int,
            blocks: Sequence[Sequence[int]]) -> list[list[int]]:
    from engine_support import greedy

    return greedy(engine, prompts, num_tokens, blocks)


def _kv_region(spec: Any, dtype: str, num_blocks: int, device: str) -> torch.Tensor:
    return torch.zeros(num_blocks * spec.kv_shape(dtype).block_bytes, dtype=torch.uint8,
                       device=device)


def _bind_own_shard(group: Any, engine: Any, model_dir: str, dtype: str,
                    kv_blocks: int) -> None:  # fmt: skip
    """This rank's shard of ``model_dir`` read from the checkpoint and bound, with a KV
    region of ``kv_blocks`` blocks."""
    from aegaeon_engine import ModelSpec
    from aegaeon_engine.tp import bind_shard, load_shard
    from aegaeon_engine.tp_layout import shard_spec, tp_layout

    spec = ModelSpec.from_dir(model_dir)
    layout = tp_layout(spec, group.size, dtype)
    weights = torch.empty(layout.shards[group.rank].total_bytes, dtype=torch.uint8,
                          device=group.device)
    load_shard(model_dir, spec, layout, group.rank, weights)
    kv = _kv_region(shard_spec(spec, group.rank, group.size), dtype, kv_blocks,
                    str(group.device))  # fmt: skip
    bind_shard(engine, spec, weights, kv, group, dtype)


def _job_greedy(group: Any, engine: Any, job: Job) -> Any:
    _bind_own_shard(group, engine, job["model_dir"], job.get("dtype", "float32"), 64)
    return _greedy(engine, job["prompts"], job["num_tokens"], job["blocks"])


def _job_logits(group: Any, engine: Any, job: Job) -> Any:
    """The float32 logits of a prompt's last position, the model served in ``dtype``."""
    _bind_own_shard(group, engine, job["model_dir"], job["dtype"], 8)
    return engine.prefill(job["prompt"], job["blocks"]).float().cpu().tolist()


def _read_range(path: str, start: int, stop: int, dest: torch.Tensor) -> None:
    """A Model Cache's range ``[start, stop)`` into ``dest`` (a rank copying its shard)."""
    host = torch.empty(stop - start, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(start)
        f.readinto(host.numpy().data)
    dest[:stop - start].copy_(host)


def _job_switch(group: Any, engine: Any, job: Job) -> Any:
    from aegaeon_engine import ModelSpec, weight_layout
    from aegaeon_engine.tp import bind_shard
    from aegaeon_engine.tp_layout import TPLayout, shard_spec
    from aegaeon_engine.tp_mirror import TPDriver, follow

    dtype, dev = "float32", str(group.device)
    tp_spec = ModelSpec.from_dir(job["tp_model_dir"])
    tp = TPLayout.from_json(Path(job["tp_cache"] + ".layout.json").read_text())
    one_spec = ModelSpec.from_dir(job["one_model_dir"])
    one = weight_layout(one_spec, dtype)
    # one weight buffer per rank, as a device's: each switch overwrites it
    buffer = torch.empty(max(one.total_bytes, *(s.total_bytes for s in tp.shards)),
                         dtype=torch.uint8, device=dev)
    kv_tp = _kv_region(shard_spec(tp_spec, group.rank, group.size), dtype, 32, dev)
    kv_one = _kv_region(one_spec, dtype, 32, dev)

    def bind(model: int) -> bool:
        """Model 0: the TP model, every rank its own range of the cache; model 1: the
        single-device model, on rank 0's device alone."""
        if model == 0:
            _read_range(job["tp_cache"], *tp.shard_range(group.rank), buffer)
            bind_shard(engine, tp_spec, buffer, kv_tp, group, dtype)
            return True
        if group.rank == 0:
            _read_range(job["one_cache"], 0, one.total_bytes, buffer)
            engine.bind(one_spec, buffer, kv_one, dtype)
        return False

    if not job.get("mirror"):  # every rank runs the script (SPMD)
        return _switch_script(engine, bind, job, run_one=group.rank == 0)
    if group.rank != 0:  # rank 0 drives (TPDriver), the others mirror its calls
        follow(engine, group, bind)
        return {}
    driver = TPDriver(engine, group, bind)
    try:
        driver.bind(0)
        try:  # a call the engine refuses leaves the group in step
            driver.prefill([3, 4, 5], [10**6])
            raise AssertionError("a block id out of the KV region was accepted")
        except ValueError:
            pass
        return _switch_script(driver, driver.bind, job, run_one=True)
    finally:
        driver.close()


def _switch_script(engine: Any, bind: Callable[[int], object], job: Job,
                   run_one: bool) -> dict[str, list[list[int]]]:
    """The TP model's decode interrupted by the single-device model's (if ``run_one``)."""
    from engine_support import decode_step

    prompts, blocks, steps = job["tp_prompts"], job["tp_blocks"], job["num_tokens"]
    bind(0)
    outs = [[int(engine.prefill(p, b).argmax())] for p, b in zip(prompts, blocks, strict=True)]
    for _ in range(steps // 2 - 1):
        outs = decode_step(engine, prompts, outs, blocks)
    one_outs: list[list[int]] = []
    if run_one:
        bind(1)
        one_outs = _greedy(engine, job["one_prompts"], steps, job["one_blocks"])
    bind(0)
    for _ in range(steps - steps // 2):
        outs = decode_step(engine, prompts, outs, blocks)
    return {"tp": outs, "one": one_outs}


JOBS: dict[str, Callable[[Any, Any, Job], Any]] = {
    "greedy": _job_greedy, "logits": _job_logits, "switch": _job_switch}


def main(arg_file: str) -> int:
    from aegaeon_engine import Engine
    from aegaeon_engine.tp import join_group, leave_group

    args = json.loads(Path(arg_file).read_text())
    store = TCPStore("127.0.0.1", args["port"], is_master=False)
    device = args["device"]  # "cuda": rank r on cuda:r (NCCL); "cpu": gloo
    device = f"cuda:{args['rank']}" if device == "cuda" else device
    group = join_group(store, args["rank"], args["size"], device, timeout_s=120)
    try:
        engine = Engine(group.device)
        results = [JOBS[job["kind"]](group, engine, job) for job in args["jobs"]]
    finally:
        leave_group()
    out = Path(args["out"])
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False) as f:
        json.dump(results, f)
    os.replace(f.name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
