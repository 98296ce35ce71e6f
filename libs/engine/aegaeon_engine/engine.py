"""The engine: made once per process, bound to any model by views.

Everything model-agnostic (thread setup, attention kernels, rope tables keyed
by their parameters, layouts keyed by spec) lives across ``bind`` calls, so
switching to a model seen before costs the construction of a few hundred
tensor views (paper §5.1, component reuse). Weights and KV live in memory the
caller owns (§5.2); the engine never allocates either.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .attention import Attention
from .graph_step import GraphDecoder, layout_key
from .graphs import DEFAULT_SIZES, Capturer, GraphStats, GraphTable
from .isa import cpu_model, supported_levels
from .kernels import NATIVE_MAX_ROWS, LayerStack, NativeOps, layer_ops
from .layout import WeightLayout, weight_layout
from .model import AttendFn, KVViews, LayerOps, ReduceFn, Tokens, forward, logits
from .native import bf16_native, forced_isa, native_ops
from .quant import embed
from .rope import RopeTable
from .sampling import TokenLogprobs, top_logprobs
from .spec import KVShape, ModelSpec, RopeSpec, canonical_dtype
from .tuning import TORCH, KernelChoice, choose, shape_key
from .weights import TORCH_DTYPES, ModelWeights, bind_weights

log = logging.getLogger(__name__)
SCORE_CHUNK = 128  # prompt positions whose logits exist at once (prefill_scored)


def _triton_reason(device: torch.device, asked: bool | None) -> str | None:
    """Why the engine on ``device`` does not run the Triton kernels (None: it does);
    ``asked`` True and a reason is an error."""
    from .gpu import triton_problem

    if asked is False:
        return "off"
    if asked is None and device.type != "cuda":
        return "the CPU runs its own kernels"
    problem = triton_problem(device.type)
    if asked and problem is not None:
        raise ValueError(f"Triton kernels asked for on {device}, but {problem}")
    if problem is not None:
        log.warning("the CUDA engine runs torch kernels: %s", problem)
    return problem


@functools.cache
def _log_start(isa: str | None) -> None:
    """One line per process and level: the CPU, the kernels' level, the compute dtype."""
    log.info("engine on %s (levels %s): kernels %s, bfloat16 arithmetic in %s", cpu_model(),
             ", ".join(supported_levels()) or "none", isa or "torch",
             "bfloat16" if isa is None or bf16_native(isa) else "float32")


class DecodeSeq(NamedTuple):
    """One sequence of a decode step: its newest token, that token's position, its blocks."""

    token_id: int
    position: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class _Bound:
    spec: ModelSpec
    weights: ModelWeights
    kv: KVViews
    kv_shape: KVShape
    rope: RopeTable
    reduce: ReduceFn | None = None  # a tensor-parallel shard's all-reduce (tp.py)
    # per kernel set (NativeOps): the layers as decode_layers' arguments, or None where
    # some projection does not run on that set's kernels
    stacks: dict[int, LayerStack | None] = field(default_factory=dict)


