"""The four Llama-family variants the market builds, as Hugging Face defines them.

A `Family` holds what every model of one variant shares: the architecture
class, the config keys that differ between variants, and the tokenizer
conventions (special tokens, BOS behaviour, chat template, end-of-turn ids).
Sizes live in `ladder`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources

# Pre-tokenizer splits. Llama 3's (tiktoken style) keeps up to three digits
# together; Qwen2's splits every digit. transformers 5 rebuilds Qwen2 (and so
# Qwen3-era) tokenizers with Qwen's split and NFC whatever tokenizer.json says,
# so the Qwen vocabulary must be trained with exactly those.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Vocab:
    """A family's vocabulary; `tokenizer.training_key` says which ones share a BPE.

    ``front_specials`` take ids 0.. (SentencePiece-era models such as Mistral);
    ``back_specials`` follow the learned tokens (tiktoken-era models such as
    Llama 3 and Qwen). ``size`` counts everything, so config ``vocab_size``
    equals ``len(tokenizer)`` and every embedding row is reachable.

    A real model's vocabulary (`presets`) is larger than the shipped corpus
    can train: ``size`` is then the released ``vocab_size`` (embedding rows),
    the BPE learns only ``learned`` tokens and the back specials keep their
    released ids from ``back_start``; the ids in between name no token.
    """

    size: int
    front_specials: tuple[str, ...]
    back_specials: tuple[str, ...]
    split_pattern: str
    nfc: bool = False
    learned: int | None = None
    back_start: int | None = None

    @property
    def num_learned(self) -> int:
        """Tokens the BPE learns: the 256 byte symbols plus merges."""
        if self.learned is not None:
            return self.learned
        return self.size - len(self.front_specials) - len(self.back_specials)

    @property
    def first_back_id(self) -> int:
        """Id of the first back special (right after the learned tokens unless placed)."""
        if self.back_start is not None:
            return self.back_start
        return len(self.front_specials) + self.num_learned

    @property
    def special_ids(self) -> dict[str, int]:
        """Id of every special token: front ones from 0, back ones from `first_back_id`."""
        ids = {tok: i for i, tok in enumerate(self.front_specials)}
        ids.update({tok: self.first_back_id + i for i, tok in enumerate(self.back_specials)})
        return ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the tokenizer (``size`` unless it is a real model's larger vocabulary)."""
        return len(self.front_specials) + self.num_learned + len(self.back_specials)

    @property
    def token_id_ranges(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` ranges of the ids that name a token."""
        learned_end = len(self.front_specials) + self.num_learned
        if self.first_back_id == learned_end:
            return ((0, learned_end + len(self.back_specials)),)
        return ((0, learned_end), (self.first_back_id,
                                   self.first_back_id + len(self.back_specials)))


@dataclass(frozen=True)
class Family:
    """One architecture variant and its tokenizer conventions."""

    key: str
    architecture: str
    model_type: str
    vocab: Vocab
    template: str
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    # generation_config eos ids (the real families stop on several tokens)
    stop_tokens: tuple[str, ...]
    # bos_token_id of config.json; Qwen names one although its tokenizer adds none
    config_bos_token: str
    qkv_bias: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-5

    @property
    def chat_template(self) -> str:
        """The Jinja chat template shipped in ``templates/<template>.jinja``."""
        path = resources.files("aegaeon_market") / "templates" / f"{self.template}.jinja"
        return path.read_text(encoding="utf-8").strip()


_LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(3, 8)),
)
_QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>",
)
_MISTRAL_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
)

# Sizes differ per family so embedding shapes differ too; the corpus holds
# about 8.6k (Llama split) or 7.5k (Qwen split) distinct merges, so these
# vocabularies are fully trained.
LLAMA3_VOCAB = Vocab(8192, (), _LLAMA3_SPECIALS, LLAMA3_SPLIT)
QWEN_VOCAB = Vocab(6144, (), _QWEN_SPECIALS, QWEN_SPLIT, nfc=True)
# Mistral's real tokenizer is SentencePiece; ours is byte-level like the others.
MISTRAL_VOCAB = Vocab(4096, _MISTRAL_SPECIALS, (), LLAMA3_SPLIT)

# Qwen3 is Qwen2's conventions with q/k norms instead of the q/k/v bias
_QWEN2 = Family(
    key="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2",
    vocab=QWEN_VOCAB, template="qwen2", bos_token=None, eos_token="<|im_end|>",
    pad_token="<|endoftext|>", unk_token=None, add_bos_token=False,
    stop_tokens=("<|im_end|>", "<|endoftext|>"), config_bos_token="<|endoftext|>",
    qkv_bias=True, rms_norm_eps=1e-6,
)
FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family(
            key="llama", architecture="LlamaForCausalLM", model_type="llama",
            vocab=LLAMA3_VOCAB, template="llama3", bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>", unk_token=None,
            add_bos_token=True, stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
            config_bos_token="<|begin_of_text|>",
        ),
        Family(
            key="mistral", architecture="MistralForCausalLM", model_type="mistral",
            vocab=MISTRAL_VOCAB, template="mistral", bos_token="<s>", eos_token="</s>",
            pad_token="<unk>", unk_token="<unk>", add_bos_token=True, stop_tokens=("</s>",),
            config_bos_token="<s>",
        ),
        _QWEN2,
        replace(_QWEN2, key="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3",
                template="qwen3", qkv_bias=False, qk_norm=True),
    )
}
