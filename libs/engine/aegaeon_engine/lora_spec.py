"""LoRA adapters of a served base model: what a PEFT adapter directory says, checked
against the base, and its packed layout.

Pure (no torch), like spec.py and layout.py: the proxy checks an adapter it is asked
to load at run time, the market checks one it imports, the cachemgr plans its
region, all without the tensor library.

A PEFT LoRA adapter is a directory with ``adapter_config.json`` (``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``) and
``adapter_model.safetensors`` holding, per decoder layer and targeted projection,
``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. Served, a targeted projection computes ``x W^T + scale (x A^T) B^T``
with ``scale = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``), which is what
PEFT's ``merge_and_unload`` folds into ``W``.

The packed layout (the Model Cache's region of the adapter, and its bytes on the
device) has two slots per layer and targeted module, in ``MODULES`` order:
``layers.{i}.{module}.lora_a`` ``[r, in]`` and ``layers.{i}.{module}.lora_b``
``[out, r]``, in the serving dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .layout import DEFAULT_ALIGNMENT, TensorSlot, WeightLayout
from .spec import DTYPE_BYTES, ModelSpec, canonical_dtype, read_json_object
from .st_header import TensorEntry, read_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_RANK = 64
# the projections an adapter may target, in the order of a layer's work; the name of
# each in a Llama-family checkpoint (PEFT's ``target_modules`` use the last part)
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
PROJECTIONS: dict[str, str] = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# the fused projection of the engine each module's output belongs to
GROUP_OF: dict[str, str] = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up",
                            "up": "gate_up", "down": "down"}
_TARGET_NAMES = {PROJECTIONS[m].split(".")[1]: m for m in MODULES}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # a random adapter's
_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "DEFAULT_TARGETS", "GROUP_OF", "MAX_RANK", "MODULES",
    "AdapterSpec", "adapter_layout", "is_adapter_dir", "module_shape", "module_span",
    "target_modules",
]


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like a PEFT adapter directory (its config is there)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def module_shape(base: ModelSpec, module: str) -> tuple[int, int]:
    """``(out, in)`` of ``module``'s projection in ``base``."""
    h, q, kv, inter = base.hidden_size, base.q_size, base.kv_size, base.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h),
            "up": (inter, h), "down": (h, inter)}[module]


