"""A tensor-parallel instance's bookkeeping without processes: which models it splits, what
each rank binds and copies, and rank 0 moving the group's KV (aegaeon_runtime.tp_shards,
aegaeon_runtime.kv with peers)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from aegaeon_engine import ModelSpec, weight_layout
from aegaeon_engine.tp_layout import tp_layout
from aegaeon_gpumem import EventTable, make_copy_stream
from aegaeon_runtime.kv import KVSpace
from aegaeon_runtime.tp_shards import GroupKVShape, Shards
from engine_support import make_checkpoint


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelSpec]:
    root = tmp_path_factory.mktemp("tp-shards")
    return {v: ModelSpec.from_dir(make_checkpoint(root / v, v, seed=3))
            for v in ("llama-gqa", "qwen2")}  # fmt: skip


def test_a_rank_binds_its_shard_over_its_range_of_the_cache_region(
        specs: dict[str, ModelSpec]) -> None:  # fmt: skip
    for name, spec in specs.items():
        layout = tp_layout(spec, 2, "float32")
        for rank in (0, 1):
            shards = Shards(rank, 2, "float32")
            shards.add(name, spec)
            assert shards.sharded(name) and shards.parts(name) == 2
            assert shards.spec(name).num_heads == spec.num_heads // 2
            whole = weight_layout(spec, "float32").total_bytes
            assert shards.region_bytes(name, whole) == layout.total_bytes
            assert shards.region_range(name, whole) == layout.shard_range(rank)
            group = shards.kv_shape(name)
            assert isinstance(group, GroupKVShape) and group.parts == 2
            # a host block holds both ranks' parts: the device block of one rank, twice
            assert group.block_bytes == 2 * shards.device_kv_shape(name).block_bytes
            assert group.part_bytes == shards.device_kv_shape(name).block_bytes
            # never equal to a whole model's shape of the same numbers
            assert group != shards.device_kv_shape(name).__class__(
                group.num_layers, group.num_kv_heads, group.head_dim, group.block_size,
                group.dtype)  # fmt: skip


def test_one_device_and_models_that_do_not_split_stay_whole(
        specs: dict[str, ModelSpec]) -> None:  # fmt: skip
    spec = specs["llama-gqa"]
    alone = Shards(0, 1, "float32")
    alone.add("m", spec)
    assert not alone.sharded("m") and alone.spec("m") == spec
    assert alone.kv_shape("m") == spec.kv_shape("float32", 16)
    odd = Shards(1, 3, "float32")  # its heads do not split 3 ways: rank 0 runs it whole
    odd.add("m", spec)
    assert not odd.sharded("m") and odd.parts("m") == 1 and odd.spec("m") == spec
    bf16 = Shards(0, 2, "bfloat16")
    bf16.add("m", spec)
    assert bf16.sharded("m") and bf16.kv_shape("m").dtype == "bfloat16"


@dataclass
class _Allocated:
    offsets: list[int]


class _Cache:
    """The cachemgr's host blocks, as a KVSpace asks for them."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.next = 0

    def alloc_blocks(self, shape: object, num_blocks: int) -> _Allocated:
        out = [self.next + k * self.block_bytes for k in range(num_blocks)]
        self.next += num_blocks * self.block_bytes
        return _Allocated(out)


def test_rank_0_moves_every_ranks_part_of_a_block(specs: dict[str, ModelSpec],
                                                   table: EventTable) -> None:
    shards = Shards(0, 2, "float32")
    shards.add("m", specs["llama-gqa"])
    group = shards.kv_shape("m")
    part = group.block_bytes // 2
    region_bytes = 8 * part
    own, peer = torch.zeros(region_bytes, dtype=torch.uint8), torch.zeros(region_bytes,
                                                                          dtype=torch.uint8)
    host = torch.zeros(4 * group.block_bytes, dtype=torch.uint8)
    cache = _Cache(group.block_bytes)
    kv = KVSpace(own, host, cache, make_copy_stream("cpu", table, 0),  # type: ignore[arg-type]
                 make_copy_stream("cpu", table, 1), part * 8, peers=[peer])  # fmt: skip
    try:
        blocks = kv.alloc(group, 2)
        assert kv.capacity_blocks(group) == 8  # device blocks are one part each
        for b in blocks:
            own[b * part:(b + 1) * part] = 1 + b
            peer[b * part:(b + 1) * part] = 101 + b
        offsets, event = kv.swap_out(group, blocks)
        assert event.wait(10)
        for b, h in zip(blocks, offsets, strict=True):  # rank 0's part, then rank 1's
            assert torch.all(host[h:h + part] == 1 + b)
            assert torch.all(host[h + part:h + 2 * part] == 101 + b)
        back = kv.alloc(group, 2)
        assert kv.swap_in(group, offsets, back, None).wait(10)
        for b, h in zip(back, offsets, strict=True):
            assert torch.equal(own[b * part:(b + 1) * part], host[h:h + part])
            assert torch.equal(peer[b * part:(b + 1) * part], host[h + part:h + 2 * part])
        with pytest.raises(ValueError, match="follower's KV region is smaller"):
            KVSpace(own, host, cache, kv.swap_out_stream, kv.swap_in_stream,  # type: ignore[arg-type]
                    part * 8, peers=[peer[:part]])  # fmt: skip
    finally:
        kv.close()

