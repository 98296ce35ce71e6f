"""The engine's decode step over static inputs, replayed from a CUDA graph.

``GraphDecoder`` ties graphs.py's table (which graph, when to capture, when to
run eager) to the step itself: a bound model's slot is its layout key and the
address of its weights; each captured size runs model.forward over the static
inputs (cuda_graphs.StaticInputs) with the engine's kernels, attention reading
the lengths from the device, and writes float32 logits the caller copies out
(sampling runs outside the graph). The rope table is built to the model's
whole window before anything is captured, so it never moves under a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import torch

from .attention import Attention
from .cuda_graphs import StaticInputs
from .graphs import GraphSlot, GraphTable
from .model import KVViews, LayerOps, Tokens, forward, logits
from .rope import RopeTable
from .spec import ModelSpec
from .weights import ModelWeights


def layout_key(spec: ModelSpec, dtype: str, block_size: int, kernels: str) -> Hashable:
    """What a graph bakes in besides addresses: every field of ``spec`` but its name (two
    models of one architecture share graphs), the dtype, block size and kernels."""
    return (dataclasses.replace(spec, name=""), dtype, block_size, kernels)


@dataclasses.dataclass(frozen=True)
class _Model:
    spec: ModelSpec
    weights: ModelWeights
    kv: KVViews
    rope: torch.Tensor  # [2, max_model_len, D]: never grown after this


class GraphDecoder:
    """A decode step on graphs for whatever model is bound (module docstring)."""

    def __init__(self, table: GraphTable[torch.Tensor], device: torch.device,
                 block_size: int) -> None:
        self.table = table
        self.device = device
        self.block_size = block_size
        self._inputs: dict[int, StaticInputs] = {}  # block table width -> inputs
        self._model: _Model | None = None
        self._kv_ptr: int | None = None

    def slot_of(self, spec: ModelSpec, dtype: str, weights: ModelWeights,
                kernels: str) -> GraphSlot:
        return GraphSlot(layout_key(spec, dtype, self.block_size, kernels),
                         weights.embed_tokens.data_ptr())

    def bind(self, spec: ModelSpec, dtype: str, weights: ModelWeights, kv: KVViews,
             rope: RopeTable, kernels: str, ready: object | None = None) -> None:
        """``spec``'s weights are bound (their bytes there once ``ready`` fires)."""
        self._check_region(kv)
        table = rope.ensure(spec.max_model_len)  # before any capture: it never moves again
        self._model = _Model(spec, weights, kv, table)
        self.table.bind(self.slot_of(spec, dtype, weights, kernels), ready)

    def _check_region(self, kv: KVViews) -> None:
        """Every graph reads the KV region where it was: one that moved drops them all."""
        region = kv.blocks.data_ptr()  # a model's view covers its whole blocks only
        if self._kv_ptr is not None and region != self._kv_ptr:
            self.table.invalidate("the KV region moved")
        self._kv_ptr = region

    def unbind(self) -> None:
        self._model = None
        self.table.unbind()

    def capture(self, spec: ModelSpec, dtype: str, weights: ModelWeights, kv: KVViews,
                rope: RopeTable, ops: LayerOps, attention: Attention) -> bool:
        """Capture the graphs of the slot ``weights`` are views in, for ``spec``'s layout,
        without binding it (start-up, ``AddModel``): the bytes there may be another
        model's; the warm-ups write nothing and their outputs are dropped. False if
        the capture failed (the step of that slot then runs eager)."""
        self._check_region(kv)
        m = _Model(spec, weights, kv, rope.ensure(spec.max_model_len))
        slot = self.slot_of(spec, dtype, weights, attention.decode_kernel)
        if self.table.has(slot):
            return True
        inputs = self._static(m)
        inputs.stage_null(self.table.max_size)
        return self.table.capture(slot, self._maker(m, inputs, ops, attention))

    def _static(self, m: _Model) -> StaticInputs:
        width = min(-(-m.spec.max_model_len // self.block_size), m.kv.blocks.shape[0])
        inputs = self._inputs.get(width)
        if inputs is None:
            inputs = self._inputs[width] = StaticInputs(self.table.max_size, width, self.device)
        return inputs

    def decode(self, token_ids: Sequence[int], positions: Sequence[int],
               block_ids: Sequence[Sequence[int]], ops: LayerOps,
               attention: Attention) -> torch.Tensor | None:
        """float32 logits ``[B, vocab]`` of one step on the bound slot's graph (captured
        now if the slot has none), or None: the caller runs the step eager."""
        m = self._model
        if m is None:
            return None
        inputs = self._static(m)
        make_run = self._maker(m, inputs, ops, attention)
        slot = self.table.bound
        if slot is not None and not self.table.has(slot):
            inputs.stage_null(self.table.max_size)  # the warm-ups write nothing
            self.table.capture(slot, make_run)
        size = self.table.round_up(len(token_ids))
        if size is not None:
            inputs.stage(token_ids, positions, block_ids, self.block_size, size)
        result = self.table.replay(len(token_ids), make_run)
        if result is None:
            return None
        return result[1][:len(token_ids)].clone()  # the static output is the next step's too

    @staticmethod
    def _maker(m: _Model, inputs: StaticInputs, ops: LayerOps,
               attention: Attention) -> Callable[[int], Callable[[], torch.Tensor]]:
        def make_run(size: int) -> Callable[[], torch.Tensor]:
            ids, pos, slot_blocks, slot_offsets, context_lens, table = inputs.views(size)

            def run() -> torch.Tensor:
                step = Tokens(ids, None, None, slot_blocks, slot_offsets, positions=pos,
                              rope=m.rope)
                attend = attention.paged_decode(m.kv, m.spec.num_heads, table, context_lens,
                                                None)
                return logits(m.weights, forward(m.weights, m.kv, step, attend, ops), ops)

            return run

        return make_run
