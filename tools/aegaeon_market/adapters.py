"""LoRA adapters in a market: ``market add --adapter DIR --base BASE`` and
``--random-adapter``.

An adapter is listed in ``market.json`` with ``base`` (the market's model it
adapts) and stored as the PEFT directory it came as: ``adapter_config.json`` and
``adapter_model.safetensors``, nothing of the base (the market grows by the
adapter's bytes). It is checked against the base first (aegaeon_engine.lora_spec:
rank, alpha, rsLoRA, target modules, every tensor's shape), then staged and
committed like any model (edit.py): on any error the market is unchanged.

A random adapter (tests, benches) is seeded: the same name, base, rank, targets
and seed give the same bytes. Its A is uniform in ``±1/sqrt(in)`` (PEFT's
Kaiming start) and its B normal with a small spread, so it moves the base's
outputs a little, as a trained adapter does.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path

from aegaeon_common.market_index import MANIFEST, Manifest, MarketEntry, MarketError
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.lora_spec import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEFAULT_TARGETS,
    MAX_RANK,
    PROJECTIONS,
    AdapterSpec,
    module_shape,
    target_modules,
)
from aegaeon_engine.spec import ModelSpec

from aegaeon_market.edit import _check_request, _manifest_or_new, _stage_and_commit

ADAPTER_ARCH = "LoRA"
_B_STD = 0.02


def base_entry(manifest: Manifest, root: Path, base: str) -> MarketEntry:
    """The market's model ``base`` (not an adapter); MarketError naming what it has."""
    models = [e for e in manifest.entries if not e.adapter]
    entry = next((e for e in models if e.name == base), None)
    if entry is None:
        known = ", ".join(e.name for e in models) or "none"
        raise MarketError(f"--base {base!r}: {root / MANIFEST} has no model of that name "
                          f"(its models: {known})")
    return entry


def _base_spec(root: Path, name: str, base: str, replace_existing: bool) -> tuple[str, ModelSpec]:
    """Refuse a bad name or a clash; the base's name and spec."""
    _check_request(root, name, None, replace_existing)
    entry = base_entry(_manifest_or_new(root), root, base)
    return entry.name, ModelSpec.from_dir(entry.path)


def add_adapter(market_dir: Path | str, source: Path | str, name: str, base: str, *,
                replace_existing: bool = False) -> MarketEntry:
    """Check the PEFT adapter in ``source`` against the market's model ``base`` and store it
    as ``name``. ``CheckpointError`` for a defective adapter (naming the file and field),
    ``MarketError`` for an unknown base or a name clash; the market is unchanged then."""
    root, src = Path(market_dir).resolve(), Path(source).resolve()
    base_name, base_spec = _base_spec(root, name, base, replace_existing)
    spec = AdapterSpec.from_dir(src, base_spec, name)

    def write(staging: Path) -> MarketEntry:
        staging.mkdir(parents=True)
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(src / file, staging / file)
        AdapterSpec.from_dir(staging, base_spec, name)  # what the servers will read
        return MarketEntry(name, staging, ADAPTER_ARCH, spec.num_params, spec.dtype,
                           source=str(src), base=base_name)

    return _stage_and_commit(root, name, replace_existing, write)


def name_seed(name: str) -> int:
    """The default seed of a random adapter: its name's (distinct names, distinct weights)."""
    return zlib.crc32(name.encode())


def add_random_adapter(market_dir: Path | str, name: str, base: str, rank: int,
                       targets: Sequence[str] = DEFAULT_TARGETS, seed: int | None = None,
                       alpha: float | None = None, *,
                       replace_existing: bool = False) -> MarketEntry:
    """Write a seeded random adapter of ``base`` (rank ``rank`` on ``targets``, PEFT's
    names: ``q_proj``...; ``lora_alpha`` default ``2 rank``) into the market as ``name``,
    in the base's dtype; checked and committed as an imported one."""
    if isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise MarketError(f"--rank {rank}: must be in 1..{MAX_RANK}")
    root = Path(market_dir).resolve()
    base_name, base_spec = _base_spec(root, name, base, replace_existing)
    seed = name_seed(name) if seed is None else seed
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank,
              "use_rslora": False, "target_modules": list(targets), "lora_dropout": 0.0,
              "bias": "none", "base_model_name_or_path": base_name, "task_type": "CAUSAL_LM"}

    try:
        modules = target_modules(list(targets), "--targets")
    except CheckpointError as exc:
        raise MarketError(f"--targets {','.join(targets)}: {exc.reason}") from None

    def write(staging: Path) -> MarketEntry:
        staging.mkdir(parents=True)
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        _write_weights(staging / ADAPTER_WEIGHTS, base_spec, rank, modules, seed)
        spec = AdapterSpec.from_dir(staging, base_spec, name)
        return MarketEntry(name, staging, ADAPTER_ARCH, spec.num_params, spec.dtype,
                           source=f"random (seed {seed})", base=base_name)

    return _stage_and_commit(root, name, replace_existing, write)


def _write_weights(out: Path, base: ModelSpec, rank: int, modules: Sequence[str],
                   seed: int) -> None:
    """PEFT's tensors of a random adapter, in the base's dtype."""
    import torch
    from aegaeon_engine.weights import TORCH_DTYPES
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[base.dtype]
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base.num_layers):
        for module in modules:
            rows, inp = module_shape(base, module)
            a = (torch.rand(rank, inp, generator=generator) * 2 - 1) * inp ** -0.5
            b = torch.randn(rows, rank, generator=generator) * _B_STD
            stem = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}"
            tensors[f"{stem}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{stem}.lora_B.weight"] = b.to(dtype).contiguous()
    save_file(tensors, str(out))
