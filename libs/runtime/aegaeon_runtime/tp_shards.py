"""Which models a tensor-parallel instance shards, and what each rank holds of them.

A model that splits ``size`` ways (``aegaeon_engine.tp_layout.sharded_layout``:
its heads and intermediate size divide, float weights) is held in the Model
Cache as its shards back to back, and rank ``r`` binds its shard spec over its
own contiguous range of that region. Any other model (SmolLM2-135M's 9 heads
at size 2, quantized blocks, FP8) is held whole and runs on rank 0 alone; the
followers idle while it is active.

KV of a sharded model: each rank's device blocks hold its own kv heads (the
shard's ``kv_shape``) at the same block ids on every rank. Its host blocks in
the unified CPU cache hold the ranks' parts back to back (rank ``r`` at
``r x`` the part's bytes): the *group shape*, the shard's shape with
``size x`` its kv heads (a model with fewer kv heads than ranks repeats the
head each rank reads). Every instance of a node has the same ``tp``
(the config checks it), so producer and consumer agree on that layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aegaeon_engine import KVShape, ModelSpec
from aegaeon_engine.tp_layout import TPLayout, shard_spec, sharded_layout


@dataclass(frozen=True)
class GroupKVShape(KVShape):
    """A sharded model's KV shape to the node (``block_bytes``: a host block, every
    rank's part) that says it is ``parts`` device blocks, one on each rank, each of
    ``block_bytes // parts`` bytes (``aegaeon_runtime.kv.KVSpace``). It never equals
    a whole model's shape of the same numbers: their device blocks differ."""

    parts: int = 1

    @property
    def part_bytes(self) -> int:
        """One rank's device block."""
        return self.block_bytes // self.parts


@dataclass
class Shards:
    """Rank ``rank`` of ``size``: each model's spec, region range and KV shapes here."""

    rank: int = 0
    size: int = 1
    dtype: str = "bfloat16"
    block_size: int = 16
    _layouts: dict[str, TPLayout | None] = field(default_factory=dict)
    _specs: dict[str, ModelSpec] = field(default_factory=dict)

    def add(self, name: str, spec: ModelSpec) -> None:
        """Decide ``name``'s split (again, when a model of that name comes back)."""
        self._specs[name] = spec
        self._layouts[name] = sharded_layout(spec, self.size, self.dtype)

    def sharded(self, name: str) -> bool:
        """True when the group splits ``name`` (every rank runs it)."""
        return self._layouts.get(name) is not None

    def parts(self, name: str) -> int:
        """How many ranks hold a part of ``name``'s weights and KV (1: rank 0 alone)."""
        return self.size if self.sharded(name) else 1

    def spec(self, name: str) -> ModelSpec:
        """What this rank binds of ``name``: its shard's spec, or the whole model's."""
        spec = self._specs[name]
        return shard_spec(spec, self.rank, self.size) if self.sharded(name) else spec

    def region_bytes(self, name: str, whole: int) -> int:
        """The bytes of ``name``'s Model Cache region (``whole``: its one-device layout)."""
        layout = self._layouts.get(name)
        return layout.total_bytes if layout is not None else whole

    def region_range(self, name: str, whole: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's bytes in ``name``'s Model Cache region."""
        layout = self._layouts.get(name)
        return layout.shard_range(self.rank) if layout is not None else (0, whole)

    def device_kv_shape(self, name: str) -> KVShape:
        """The KV blocks this rank's engine reads and writes for ``name``."""
        return self.spec(name).kv_shape(self.dtype, self.block_size)

    def kv_shape(self, name: str) -> KVShape:
        """``name``'s KV shape to the rest of the node: its host blocks (a sharded
        model's :class:`GroupKVShape`, see the module docstring), what a request's KV is
        allocated and counted in."""
        shape = self.device_kv_shape(name)
        parts = self.parts(name)
        if parts == 1:
            return shape
        return GroupKVShape(shape.num_layers, shape.num_kv_heads * parts, shape.head_dim,
                            shape.block_size, shape.dtype, parts)  # fmt: skip
