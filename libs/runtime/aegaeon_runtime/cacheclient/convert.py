"""Message forms of the values workers hand the cachemgr: KV shapes and transfer events."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_gpumem import EventHandle


class ShapeLike(Protocol):
    """``KVShapeSpec`` or the engine's ``KVShape``."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...


EventLike = EventSpec | EventHandle | Mapping[str, Any]


def to_shape(shape: ShapeLike) -> KVShapeSpec:
    if isinstance(shape, KVShapeSpec):
        return shape
    return KVShapeSpec(
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        shape.block_size,
        str(shape.dtype).removeprefix("torch."),
    )


def to_event(event: EventLike) -> EventSpec:
    """An event in its message form (from a gpumem ``EventHandle`` or its dict form)."""
    if isinstance(event, EventSpec):
        return event
    handle = event if isinstance(event, EventHandle) else EventHandle.from_dict(event)
    return EventSpec(**dataclasses.asdict(handle))
