"""The dtypes the project serves, by name: the one table of names, aliases and sizes.

Torch-free (libs/common); the engine maps the names to torch dtypes
(``aegaeon_engine.weights.TORCH_DTYPES``), everything else uses the names.
"""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)
_ALIASES = {"fp32": "float32", "float": "float32", "f32": "float32", "bf16": "bfloat16",
            "fp16": "float16", "half": "float16", "f16": "float16"}  # fmt: skip


def canonical_dtype(name: str) -> str:
    """``"bf16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"`` etc.; ValueError for dtypes
    the engine cannot serve."""
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    return key
