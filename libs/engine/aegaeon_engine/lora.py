"""LoRA adapters in a forward pass: bound views, and the batched low-rank term.

An adapter's packed bytes (lora_spec.adapter_layout) are bound as views, as a
model's are (``bind_adapter``): nothing is allocated, the owner of the bytes (the
Model Cache's mapping, the worker's adapter region) stays the owner.

One step may mix rows of the base and of any number of its adapters. The base's
projections run once for every row; then, per fused projection (qkv, o, gate_up,
down), one term adds each row's own adapter's contribution:

    t = x A^T            A: the A matrices of the step's adapters, stacked  [S, in]
    t *= mask            mask[n, c] = scale of row n's adapter where column c is its
                         (its rank's columns), else 0                      [N, S]
    out[:, span] += t B^T    B: the B matrices side by side, per module     [out, S]

which gives every row exactly ``scale (x A_a^T) B_a^T`` of its adapter ``a`` (and
nothing for a row of the base). The stacked matrices (``LoraStack``) are built
once per set of adapters and kept while the steps' adapters stay within it
(``LoraStacks``): a step then costs three small GEMMs and one multiply per fused
projection, however many adapters it mixes (``LoraStep``, the segmented
gather-matmul of S-LoRA and Punica in dense form: torch's GEMMs, any device).
Kernels that read only each row's own columns of the same stack replace it
where they run: the CPU's native ``lora_add`` (csrc/lora.cpp; ``NativeLoraStep``,
inside the fused native decode step too: at rank 8-16 on a small model the
masked GEMMs cost more than the base's projections) and on CUDA Triton's
(gpu/lora.py, ``TritonLoraStep``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .layout import WeightLayout
from .lora_spec import ADAPTER_WEIGHTS, GROUP_OF, MODULES, AdapterSpec, module_span
from .model import LoraTerm
from .weights import TORCH_DTYPES, checked_dtype

GROUPS = ("qkv", "o", "gate_up", "down")
_GROUP_MODULES: dict[str, tuple[str, ...]] = {
    g: tuple(m for m in MODULES if GROUP_OF[m] == g) for g in GROUPS
}
# a stack is kept while a step's adapters are at least this share of it (else rebuilt
# for the step's, so that a few adapters do not pay for many)
_KEEP_SHARE = 0.5
_KEEP_EXTRA = 4
MAX_SLOTS = 64  # adapters a stack keeps where kernels read only each row's own


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """An adapter bound over its packed bytes: ``layers[i][module] = (A [r, in], B [out, r])``
    for its targeted modules."""

    spec: AdapterSpec
    dtype: torch.dtype
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def name(self) -> str:
        return self.spec.name


def bind_adapter(spec: AdapterSpec, layout: WeightLayout, buffer: torch.Tensor) -> AdapterWeights:
    """Views of ``layout``'s slots over ``buffer`` (1-D uint8 holding its packed bytes)."""
    dtype = checked_dtype(buffer, layout, "adapter")
    slots = layout.by_name

    def view(name: str) -> torch.Tensor:
        slot = slots[name]
        return buffer[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape)

    layers = tuple(
        {m: (view(f"layers.{i}.{m}.lora_a"), view(f"layers.{i}.{m}.lora_b"))
         for m in spec.targets}
        for i in range(spec.base.num_layers)
    )
    return AdapterWeights(spec, dtype, layers)


