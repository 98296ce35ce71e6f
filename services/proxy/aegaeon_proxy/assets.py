"""Per-model text assets: tokenizer, chat template, EOS ids, context window.

Read once per model from its checkpoint directory (``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``, ``config.json``) off
the event loop, then cached for the life of the proxy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aegaeon_common.config import ModelConfig
from tokenizers import Tokenizer

from aegaeon_proxy.chat_template import ChatTemplate
from aegaeon_proxy.params import model_defaults

SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip

__all__ = ["AssetError", "AssetRegistry", "ModelAssets", "load_assets"]


class AssetError(RuntimeError):
    """A model directory whose text assets are missing or malformed (a server problem)."""


@dataclass(frozen=True)
class ModelAssets:
    """Everything the front needs to turn text into ids and back for one model."""

    name: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # config.json max_position_embeddings: prompt + completion
    vocab_size: int  # ids at or above are invalid
    # generation_config.json's temperature / top_p / top_k: what a request leaving the
    # field out gets (an explicit value, 0 included, wins)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    # a LoRA adapter's base, whose text assets these are ("": the model's own)
    unit: str = ""
    # the texts of the tokenizer's special tokens (a grammar names these as tokens)
    special_texts: frozenset[str] = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def text_of(self, ids: Sequence[int]) -> str:
        """The ids' text, special tokens kept (as vLLM's echo, log-probabilities and
        ``/detokenize`` show them)."""
        tokenizer: Tokenizer = self.tokenizer  # the library's decode
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise AssetError(f"{path} not found") from None
        return {}
    except (OSError, ValueError) as exc:
        raise AssetError(f"{path}: cannot read ({exc})") from None
    if not isinstance(data, dict):
        raise AssetError(f"{path}: not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _template_source(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    raw = tok_config.get("chat_template")
    if isinstance(raw, list):  # named templates: [{"name", "template"}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if isinstance(raw, str):
        return raw
    jinja_file = model_dir / "chat_template.jinja"
    return jinja_file.read_text(encoding="utf-8") if jinja_file.exists() else None


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def load_assets(model: ModelConfig, base: ModelConfig | None = None) -> ModelAssets:
    """Read one model's text assets (blocking; call off the event loop); a LoRA
    adapter's are its ``base``'s (its tokenizer, template and window)."""
    path = Path(base.path if base is not None else model.path)
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises plain Exception for missing/bad files
        raise AssetError(f"{path / 'tokenizer.json'}: cannot load ({exc})") from None
    tok_config = _read_json(path / "tokenizer_config.json", required=False)
    gen_config = _read_json(path / "generation_config.json", required=False)
    config = _read_json(path / "config.json")
    special = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(tok_config.get(n)))}
    source = _template_source(path, tok_config)
    eos_ids = _ids(gen_config.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    eos_text = special.get("eos_token")
    eos_id = tokenizer.token_to_id(eos_text) if eos_text else None
    max_len = config.get("max_position_embeddings")
    if not isinstance(max_len, int) or max_len <= 0:
        raise AssetError(f"{path / 'config.json'}: max_position_embeddings missing or invalid")
    vocab = config.get("vocab_size")
    vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else tokenizer.get_vocab_size(True)
    try:
        defaults = model_defaults(gen_config)
    except ValueError as exc:
        raise AssetError(f"{path / 'generation_config.json'}: {exc}") from None
    return ModelAssets(
        name=model.name,
        tokenizer=tokenizer,
        chat_template=ChatTemplate(source, special) if source else None,
        eos_token_ids=_unique([*eos_ids, *([eos_id] if eos_id is not None else [])]),
        max_model_len=max_len,
        vocab_size=vocab_size,
        sampling_defaults=defaults,
        unit=base.name if base is not None else "",
        special_texts=frozenset(t.content for t in tokenizer.get_added_tokens_decoder().values()
                                if t.special),
    )


class AssetRegistry:
    """Lazily loaded, cached :class:`ModelAssets` for the served models (the configured
    ones, and those :meth:`add` adds at run time).

    Concurrent first requests for a model share one load, which runs on a
    worker thread; a failed load is not cached (the next request retries).
    """

    def __init__(self, models: Iterable[ModelConfig]) -> None:
        self._models = {m.name: m for m in models}
        self._loads: dict[str, asyncio.Future[ModelAssets]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._models

    async def get(self, name: str) -> ModelAssets:
        """The assets of a configured model; raises KeyError if unknown, AssetError if broken."""
        model = self._models[name]
        base = self._models.get(model.base) if model.base is not None else None
        if model.base is not None and base is None:
            raise AssetError(f"adapter {name!r}: its base {model.base!r} is not served")
        fut = self._loads.get(name)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(load_assets, model, base))
            self._loads[name] = fut
        try:
            return await asyncio.shield(fut)
        except AssetError:
            if self._loads.get(name) is fut:
                del self._loads[name]
            raise

    def add(self, model: ModelConfig) -> None:
        """Serve ``model``'s assets from now on (a model added at run time)."""
        self._models[model.name] = model

    def remove(self, name: str) -> None:
        """Forget ``name`` (removed at run time): it is unknown from now on."""
        self._models.pop(name, None)
        self._loads.pop(name, None)

    async def preload(self) -> None:
        """Load every model's assets now (at start-up), one after another."""
        for name in self._models:
            await self.get(name)
