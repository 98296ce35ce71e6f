"""Write one model directory in the Hugging Face layout."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from aegaeon_engine.weights import TORCH_DTYPES
from safetensors.torch import save

from aegaeon_market.families import Family
from aegaeon_market.hfconfig import config_json, generation_config_json
from aegaeon_market.ladder import Recipe
from aegaeon_market.plan import ModelPlan
from aegaeon_market.tokenizer import build_tokenizer, tokenizer_config_json
from aegaeon_market.weights import init_weights

MODEL_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json",
)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Stable JSON: same document, same bytes."""
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@functools.lru_cache(maxsize=16)
def tokenizer_json(family: Family) -> str:
    """The family's ``tokenizer.json`` text, built once per process."""
    return build_tokenizer(family).to_str(pretty=True)


def write_model(plan: ModelPlan, model_dir: Path, dtype: str) -> None:
    """Write the five files of ``plan`` into ``model_dir`` (created if missing)."""
    recipe = plan.recipe
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = init_weights(recipe, plan.seed, TORCH_DTYPES[dtype])
    # save() + write_bytes rather than save_file: the file then gets the usual
    # umask permissions (save_file leaves it readable by its owner only)
    blob = save(tensors, metadata={"format": "pt"})
    (model_dir / "model.safetensors").write_bytes(blob)
    write_text_files(model_dir, recipe, config_json(recipe, dtype))


def write_text_files(model_dir: Path, recipe: Recipe, config: dict[str, Any]) -> None:
    """``config``, then the generation config and tokenizer files of ``recipe``'s family."""
    family = recipe.family_spec
    write_json(model_dir / "config.json", config)
    write_json(model_dir / "generation_config.json", generation_config_json(recipe))
    (model_dir / "tokenizer.json").write_text(tokenizer_json(family) + "\n", encoding="utf-8")
    write_json(model_dir / "tokenizer_config.json", tokenizer_config_json(family))