def fill_adapter(path: str | Path, spec: AdapterSpec, layout: WeightLayout,
                 dest: torch.Tensor, digests: Mapping[Path, str] | None = None) -> set[Path]:
    """Write the adapter in ``path`` into host memory ``dest`` in ``layout``'s packed form
    (each matrix converted to the layout's dtype; padding zeroed). ``CheckpointError``
    names the file and tensor at fault; with the weights file in ``digests`` (file ->
    SHA-256 hex), a file whose content differs is one too. Returns the files read."""
    from aegaeon_common.market_files import digest_mismatch, file_sha256

    from .loader import read_tensor
    from .st_header import read_header

    file = Path(path) / ADAPTER_WEIGHTS
    if dest.dtype != torch.uint8 or dest.dim() != 1 or dest.numel() < layout.total_bytes:
        raise ValueError(f"destination must be 1-D uint8 of >= {layout.total_bytes} bytes")
    expected = digests.get(file) if digests else None
    if expected is not None:  # megabytes: hashed in one pass of their own
        try:
            got = file_sha256(file)
        except OSError as exc:
            raise CheckpointError(file, None, f"cannot read ({exc.strerror})") from None
        if got != expected:
            raise CheckpointError(file, None, digest_mismatch(got, expected))
    header = read_header(file)
    dtype = TORCH_DTYPES[layout.dtype]
    dest[:layout.total_bytes].zero_()
    for slot in layout.slots:
        name = slot.sources[0]
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(file, name, "missing tensor")
        if entry.shape != slot.shape:
            raise CheckpointError(file, name, f"wrong shape {list(entry.shape)}, expected "
                                              f"{list(slot.shape)}")
        tensor = read_tensor(entry, name).to(dtype)
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(file, name, "holds values that are not finite")
        dest[slot.offset:slot.offset + slot.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
    return {file}


@dataclass(frozen=True)
class _GroupTerm:
    """One fused projection's low-rank term in one layer: the stacked A, and per module
    (its B, its columns of ``t``, its output span)."""

    a: torch.Tensor
    modules: tuple[tuple[torch.Tensor, int, int, int, int], ...]


class LoraStack:
    """The A and B matrices of ``adapters`` (its slots), stacked per layer and fused
    projection (see the module docstring); built once, on the adapters' device."""

    def __init__(self, adapters: Sequence[AdapterWeights], copy: bool = True) -> None:
        """``copy=False`` uses an adapter's own views where it is alone in a stack (a
        prefill's, used within one call); otherwise the matrices are copied, so the
        stack never aliases memory its adapters may give back."""
        if not adapters:
            raise ValueError("a LoRA stack needs at least one adapter")
        base = adapters[0].spec.base
        if any(a.spec.base != base for a in adapters):
            raise ValueError("the adapters of one stack must share their base model")
        self.adapters = tuple(adapters)
        self.slot_of = {id(a): i for i, a in enumerate(adapters)}
        self.dtype = adapters[0].dtype
        self.device = adapters[0].layers[0][adapters[0].spec.targets[0]][0].device
        cols: list[int] = []  # the slot of every column of the step's mask, group by group
        self.group_cols: dict[str, tuple[int, int]] = {}
        # per targeted module: its group and its columns [t0, t1) of the group's t
        self.module_cols: dict[str, tuple[str, int, int]] = {}
        # per targeted module and slot: the slot's first column within the module's, rank
        self._slot_cols: dict[str, tuple[list[int], list[int]]] = {}
        layout: dict[str, list[tuple[str, int, int]]] = {}
        for group in GROUPS:
            start = len(cols)
            layout[group] = []
            for module in _GROUP_MODULES[group]:
                m_start = len(cols) - start
                firsts, ranks = [], []
                for slot, adapter in enumerate(adapters):
                    firsts.append(len(cols) - start - m_start)
                    targeted = module in adapter.spec.targets
                    ranks.append(adapter.spec.rank if targeted else 0)
                    if targeted:
                        cols.extend([slot] * adapter.spec.rank)
                if len(cols) - start > m_start:
                    layout[group].append((module, m_start, len(cols) - start))
                    self.module_cols[module] = (group, m_start, len(cols) - start)
                    self._slot_cols[module] = (firsts, ranks)
            if layout[group]:
                self.group_cols[group] = (start, len(cols))
        self.max_rank = max(a.spec.rank for a in adapters)
        self._native: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None
        self._slot_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.col_slots = torch.tensor(cols, dtype=torch.long, device=self.device)
        self.scales = torch.tensor([a.spec.scale for a in adapters], dtype=torch.float32,
                                   device=self.device)
        self.layers: list[dict[str, _GroupTerm]] = []
        for i in range(base.num_layers):
            terms: dict[str, _GroupTerm] = {}
            for group, modules in layout.items():
                if not modules:
                    continue
                a_parts = [a.layers[i][m][0] for m, _, _ in modules for a in adapters
                           if m in a.spec.targets]
                parts = []
                for module, c0, c1 in modules:
                    b_parts = [a.layers[i][module][1] for a in adapters if module in a.spec.targets]
                    o0, o1 = module_span(base, module)
                    parts.append((_join(b_parts, 1, copy), c0, c1, o0, o1))
                terms[group] = _GroupTerm(_join(a_parts, 0, copy), tuple(parts))
            self.layers.append(terms)

    def native_matrices(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The stacked matrices as the native stack takes them (csrc/stack.cpp): every
        (layer, module)'s A and B in order, and per layer and module (``MODULES``
        order) the index of its pair, -1 where no adapter targets it."""
        if self._native is None:
            a_list: list[torch.Tensor] = []
            b_list: list[torch.Tensor] = []
            index: list[int] = []
            for terms in self.layers:
                pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
                for group, term in terms.items():
                    for b, t0, t1, _, _ in term.modules:
                        pairs[self.module_at(group, t0)] = (term.a[t0:t1], b)
                for module in MODULES:
                    if module in pairs:
                        index.append(len(a_list))
                        a_list.append(pairs[module][0])
                        b_list.append(pairs[module][1])
                    else:
                        index.append(-1)
            self._native = (a_list, b_list, index)
        return self._native

    def __contains__(self, adapter: object) -> bool:
        return id(adapter) in self.slot_of

    def __len__(self) -> int:
        return len(self.adapters)

    def slot_columns(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot, its first column among ``module``'s and its rank there (0: the
        slot's adapter does not target ``module``); made once per stack."""
        cols = self._slot_tensors.get(module)
        if cols is None:
            firsts, ranks = self._slot_cols[module]
            cols = self._slot_tensors[module] = (
                torch.tensor(firsts, dtype=torch.long, device=self.device),
                torch.tensor(ranks, dtype=torch.long, device=self.device))
        return cols

    def module_at(self, group: str, t0: int) -> str:
        """The module whose columns of ``group``'s t start at ``t0``."""
        return next(m for m, (g, start, _) in self.module_cols.items()
                    if g == group and start == t0)

    def step(self, adapters: Sequence[AdapterWeights | None], triton: bool = False,
             native: Any = None) -> LoraTerm:
        """The term of a step whose row ``n`` runs ``adapters[n]`` (None: the base alone):
        with ``triton``, Triton's kernels (gpu/lora.py: CUDA, or the CPU under
        ``TRITON_INTERPRET=1``); with ``native`` (a namespace with ``lora_add``) the
        CPU's kernel; else torch's GEMMs."""
        rows = [-1 if a is None else self.slot_of[id(a)] for a in adapters]
        row_slots = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        if triton:
            return TritonLoraStep(self, row_slots)
        if native is not None and self.dtype in (torch.float32, torch.bfloat16) \
                and self.device.type == "cpu":
            return NativeLoraStep(self, row_slots, native)
        hit = self.col_slots[None, :] == row_slots[:, None]
        mask = torch.where(hit, self.scales[self.col_slots][None, :], 0.0).to(self.dtype)
        return LoraStep(self, mask, row_slots)


def _join(parts: list[torch.Tensor], dim: int, copy: bool) -> torch.Tensor:
    if len(parts) == 1 and not copy:
        return parts[0]
    return torch.cat(parts, dim).contiguous() if len(parts) > 1 else parts[0].clone()


@dataclass(frozen=True)
class LoraStep:
    """The low-rank term of one step on torch's GEMMs: ``add`` it after each fused
    projection."""

    stack: LoraStack
    mask: torch.Tensor  # [N, S]: each row's scale on its adapter's columns
    row_slots: torch.Tensor  # [N]: each row's slot in the stack, -1 for the base

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out [N, fused out] += `` the term of ``group``'s projection of ``x [N, in]``."""
        term = self.stack.layers[layer].get(group)
        if term is None:
            return
        c0, c1 = self.stack.group_cols[group]
        t = torch.mm(x, term.a.t())
        t.mul_(self.mask[:, c0:c1])
        for b, t0, t1, o0, o1 in term.modules:
            target = out[:, o0:o1]
            target.addmm_(t[:, t0:t1], b.t())


class TritonLoraStep:
    """``LoraStep``'s term on the Triton kernels of gpu/lora.py (same ``add``): each
    row reads only its own adapter's columns of the stacked matrices."""

    def __init__(self, stack: LoraStack, row_slots: torch.Tensor) -> None:
        from .gpu.lora import block_rank

        self.stack = stack
        starts, ranks, self.scales = _row_columns(stack, row_slots)
        self.starts = {m: s.to(torch.int32) for m, s in starts.items()}
        self.ranks = {m: r.to(torch.int32) for m, r in ranks.items()}
        self.block_r = block_rank(stack.max_rank)

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        from .gpu.lora import expand, shrink

        term = self.stack.layers[layer].get(group)
        if term is None:
            return
        for b, t0, t1, o0, o1 in term.modules:
            module = self.stack.module_at(group, t0)
            starts, ranks = self.starts[module], self.ranks[module]
            t = shrink(x, term.a[t0:t1], starts, ranks, self.scales, self.block_r)
            expand(t, b, out[:, o0:o1], starts, ranks, self.block_r)


class NativeLoraStep:
    """``LoraStep``'s term on the CPU's native kernel (csrc/lora.cpp, ``lora_add``): each
    row reads only its own adapter's columns, as the Triton kernels do."""

    def __init__(self, stack: LoraStack, row_slots: torch.Tensor, ops: Any) -> None:
        self.stack = stack
        self.ops = ops
        self.row_slots = row_slots
        self.starts, self.ranks, self.scales = _row_columns(stack, row_slots)
        self._fallback: LoraTerm | None = None

    def _torch(self) -> LoraTerm:
        """The same term on torch's GEMMs (for inputs the kernel does not take)."""
        if self._fallback is None:
            stack = self.stack
            self._fallback = stack.step([None if s < 0 else stack.adapters[s]
                                         for s in self.row_slots.tolist()])
        return self._fallback

    def stack_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int],
                                  list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The native stack's LoRA arguments (kernels.NativeOps.decode_layers)."""
        a_list, b_list, index = self.stack.native_matrices()
        empty = torch.zeros(0, dtype=torch.long)
        starts = [self.starts.get(m, empty) for m in MODULES]
        ranks = [self.ranks.get(m, empty) for m in MODULES]
        return a_list, b_list, index, starts, ranks, self.scales

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        term = self.stack.layers[layer].get(group)
        if term is None:
            return
        if x.stride(-1) != 1 or out.stride(-1) != 1:  # not rows of unit-stride columns
            self._torch().add(layer, group, x, out)
            return
        for b, t0, t1, o0, o1 in term.modules:
            module = self.stack.module_at(group, t0)
            self.ops.lora_add(out[:, o0:o1], x, term.a[t0:t1], b, self.starts[module],
                              self.ranks[module], self.scales)


