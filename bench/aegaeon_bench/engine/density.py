"""How many models of each precision a Model Cache holds (issue 27's density table).

``python -m aegaeon_bench.engine.density [--cache 4GiB,64GiB] [--json]``

Bytes per model come from the checkpoint shapes of the real-shape presets
(``aegaeon market add --random PRESET``), not from files: every 2-D projection in
the precision, and

- ``bfloat16``: everything 2 bytes;
- ``float8_e4m3fn``: projections 1 byte plus a float32 scale per output row;
  embeddings, the output layer and the norms stay bfloat16 (as ``--dtype fp8``
  would keep them);
- ``q8_0`` / ``q4_1`` / ``q4_0``: GGUF blocks of 32 weights (34 / 20 / 18 bytes);
  embeddings and the output layer in Q8_0, the norms float32 (as llama.cpp's
  files and the market's SmolLM2 Q4_1 file keep them).

A model fits a cache as many times as its bytes go into it, whole models only;
the table says how many different models of one size a cache holds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from aegaeon_common.config import parse_bytes

PRECISIONS = ("bfloat16", "float8_e4m3fn", "q8_0", "q4_1", "q4_0")
_BLOCK_BYTES = {"q8_0": 34, "q4_1": 20, "q4_0": 18}  # per 32 weights
_EDGES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ModelBytes:
    name: str
    params: int
    bytes: dict[str, int]  # precision -> bytes of the whole model


def model_bytes(name: str, shapes: dict[str, tuple[int, ...]], params: int) -> ModelBytes:
    out = dict.fromkeys(PRECISIONS, 0)
    for tensor, shape in shapes.items():
        count = math.prod(shape)
        matrix = len(shape) == 2
        edge = tensor in _EDGES
        out["bfloat16"] += 2 * count
        out["float8_e4m3fn"] += (count + 4 * shape[0]) if matrix and not edge else 2 * count
        for quant, block in _BLOCK_BYTES.items():
            if not matrix:
                out[quant] += 4 * count
            else:
                per = _BLOCK_BYTES["q8_0"] if edge else block
                out[quant] += -(-count // 32) * per
    return ModelBytes(name, params, out)


def preset_bytes() -> list[ModelBytes]:
    from aegaeon_market.presets import PRESETS
    from aegaeon_market.shapes import tensor_shapes

    return [model_bytes(name, tensor_shapes(p.recipe), p.params) for name, p in PRESETS.items()]


def fits(cache_bytes: int, nbytes: int) -> int:
    return cache_bytes // nbytes if nbytes else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aegaeon_bench.engine.density", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--cache", default="4GiB,64GiB",
                        help="Model Cache sizes, comma-separated (4GiB: the config's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        caches = [(c.strip(), parse_bytes(c.strip())) for c in args.cache.split(",") if c.strip()]
    except ValueError as exc:
        print(f"--cache: {exc}", file=sys.stderr)
        return 2
    models = preset_bytes()
    if args.json:
        print(json.dumps({"caches": dict(caches), "models": [
            {"name": m.name, "params": m.params, "bytes": m.bytes,
             "fits": {c: {p: fits(n, b) for p, b in m.bytes.items()} for c, n in caches}}
            for m in models]}))  # fmt: skip
        return 0
    head = " | ".join(f"{p} GB" for p in PRECISIONS)
    fit_head = " | ".join(f"{c}: {' / '.join(PRECISIONS)}" for c, _ in caches)
    print(f"| model | params | {head} | {fit_head} |")
    print("|" + "---|" * (2 + len(PRECISIONS) + len(caches)))
    for m in models:
        sizes = " | ".join(f"{m.bytes[p] / 1e9:.2f}" for p in PRECISIONS)
        counts = " | ".join(" / ".join(str(fits(n, m.bytes[p])) for p in PRECISIONS)
                            for _, n in caches)  # fmt: skip
        print(f"| {m.name} | {m.params / 1e9:.2f}B | {sizes} | {counts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