class Engine:
    """Prefill and batched decode over a paged KV cache for one bound model at a time."""

    def __init__(self, device: str | torch.device = "cpu", num_threads: int | None = 1,
                 block_size: int = 16, native: bool = True, isa: str | None = None, *,
                 triton: bool | None = None, graphs: bool | None = None,
                 graph_sizes: Sequence[int] = DEFAULT_SIZES,
                 capturer: Capturer | None = None) -> None:
        """``num_threads`` sets torch's intra-op threads for the process (None: leave it);
        ``native=False`` keeps the torch path where the native kernels load; ``isa``
        runs that level's kernels (default: ``native_isa()``, see native.py).

        ``triton``: the Triton kernels (gpu/; default: on CUDA where Triton imports; on
        the CPU only when asked, under ``TRITON_INTERPRET=1``). ``graphs``: decode steps
        replay CUDA graphs of ``graph_sizes`` (graphs.py; default: on CUDA with the
        Triton kernels); ``capturer`` captures them (default: CUDA graphs on CUDA, else
        the eager capturer, which runs the same static step without a graph)."""
        self.device = torch.device(device)
        self.block_size = block_size
        # a decode step's layers in one native call where they all run natively
        # (kernels.py decode_layers); False: model.forward's loop, call by call
        self.fuse_layers = True
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.triton_reason = _triton_reason(self.device, triton)
        use_triton = self.triton_reason is None
        self.attention = Attention(self.device, native, isa, triton=use_triton)
        if use_triton:
            from .gpu.ops import TritonOps

            self.ops: LayerOps = TritonOps()
        else:
            self.ops = layer_ops(self.device, native, isa)
        self.graphs, self._graphs_off = self._make_graphs(graphs, graph_sizes, capturer)
        # the kernels a model's measured choice (tune) replaces these with, per shape
        self._tunable = (self.device.type == "cpu" and isinstance(self.ops, NativeOps)
                         and isa is None and forced_isa() is None)
        self._default = (self.attention, self.ops)
        self._choices: dict[tuple[object, ...], KernelChoice] = {}
        self._kernels: dict[tuple[str, str, str], tuple[Attention, LayerOps]] = {}
        if self.device.type == "cpu":
            _log_start(self.isa if self.native_kernels else None)
        self._ropes: dict[tuple[int, RopeSpec, int, torch.dtype], RopeTable] = {}
        self._layouts: dict[tuple[ModelSpec, str], WeightLayout] = {}
        self._bound: _Bound | None = None

    # -- kernels ---------------------------------------------------------------------------

    def _make_graphs(self, graphs: bool | None, sizes: Sequence[int],
                     capturer: Capturer | None) -> tuple[GraphDecoder | None, str]:
        """The graph decoder (None, and why, where decode steps run eager)."""
        on_cuda = self.device.type == "cuda"
        if graphs is False or (graphs is None and not on_cuda):
            return None, "graphs are off" if graphs is False else "CUDA graphs need CUDA"
        if self.attention.native is not None:
            return None, "the CPU's native kernels run eager"
        if on_cuda and not self.attention.triton:
            why = f"CUDA graphs need the Triton kernels: {self.triton_reason}"
            log.warning("decode steps run eager: %s", why)
            return None, why
        if capturer is None:
            from .cuda_graphs import CudaCapturer, EagerCapturer

            capturer = CudaCapturer(self.device) if on_cuda else EagerCapturer()
        return GraphDecoder(GraphTable(capturer, sizes), self.device, self.block_size), ""

    @property
    def graph_stats(self) -> GraphStats:
        """What the decode step's graphs did (``enabled`` false, and why, without them)."""
        if self.graphs is None:
            return GraphStats(enabled=False, sizes=(), disabled_reason=self._graphs_off)
        return self.graphs.table.stats

    def graph_addresses(self, spec: ModelSpec, dtype: str | None = None) -> list[int]:
        """Addresses of the weights arena where a model of ``spec``'s layout has graphs
        (the most recently used first): where a switch should copy it."""
        if self.graphs is None:
            return []
        dtype_name = canonical_dtype(dtype or spec.dtype)
        key = layout_key(spec, dtype_name, self.block_size, self.attention.decode_kernel)
        return self.graphs.table.addresses(key)

    @torch.inference_mode()
    def capture_graphs(self, spec: ModelSpec, weights: torch.Tensor, kv_region: torch.Tensor,
                       dtype: str | None = None) -> bool:
        """Capture the decode step's graphs for ``spec`` with its weights at ``weights`` (the
        arena bytes where a switch will copy it; what is there now is not read for
        anything kept) before its first step: start-up and ``AddModel`` pay the capture,
        not a served step. The bound model stays bound. False without graphs or when
        the capture failed (graphs.py logs why)."""
        if self.graphs is None:
            return False
        dtype_name = canonical_dtype(dtype or spec.dtype)
        views = bind_weights(spec, self.layout(spec, dtype_name), weights)
        kv = KVViews.over(kv_region, spec, self.block_size, views.dtype)
        return self.graphs.capture(spec, dtype_name, views, kv, self._rope(spec, views.dtype),
                                   self.ops, self.attention)

    def _rope(self, spec: ModelSpec, dtype: torch.dtype) -> RopeTable:
        key = (spec.head_dim, spec.rope, spec.max_model_len, dtype)
        rope = self._ropes.get(key)
        if rope is None:
            rope = self._ropes[key] = RopeTable(spec.head_dim, spec.rope, spec.max_model_len,
                                                dtype, self.device)
        return rope

    def default_choice(self, dtype: torch.dtype) -> KernelChoice:
        """The kernels used without a measurement: the chosen level for every operation,
        bfloat16 prefill GEMMs in the CPU's own rule (tuning.py)."""
        ops = self._default[1]
        level = ops.isa if isinstance(ops, NativeOps) else TORCH
        widen = isinstance(ops, NativeOps) and ops.widen_prefill and dtype == torch.bfloat16
        prefill = "float32" if widen or dtype == torch.float32 else str(dtype).split(".")[-1]
        return KernelChoice(level, prefill, self._default[0].isa or TORCH)

    def tune(self, spec: ModelSpec, dtype: str | None = None) -> KernelChoice:
        """The fastest kernels for ``spec`` on this machine (tuning.py: measured once per
        machine and shape, kept on disk), used whenever a model of its shape is bound.
        Without anything to choose (CUDA, the torch path, a forced level) the defaults."""
        torch_dtype = TORCH_DTYPES[canonical_dtype(dtype or spec.dtype)]
        key = shape_key(spec, torch_dtype)
        if key not in self._choices:
            default = self.default_choice(torch_dtype)
            self._choices[key] = (choose(spec, torch_dtype, supported_levels(), default)
                                  if self._tunable and torch_dtype != torch.float16
                                  else default)
        m = self._bound
        if self._tunable and m is not None and shape_key(m.spec, m.weights.dtype) == key:
            self._use(self._choices[key])
        return self._choices[key]

    def _use(self, choice: KernelChoice | None) -> None:
        """Run ``choice``'s kernels from now on (None: the defaults)."""
        if choice is None:
            self.attention, self.ops = self._default
            return
        key = (choice.decode_projection, choice.prefill_gemm, choice.attention)
        if key not in self._kernels:
            base = self._default[1]
            assert isinstance(base, NativeOps)
            project = ((TORCH, None) if choice.decode_projection == TORCH else
                       (choice.decode_projection, native_ops(choice.decode_projection)))
            ops = base.with_choice(project, widen_prefill=choice.prefill_gemm == "float32")
            attention = (Attention(self.device, native=False) if choice.attention == TORCH
                         else Attention(self.device, isa=choice.attention))
            self._kernels[key] = (attention, ops)
        self.attention, self.ops = self._kernels[key]

    @property
    def kernel_choice(self) -> KernelChoice | None:
        """The bound model's measured choice (None: the defaults run it)."""
        m = self._bound
        return None if m is None else self._choices.get(shape_key(m.spec, m.weights.dtype))

    # -- binding ---------------------------------------------------------------------------

    def layout(self, spec: ModelSpec, dtype: str | None = None) -> WeightLayout:
        """``weight_layout(spec, dtype)``, memoised per engine."""
        key = (spec, canonical_dtype(dtype or spec.dtype))
        if key not in self._layouts:
            self._layouts[key] = weight_layout(spec, key[1])
        return self._layouts[key]

    def bind(self, spec: ModelSpec, weights: torch.Tensor | ModelWeights,
             kv_region: torch.Tensor, dtype: str | None = None,
             reduce: ReduceFn | None = None, ready: object | None = None) -> None:
        """Serve ``spec`` from ``weights`` (its packed layout's bytes, or bound views).

        ``kv_region`` is a uint8 byte range viewed as blocks of
        ``kv_shape.block_bytes``; KV blocks are indices into it. Nothing is
        copied or allocated; the previous model's views are simply dropped.
        ``spec`` may be one tensor-parallel shard's, with its group's all-reduce
        as ``reduce`` (``tp.bind_shard``). ``ready``: the event of the copy that put
        the weights there (a CUDA event); the first graph replay waits on it.
        """
        if isinstance(weights, ModelWeights):
            bound = weights
        else:
            bound = bind_weights(spec, self.layout(spec, dtype), weights)
        dtype_name = next(k for k, v in TORCH_DTYPES.items() if v == bound.dtype)
        kv_shape = spec.kv_shape(dtype_name, self.block_size)
        kv = KVViews.over(kv_region, spec, self.block_size, bound.dtype)
        rope = self._rope(spec, bound.dtype)
        self._bound = _Bound(spec, bound, kv, kv_shape, rope, reduce)
        if self.graphs is not None:
            if reduce is None:
                self.graphs.bind(spec, dtype_name, bound, kv, rope, self.attention.decode_kernel,
                                 ready)
            else:  # a shard's step all-reduces: not captured
                self.graphs.unbind()
        if self._tunable:
            self._use(self._choices.get(shape_key(spec, bound.dtype)))

    @property
    def native_kernels(self) -> bool:
        """Whether decode runs on the native CPU kernels (else the torch path)."""
        return isinstance(self.ops, NativeOps) or self.attention.native is not None

    @property
    def isa(self) -> str:
        """The decode projection's level (``avx2``, ``avx512``, ``amx``, ``neon``), or
        ``torch``: for the bound model's kernel choice, else the default level."""
        return self.ops.project_isa if isinstance(self.ops, NativeOps) else TORCH

    @property
    def compute_dtype(self) -> str:
        """What a prefill GEMM multiplies bfloat16 weights in: ``float32`` (the weights
        stay bfloat16, converted a block at a time) where the CPU has no native
        bfloat16 arithmetic at the level in use or where that measured faster
        (``tune``), else ``bfloat16`` (and always on the torch path)."""
        if isinstance(self.ops, NativeOps):
            return "float32" if self.ops.widen_prefill else "bfloat16"
        return "bfloat16"

    @property
    def spec(self) -> ModelSpec:
        """The bound model's spec."""
        return self._model().spec

    @property
    def kv_shape(self) -> KVShape:
        """The bound model's KV shape (block layout and ``block_bytes``)."""
        return self._model().kv_shape

    @property
    def num_blocks(self) -> int:
        """KV blocks in the bound region."""
        return self._model().kv.blocks.shape[0]

    def _model(self) -> _Bound:
        if self._bound is None:
            raise RuntimeError("no model bound; call Engine.bind first")
        return self._bound

    # -- compute ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int],
                start_pos: int = 0) -> torch.Tensor:
        """Run ``token_ids`` (positions ``start_pos..``) of one sequence; return the
        float32 logits ``[vocab]`` of its last position.

        Writes K/V of every new position into ``block_ids`` (the sequence's blocks
        from position 0). With ``start_pos > 0`` the earlier positions must already
        be in those blocks (a cached prefix or an earlier chunk).
        """
        m = self._model()
        hidden = self._prefill_hidden(m, token_ids, block_ids, start_pos)
        return logits(m.weights, hidden[-1:], self.ops)[0]

    @torch.inference_mode()
    def prefill_scored(self, token_ids: Sequence[int], block_ids: Sequence[int], k: int,
                       start_pos: int = 0) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        """:meth:`prefill`, and the log-probability of each of ``token_ids[1:]`` with the
        ``k`` most likely tokens at its position (the logits of a chunk of positions at
        a time, never all of them at once)."""
        m = self._model()
        hidden = self._prefill_hidden(m, token_ids, block_ids, start_pos)
        scored: list[TokenLogprobs] = []
        targets = list(token_ids[1:])
        for at in range(0, len(targets), SCORE_CHUNK):
            rows = logits(m.weights, hidden[at:at + min(SCORE_CHUNK, len(targets) - at)],
                          self.ops)
            scored += top_logprobs(rows, targets[at:at + SCORE_CHUNK], k)
        return logits(m.weights, hidden[-1:], self.ops)[0], scored

    def _prefill_hidden(self, m: _Bound, token_ids: Sequence[int], block_ids: Sequence[int],
                        start_pos: int) -> torch.Tensor:
        """The final hidden states of ``token_ids``' positions (their K/V written)."""
        num_new = len(token_ids)
        total = start_pos + num_new
        if num_new == 0 or start_pos < 0:
            raise ValueError("prefill needs at least one token and start_pos >= 0")
        self._check_len(m, total, len(block_ids))
        used = list(block_ids[:m.kv_shape.blocks_for(total)])
        self._check_blocks(used)
        dev, bs = self.device, self.block_size
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)
        positions = torch.arange(start_pos, total, device=dev)
        blocks = torch.tensor(used, dtype=torch.long, device=dev)
        rope = m.rope.ensure(total)
        table = rope[:, start_pos:total, None]
        attention = self.attention
        heads_q, heads_qk = m.spec.num_heads, m.spec.num_heads + m.spec.num_kv_heads
        attend: AttendFn
        if start_pos == 0:
            def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
                return attention.causal(qkv[:, :heads_q], qkv[:, heads_q:heads_qk],
                                        qkv[:, heads_qk:])
        elif attention.triton:  # each new token a row over its own context, in place
            attend = attention.paged_decode(m.kv, heads_q, blocks[None].expand(num_new, -1),
                                            positions + 1, None)
        else:
            spec = m.spec
            mask = torch.arange(total, device=dev)[None, :] <= positions[:, None]
            rows = m.kv.gather_rows(blocks)
            ctx = (2, -1, spec.num_kv_heads, spec.head_dim)

            def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
                # [2, S, Hkv, D] -> K and V as [Hkv, S, D]
                both = m.kv.rows.index_select(0, rows[i]).view(ctx)[:, :total].transpose(1, 2)
                return attention.masked(qkv[:, :heads_q], both[0], both[1], mask)

        tokens = Tokens(ids, table[0], table[1], blocks[positions // bs], positions % bs,
                        positions=positions, rope=rope)
        return forward(m.weights, m.kv, tokens, attend, self.ops, m.reduce)

    @torch.inference_mode()
    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One step for a batch of sequences of any lengths: float32 logits ``[B, vocab]``.

        Each sequence's token is at ``position`` (its context is positions
        ``0..position``); its K/V are written into its block for that position.
        """
        m = self._model()
        batch, bs = len(seqs), self.block_size
        if batch == 0:
            raise ValueError("decode needs at least one sequence")
        positions = [s.position for s in seqs]
        lengths = [p + 1 for p in positions]
        num_blocks = -(-max(lengths) // bs)
        flat = [s.token_id for s in seqs] + positions
        table: list[int] = []
        for s in seqs:
            if s.position < 0:
                raise ValueError(f"negative position {s.position}")
            used = s.position // bs + 1
            self._check_len(m, s.position + 1, len(s.block_ids))
            flat.append(s.block_ids[used - 1])
            table.extend(s.block_ids[:used])
            table.extend([s.block_ids[0]] * (num_blocks - used))  # padding, masked below
        self._check_blocks(table)
        if self.graphs is not None and m.reduce is None:
            out = self.graphs.decode([s.token_id for s in seqs], positions,
                                     [s.block_ids for s in seqs], self.ops, self.attention)
            if out is not None:
                return out
        flat.extend(p % bs for p in positions)
        flat.extend(lengths)
        idx = torch.tensor(flat + table, dtype=torch.long).to(self.device, non_blocking=True)
        tokens, pos_t = idx[:batch], idx[batch:2 * batch]
        slot_blocks, slot_offsets = idx[2 * batch:3 * batch], idx[3 * batch:4 * batch]
        context_lens, block_table = idx[4 * batch:5 * batch], idx[5 * batch:].view(batch, -1)
        rope = m.rope.ensure(max(lengths))
        if self.attention.triton:  # the kernels index the rope table themselves
            step = Tokens(tokens, None, None, slot_blocks, slot_offsets, positions=pos_t,
                          rope=rope)
        else:
            cos_sin = rope.index_select(1, pos_t)[:, :, None]
            step = Tokens(tokens, cos_sin[0], cos_sin[1], slot_blocks, slot_offsets)
        stack = self._layer_stack(m, batch)
        if stack is not None:
            assert isinstance(self.ops, NativeOps)
            hidden = embed(tokens, m.weights.embed_tokens, m.weights.dtype)
            self.ops.decode_layers(stack, hidden, m.kv, step, self.attention.native, block_table,
                                   context_lens, m.spec.num_heads, m.spec.rms_norm_eps)
        else:
            attend = self.attention.paged_decode(m.kv, m.spec.num_heads, block_table,
                                                 context_lens, lengths)
            hidden = forward(m.weights, m.kv, step, attend, self.ops, m.reduce)
        return logits(m.weights, hidden, self.ops)

    def _layer_stack(self, m: _Bound, batch: int) -> LayerStack | None:
        """The layers for one native decode_layers call, where this step can take it."""
        if (not self.fuse_layers or m.reduce is not None or batch > NATIVE_MAX_ROWS
                or not isinstance(self.ops, NativeOps) or self.attention.native is None):
            return None
        key = id(self.ops)
        if key not in m.stacks:
            m.stacks[key] = self.ops.layer_stack(m.weights)
        return m.stacks[key]

    def _check_len(self, m: _Bound, num_tokens: int, num_blocks: int) -> None:
        if num_tokens > m.spec.max_model_len:
            raise ValueError(f"sequence of {num_tokens} tokens exceeds the window of "
                             f"{m.spec.name!r} ({m.spec.max_model_len} tokens)")
        if num_blocks * self.block_size < num_tokens:
            raise ValueError(f"{num_blocks} blocks hold {num_blocks * self.block_size} "
                             f"positions, the sequence needs {num_tokens}")

    def _check_blocks(self, block_ids: Sequence[int]) -> None:
        count = self.num_blocks
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= count):
            raise ValueError(f"block ids must be in [0, {count}) (the bound KV region), got "
                             f"{min(block_ids)}..{max(block_ids)}")

    # -- KV handoff ------------------------------------------------------------------------

    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies of blocks ``block_ids`` as ``[n, block_bytes]`` uint8 (same device)."""
        kv = self._model().kv
        self._check_blocks(block_ids)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return kv.blocks.index_select(0, index)

    def import_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write exported blocks ``data [n, block_bytes]`` at ``block_ids`` of this region."""
        kv = self._model().kv
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(block_ids),
                                                              kv.blocks.shape[1]):
            raise ValueError(f"expected uint8 [{len(block_ids)}, {kv.blocks.shape[1]}] blocks, "
                             f"got {data.dtype} {tuple(data.shape)}")
        self._check_blocks(block_ids)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        kv.blocks.index_copy_(0, index, data.to(self.device))
