"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary.

A GGUF file keeps the tokenizer as arrays (``tokenizer.ggml.tokens``,
``merges``, ``token_type``) plus the name of the pre-tokenizer
(``tokenizer.ggml.pre``), whose splitting rules live in llama.cpp's code. The
byte-level BPE (``tokenizer.ggml.model`` = ``gpt2``) is rebuilt here with the
pre-tokenizer of the families served; other vocabularies are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aegaeon_engine.errors import CheckpointError
from gguf import TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from aegaeon_market.families import LLAMA3_SPLIT, QWEN_SPLIT
from aegaeon_market.gguf_file import GGUFFile
from aegaeon_market.tokenizer import split


def _gpt2() -> pre.PreTokenizer:  # the GPT-2 regex is ByteLevel's own
    return pre.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre.PreTokenizer:  # starcoder, smollm: every digit alone
    return pre.Sequence([pre.Digits(individual_digits=True), _gpt2()])


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` splits text before BPE."""

    build: Any  # () -> pre_tokenizers.PreTokenizer
    nfc: bool = False  # Qwen's tokenizers normalise to NFC first
    ignore_merges: bool = False  # Llama 3 looks whole words up before merging
    add_bos: bool = False  # llama.cpp's default when the file does not say


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt2": PreTokenizer(_gpt2), "gpt-2": PreTokenizer(_gpt2),
    "smollm": PreTokenizer(_digits_then_gpt2), "starcoder": PreTokenizer(_digits_then_gpt2),
    "llama-bpe": PreTokenizer(lambda: split(LLAMA3_SPLIT), ignore_merges=True, add_bos=True),
    "llama3": PreTokenizer(lambda: split(LLAMA3_SPLIT), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer(lambda: split(QWEN_SPLIT), nfc=True),
}


@dataclass(frozen=True)
class Vocab:
    """A rebuilt tokenizer and the special tokens around it."""

    tokenizer: Tokenizer
    tokens: list[str]
    bos_id: int | None
    eos_ids: tuple[int, ...]  # eos first, then end-of-turn ids the file names
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def _token_id(gguf: GGUFFile, key: str, num_tokens: int) -> int | None:
    value = gguf.get(f"tokenizer.ggml.{key}", int, None)
    if value is not None and not 0 <= value < num_tokens:
        raise CheckpointError(gguf.path, f"tokenizer.ggml.{key}",
                              f"token id {value} outside the vocabulary of {num_tokens}")
    return value  # type: ignore[no-any-return]


def _template(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor:
    """BOS before and/or EOS after each sequence, as llama.cpp's add_bos/add_eos do."""

    def piece(seq: str, type_id: int) -> str:
        parts = [f"{tokens[bos]}:{type_id}"] if bos is not None else []
        parts.append(f"${seq}:{type_id}")
        parts += [f"{tokens[eos]}:{type_id}"] if eos is not None else []
        return " ".join(parts)

    specials = [(tokens[i], i) for i in dict.fromkeys(i for i in (bos, eos) if i is not None)]
    return processors.TemplateProcessing(single=piece("A", 0),
                                         pair=f"{piece('A', 0)} {piece('B', 1)}",
                                         special_tokens=specials)


def read_vocab(gguf: GGUFFile) -> Vocab:
    """The tokenizer of ``gguf`` rebuilt as a `tokenizers.Tokenizer`."""
    kind = gguf.get("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise CheckpointError(gguf.path, "tokenizer.ggml.model",
                              f"{kind!r} vocabularies are not supported (only 'gpt2', "
                              "byte-level BPE)")
    pre_name = gguf.get("tokenizer.ggml.pre", str, "gpt2")
    rules = PRE_TOKENIZERS.get(pre_name)
    if rules is None:
        raise CheckpointError(gguf.path, "tokenizer.ggml.pre",
                              f"pre-tokenizer {pre_name!r} is not supported "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens", list)
    merges: list[str] = gguf.get("tokenizer.ggml.merges", list)
    types: list[int] = gguf.get("tokenizer.ggml.token_type", list, [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(gguf.path, "tokenizer.ggml.token_type",
                              f"{len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise CheckpointError(gguf.path, "tokenizer.ggml.tokens",
                                  f"token {token!r} appears twice (ids {vocab[token]} and {i})")
        vocab[token] = i
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise CheckpointError(gguf.path, "tokenizer.ggml.merges",
                                  f"merge {merge!r} is not two tokens of the vocabulary")
        pairs.append((left, right))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=rules.ignore_merges,
                                   fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the tokenizers library raises bare Exceptions
        raise CheckpointError(gguf.path, "tokenizer.ggml.tokens",
                              f"cannot build a BPE tokenizer ({exc})") from None
    if rules.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = rules.build()
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=True) if k == TokenType.CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True) if k == TokenType.USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    num = len(tokens)
    bos, eos = _token_id(gguf, "bos_token_id", num), _token_id(gguf, "eos_token_id", num)
    stops = [i for i in (eos, _token_id(gguf, "eot_token_id", num),
                         _token_id(gguf, "eom_token_id", num)) if i is not None]
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", bool, rules.add_bos)
    add_eos = gguf.get("tokenizer.ggml.add_eos_token", bool, False)
    for flag, token_id, key in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and token_id is None:
            raise CheckpointError(gguf.path, f"tokenizer.ggml.add_{key}_token",
                                  f"set, but the file has no {key}_token_id")
    if add_bos or add_eos:
        tok.post_processor = _template(tokens, bos if add_bos else None,
                                       eos if add_eos else None)
    if tok.get_vocab_size(with_added_tokens=True) != num:
        raise CheckpointError(gguf.path, "tokenizer.ggml.tokens",
                              f"rebuilt tokenizer has {tok.get_vocab_size(True)} ids, the file "
                              f"{num}")
    return Vocab(tok, tokens, bos, tuple(dict.fromkeys(stops)),
                 _token_id(gguf, "unknown_token_id", num), _token_id(gguf, "padding_token_id", num),
                 add_bos, add_eos, gguf.get("tokenizer.chat_template", str, None))
