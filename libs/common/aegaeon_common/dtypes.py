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


# GGUF block quantizations served as such (CPU): name -> (elements per block, bytes per
# block). A block is a float16 scale d (and, q4_1, a float16 minimum m) then the codes:
# q8_0: d, 32 int8 (w = d q); q4_0: d, 16 bytes of nibbles (w = d (q - 8)); q4_1: d, m,
# 16 bytes of nibbles (w = d q + m). Byte j's low nibble is element j, its high one j + 16.
QUANT_BLOCKS: dict[str, tuple[int, int]] = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20)}


# FP8 (e4m3) matrices served as such: ``fp8`` on the command line. A slot holds the
# ``[out, in]`` codes row after row (1 byte each), padded to ``FP8_SCALES_ALIGN``, then
# the float32 scale of every output row (w = scale * code; scale = amax(|row|) / 448).
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest finite e4m3fn
FP8_SCALES_ALIGN = 16


def fp8_scales_offset(rows: int, in_features: int) -> int:
    """Byte offset of the float32 row scales in an FP8 slot of ``rows x in_features``."""
    return -(-rows * in_features // FP8_SCALES_ALIGN) * FP8_SCALES_ALIGN


def quant_matrix_bytes(qtype: str, rows: int, in_features: int) -> int:
    """Bytes of a ``[rows, in_features]`` matrix stored as ``qtype`` (a GGUF block type or
    ``FP8``), as a slot of the packed layout holds it."""
    if qtype == FP8:
        return fp8_scales_offset(rows, in_features) + 4 * rows
    return rows * quant_row_bytes(qtype, in_features)


def quant_row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` elements in ``qtype`` (a whole number of blocks)."""
    elems, nbytes = QUANT_BLOCKS[qtype]
    if in_features % elems:
        raise ValueError(f"{qtype}: a row of {in_features} elements is not whole blocks "
                         f"of {elems}")
    return in_features // elems * nbytes