def _row_columns(stack: LoraStack, row_slots: torch.Tensor
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Per targeted module, each row's first column among the module's and its rank
    there (0 for a row of the base or an adapter without the module); each row's scale."""
    slots = row_slots.clamp(min=0)
    base = row_slots < 0
    starts: dict[str, torch.Tensor] = {}
    ranks: dict[str, torch.Tensor] = {}
    for module in stack.module_cols:
        first, rank = stack.slot_columns(module)
        starts[module] = first[slots].contiguous()
        ranks[module] = torch.where(base, 0, rank[slots]).contiguous()
    scales = torch.where(base, 0.0, stack.scales[slots]).to(torch.float32).contiguous()
    return starts, ranks, scales


class LoraStacks:
    """The stack the decode steps use, rebuilt only when a step needs an adapter it
    lacks (the adapters it held are kept in it, up to ``MAX_SLOTS``: steps come and go
    with requests, and a rebuild copies every adapter's matrices); on torch's masked
    GEMMs, which compute every slot, also when a step uses too few of its slots (see
    ``_KEEP_SHARE``). ``kernels``: ``auto`` (on the CPU its native kernel where it loaded,
    on CUDA Triton's where Triton imports, else torch's), ``torch`` or ``triton``."""

    def __init__(self, kernels: str = "auto") -> None:
        self.current: LoraStack | None = None
        self.num_builds = 0
        self.kernels = kernels

    def triton(self, device: torch.device) -> bool:
        """Whether a step on ``device`` runs on the Triton kernels."""
        if self.kernels != "auto":
            return self.kernels == "triton"
        from .gpu import triton_problem

        return device.type == "cuda" and triton_problem(device.type) is None

    def step(self, adapters: Sequence[AdapterWeights | None], native: Any = None) -> LoraTerm:
        """The term of a decode step (``native``: the CPU kernels' namespace, or None)."""
        needed = list({id(a): a for a in adapters if a is not None}.values())
        if self.kernels == "torch":
            native = None
        device = needed[0].layers[0][needed[0].spec.targets[0]][0].device
        triton = self.triton(device)
        masked = native is None and not triton  # every slot computed for every row
        size = (max(int(len(needed) / _KEEP_SHARE), len(needed) + _KEEP_EXTRA) if masked
                else MAX_SLOTS)
        stack = self.current
        fits = stack is not None and all(a in stack for a in needed)
        if stack is None or not fits or (masked and len(stack) > size):
            ids = {id(a) for a in needed}
            base = needed[0].spec.base
            kept = [a for a in (stack.adapters if stack is not None else ())
                    if id(a) not in ids and a.spec.base == base]
            stack = LoraStack(needed + kept[:max(0, size - len(needed))])
            self.current = stack
            self.num_builds += 1
        return stack.step(adapters, triton, native)

    def forget(self, adapter: AdapterWeights) -> None:
        """``adapter``'s bytes are going: no stack built over it stays."""
        if self.current is not None and adapter in self.current:
            self.current = None

    def clear(self) -> None:
        self.current = None