def module_span(base: ModelSpec, module: str) -> tuple[int, int]:
    """``[start, end)`` of ``module``'s output columns in its fused projection's output
    (q, k, v in ``qkv``; gate, up in ``gate_up``)."""
    q, kv, inter = base.q_size, base.kv_size, base.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "o": (0, base.hidden_size),
            "gate": (0, inter), "up": (inter, 2 * inter), "down": (0, base.hidden_size)}[module]


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter of ``base``: its rank, scale and targeted modules (``MODULES``
    order), and the name of each of its tensors in ``adapter_model.safetensors``."""

    name: str
    base: ModelSpec
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    dtype: str  # its tensors' dtype in the file
    prefix: str = "base_model.model.model."  # before ``layers.{i}...`` in the file

    @property
    def scale(self) -> float:
        """What the low-rank term is multiplied by: alpha / r (rsLoRA: alpha / sqrt(r))."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def tensor_name(self, layer: int, module: str, which: str) -> str:
        """The file's name of ``layer``'s ``module`` matrix ``which`` (``A`` or ``B``)."""
        return f"{self.prefix}layers.{layer}.{PROJECTIONS[module]}.lora_{which}.weight"

    def shapes(self, module: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of ``module``'s A ``[r, in]`` and B ``[out, r]``."""
        out, inp = module_shape(self.base, module)
        return (self.rank, inp), (out, self.rank)

    @property
    def num_params(self) -> int:
        per_layer = sum(self.rank * sum(module_shape(self.base, m)) for m in self.targets)
        return per_layer * self.base.num_layers

    @classmethod
    def from_dir(cls, path: str | Path, base: ModelSpec, name: str | None = None) -> AdapterSpec:
        """Read and check the PEFT adapter in ``path`` against ``base``: its config, and
        the name, shape and dtype of every tensor in its safetensors header. Raises
        ``CheckpointError`` naming the file and the field (or tensor) at fault."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(root, None, "missing (expected a PEFT adapter directory with "
                                              f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
        config_path = root / ADAPTER_CONFIG
        raw = read_json_object(config_path)
        if raw is None:
            raise CheckpointError(config_path, None, "missing file")
        rank, alpha, rslora, targets = _parse_config(raw, config_path)
        header = read_header(root / ADAPTER_WEIGHTS)
        spec = cls(name or root.name, base, rank, alpha, rslora, targets, "float32",
                   _prefix(header, root / ADAPTER_WEIGHTS))
        return _check_tensors(spec, header, root / ADAPTER_WEIGHTS)


def _parse_config(raw: dict[str, Any],
                  where: Path) -> tuple[int, float, bool, tuple[str, ...]]:  # fmt: skip
    """``(r, lora_alpha, use_rslora, targets)`` of an adapter_config.json."""
    def field(key: str, default: Any = None) -> Any:
        return raw.get(key, default)

    kind = field("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise CheckpointError(where, "peft_type", f"{kind!r} is not served (only LORA)")
    rank = field("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise CheckpointError(where, "r", f"must be an integer rank in 1..{MAX_RANK}, got "
                                          f"{rank!r}")
    alpha = field("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise CheckpointError(where, "lora_alpha", f"must be a positive number, got {alpha!r}")
    rslora = field("use_rslora", False)
    if not isinstance(rslora, bool):
        raise CheckpointError(where, "use_rslora", f"must be true or false, got {rslora!r}")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)),
                         ("fan_in_fan_out", (False, None)), ("layers_to_transform", (None,)),
                         ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None)),
                         ("modules_to_save", (None, [])), ("use_qalora", (False, None)),
                         ("lora_bias", (False, None)), ("layer_replication", (None,)),
                         ("trainable_token_indices", (None,))):
        if field(key) not in allowed:
            raise CheckpointError(where, key, f"{field(key)!r} is not served (served: "
                                              f"{allowed[0]!r})")
    return rank, float(alpha), rslora, target_modules(field("target_modules"), where)


def target_modules(raw: Any, where: str | Path) -> tuple[str, ...]:
    """The modules (``MODULES`` order) of a PEFT ``target_modules`` value: a list of
    ``q_proj``... or ``all-linear``; ``CheckpointError`` naming ``where`` otherwise."""
    names = ", ".join(_TARGET_NAMES)
    if raw == "all-linear":
        return MODULES
    if isinstance(raw, str) or not isinstance(raw, list) or not raw \
            or not all(isinstance(t, str) for t in raw):
        raise CheckpointError(where, "target_modules", f"must be a list of projections among "
                                                       f"{names} (or 'all-linear'), got {raw!r}")
    unknown = [t for t in raw if t not in _TARGET_NAMES]
    if unknown:
        raise CheckpointError(where, "target_modules", f"{unknown[0]!r} is not a projection "
                                                       f"an adapter may target ({names})")
    chosen = {_TARGET_NAMES[t] for t in raw}
    return tuple(m for m in MODULES if m in chosen)


def _prefix(header: dict[str, TensorEntry], where: Path) -> str:
    """What comes before ``layers.`` in the file's tensor names (one for all of them)."""
    prefixes = {name[:name.find("layers.")] for name in header if "layers." in name}
    if len(prefixes) != 1:
        found = sorted(prefixes) or "no tensor named ...layers.N..."
        raise CheckpointError(where, "header", f"expected LoRA tensors named "
                                               f"<prefix>layers.N.<projection>.lora_A.weight, "
                                               f"found prefixes {found}")
    return prefixes.pop()


def _check_tensors(spec: AdapterSpec, header: dict[str, TensorEntry], where: Path) -> AdapterSpec:
    """Every tensor the config promises, of its shape and one float dtype, and nothing
    else; the spec with the file's dtype."""
    expected: dict[str, tuple[int, int]] = {}
    for layer in range(spec.base.num_layers):
        for module in spec.targets:
            shape_a, shape_b = spec.shapes(module)
            expected[spec.tensor_name(layer, module, "A")] = shape_a
            expected[spec.tensor_name(layer, module, "B")] = shape_b
    extra = sorted(set(header) - set(expected))
    if extra:
        raise CheckpointError(where, extra[0], "unexpected tensor (not a LoRA matrix of the "
                                               "target_modules of a layer of the base; "
                                               f"{len(extra)} such)")
    dtypes: set[str] = set()
    for name, shape in expected.items():
        info = header.get(name)
        if info is None:
            raise CheckpointError(where, name, f"missing tensor (the base {spec.base.name!r} has "
                                               f"{spec.base.num_layers} layers)")
        if info.code not in _SAFETENSORS_FLOATS:
            raise CheckpointError(where, name, f"wrong dtype {info.code!r}; only F32, BF16 and F16 "
                                               "load")
        got = list(info.shape)
        if got != list(shape):
            raise CheckpointError(where, name, f"wrong shape {got}, expected {list(shape)} for "
                                               f"the base {spec.base.name!r} at rank "
                                               f"{spec.rank}")
        dtypes.add(_SAFETENSORS_FLOATS[info.code])
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    return AdapterSpec(spec.name, spec.base, spec.rank, spec.alpha, spec.rslora, spec.targets,
                       dtype, spec.prefix)


def adapter_layout(spec: AdapterSpec, dtype: str | None = None,
                   alignment: int = DEFAULT_ALIGNMENT) -> WeightLayout:
    """The packed layout of ``spec``'s matrices served in ``dtype`` (default: the
    base's); see the module docstring."""
    dtype = canonical_dtype(dtype or spec.base.dtype)
    itemsize = DTYPE_BYTES[dtype]
    slots: list[TensorSlot] = []
    offset = 0
    for layer in range(spec.base.num_layers):
        for module in spec.targets:
            for which, shape in zip(("A", "B"), spec.shapes(module), strict=True):
                nbytes = shape[0] * shape[1] * itemsize
                slots.append(TensorSlot(f"layers.{layer}.{module}.lora_{which.lower()}", dtype,
                                        shape, offset, nbytes,
                                        (spec.tensor_name(layer, module, which),),
                                        (shape[0],)))
                offset += -(-nbytes // alignment) * alignment
    return WeightLayout(spec.name, dtype, alignment, offset, tuple(slots))
