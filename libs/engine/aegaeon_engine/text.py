"""Text in and out of a checkpoint: its ``tokenizer.json`` and its chat template.

No torch here. The chat template is rendered the way transformers renders it
(a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``), then
tokenized without adding special tokens again, as ``apply_chat_template`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .spec import read_json_object


class TextCodec:
    """Encode prompts (plain or chat) and decode generated ids for one model."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(path, None, "missing file")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises bare Exceptions
            raise CheckpointError(path, None, f"unreadable tokenizer ({exc})") from None
        self.config_path = root / "tokenizer_config.json"
        self.config: dict[str, Any] = read_json_object(self.config_path) or {}
        self.chat_template = _template_source(root, self.config)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the tokenizer's own special tokens (e.g. BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template."""
        return list(self.tokenizer.encode(self.render_chat(messages),
                                          add_special_tokens=False).ids)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to ``messages`` with a generation prompt."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = self.chat_template
        if source is None:
            raise CheckpointError(self.config_path, "chat_template", "missing (needed by --chat)")

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(source).render(
                messages=messages, add_generation_prompt=True,
                bos_token=_token_text(self.config.get("bos_token")),
                eos_token=_token_text(self.config.get("eos_token")))
        except TemplateError as exc:
            raise CheckpointError(self.config_path, "chat_template", str(exc)) from None

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def _template_source(root: Path, config: dict[str, Any]) -> str | None:
    """The chat template: ``tokenizer_config.json``'s (a string, or the ``default`` of a
    named list), else ``chat_template.jinja`` beside it (as transformers 5 saves it)."""
    raw = config.get("chat_template")
    if isinstance(raw, list):
        raw = next((t.get("template") for t in raw
                    if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(raw, str):
        return raw
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(jinja, None, f"unreadable ({exc})") from None
    return None


def _token_text(token: object) -> str:
    # tokenizer_config may hold a token as a string or as {"content": ...}
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
