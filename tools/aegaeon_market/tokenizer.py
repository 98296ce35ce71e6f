"""Byte-level BPE tokenizers trained on the shipped corpus, one per family.

Training is deterministic (same corpus and settings give the same
``tokenizer.json``) and cached per process: families whose vocabularies differ
only in the strings of their trailing special tokens share one training run.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from aegaeon_market.families import Family, Vocab

# Long enough for any prompt the benchmarks send; the model's window is in config.json.
MODEL_MAX_LENGTH = 32_768


def corpus_text() -> str:
    """The training corpus shipped in ``corpus/corpus.txt``."""
    path = resources.files("aegaeon_market") / "corpus" / "corpus.txt"
    return path.read_text(encoding="utf-8")


TrainingKey = tuple[int, tuple[str, ...], str, bool]


def training_key(vocab: Vocab) -> TrainingKey:
    """Vocabularies with equal keys share one trained BPE (only back specials differ)."""
    num_tokens = len(vocab.front_specials) + vocab.num_learned
    return num_tokens, vocab.front_specials, vocab.split_pattern, vocab.nfc


def split(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Split by ``pattern`` (the words, numbers and spaces BPE merges within), then map
    bytes to the byte-level alphabet."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


@functools.lru_cache(maxsize=8)
def _trained(key: TrainingKey) -> str:
    """JSON of a BPE trained to ``num_tokens`` (front specials included)."""
    num_tokens, front_specials, split_pattern, nfc = key
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = split(split_pattern)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_tokens,
        special_tokens=list(front_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer)
    if tok.get_vocab_size() != num_tokens:
        # the corpus ran out of merges: a larger vocab needs a larger corpus
        raise RuntimeError(f"BPE reached {tok.get_vocab_size()} tokens, wanted {num_tokens}")
    return tok.to_str()


def build_tokenizer(family: Family) -> Tokenizer:
    """The family's tokenizer: the shared BPE plus its specials and BOS rule."""
    vocab = family.vocab
    trained = _trained(training_key(vocab))
    if vocab.first_back_id != len(vocab.front_specials) + vocab.num_learned:
        trained = _with_placed_specials(trained, vocab)
    tok = Tokenizer.from_str(trained)
    tok.add_special_tokens(list(vocab.back_specials))
    if family.add_bos_token and family.bos_token is not None:
        bos = family.bos_token
        bos_id = vocab.special_ids[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() != vocab.num_tokens:
        raise RuntimeError(f"{family.key}: tokenizer has {tok.get_vocab_size()} tokens, "
                           f"expected {vocab.num_tokens}")
    return tok


def _with_placed_specials(trained: str, vocab: Vocab) -> str:
    """``trained`` with the back specials in the BPE's own vocabulary at their ids.

    Added tokens absent from the model's vocabulary always get the ids right
    after it (the ``id`` in ``tokenizer.json`` is not honoured on load); ids
    the model's vocabulary holds are kept, gap or not.
    """
    doc = json.loads(trained)
    ids = vocab.special_ids
    doc["model"]["vocab"].update({tok: ids[tok] for tok in vocab.back_specials})
    return json.dumps(doc, ensure_ascii=False)


def tokenizer_config_json(family: Family) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``AutoTokenizer`` (fast tokenizer, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos_token,
        "eos_token": family.eos_token,
        "pad_token": family.pad_token,
        "unk_token": family.unk_token,
        "add_bos_token": family.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": family.chat_template,
    }
