"""LoRA adapters made by ``peft`` (the oracle) over small transformers checkpoints, and
their references: transformers + PEFT's ``merge_and_unload`` greedy decoding (the
greedy decoding, :func:`greedy_tokens`, the real-model tests' reference too).

The e2e modules' adapters and references (over the markets kept across sessions) are
kept across sessions too (:func:`kept`): a session makes them again only when something
they depend on changed."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from market_support import kept_root

# (rank, target modules, rsLoRA): the three adapters the tests serve
ADAPTERS: tuple[tuple[int, tuple[str, ...], bool], ...] = (
    (8, ("q_proj", "v_proj"), False),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj"), True),
    (64, ("o_proj", "gate_proj", "up_proj", "down_proj"), False),
)


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    rank: int
    targets: tuple[str, ...]
    rslora: bool


def make_peft_adapter(base_dir: Path, out: Path, rank: int, targets: Sequence[str],
                      rslora: bool = False, seed: int = 0, alpha: float | None = None,
                      keep: bool = False) -> PeftAdapter:
    """A random LoRA adapter of the checkpoint in ``base_dir``, saved by ``peft`` into
    ``out``: both A and B random (``init_lora_weights=False``), so it changes what the
    model says. With ``keep`` (a base kept across sessions: its adapter names its path)
    it is made once and kept too (:func:`kept`; the same arguments make the same bytes),
    then copied into ``out``."""
    if not keep:
        _save_peft_adapter(base_dir, out, rank, targets, rslora, seed, alpha)
        return PeftAdapter(out, rank, tuple(targets), rslora)
    parts = ["adapter", str(base_dir), rank, list(targets), rslora, seed, alpha]
    made = _kept_path(parts, [base_dir]).with_suffix("")
    if not made.is_dir():
        aside = Path(tempfile.mkdtemp(prefix=f".{made.name}-", dir=made.parent))
        _save_peft_adapter(base_dir, aside, rank, targets, rslora, seed, alpha)
        try:
            aside.rename(made)
        except OSError:  # another session kept the same adapter first
            shutil.rmtree(aside)
    shutil.copytree(made, out, dirs_exist_ok=True)
    return PeftAdapter(out, rank, tuple(targets), rslora)


def _save_peft_adapter(base_dir: Path, out: Path, rank: int, targets: Sequence[str],
                       rslora: bool, seed: int, alpha: float | None) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(targets), use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)


def greedy_tokens(model: Any, prompts: Sequence[Sequence[int]],
                  num_tokens: int) -> list[list[int]]:
    """transformers' greedy decoding of ``prompts`` side by side in one batch (left-padded,
    the padding masked out), EOS taken like any token (as ``ignore_eos`` serves)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=num_tokens, eos_token_id=None,
                              pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate() takes the model's and stops
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return [[int(t) for t in row] for row in out[:, width:]]


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: Sequence[Sequence[int]],
                num_tokens: int) -> list[list[int]]:
    """transformers + PEFT (merged into the weights) greedy in float32, EOS taken like any
    token; the base alone when ``adapter_dir`` is None."""
    return peft_references(base_dir, {"": adapter_dir}, prompts, num_tokens)[""]


def peft_references(base_dir: Path, adapters: dict[str, Path | None],
                    prompts: Sequence[Sequence[int]], num_tokens: int,
                    keep: bool = False) -> dict[str, list[list[int]]]:  # fmt: skip
    """:func:`peft_greedy` for each adapter (name -> its directory, None: the base alone),
    the base read once; with ``keep`` (checkpoints kept across sessions: a temporary
    adapter names its temporary base, and would key a new entry every session), kept
    across sessions too (:func:`kept`)."""
    if not keep:
        return _peft_references(base_dir, adapters, prompts, num_tokens)
    folders = [base_dir, *(d for _, d in sorted(adapters.items()) if d is not None)]
    parts = ["greedy", [list(p) for p in prompts], num_tokens, sorted(adapters)]
    refs: dict[str, list[list[int]]] = kept(
        parts, folders, lambda: _peft_references(base_dir, adapters, prompts, num_tokens))
    return refs


def _peft_references(base_dir: Path, adapters: dict[str, Path | None],
                     prompts: Sequence[Sequence[int]],
                     num_tokens: int) -> dict[str, list[list[int]]]:  # fmt: skip
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    out: dict[str, list[list[int]]] = {}
    for name, adapter_dir in adapters.items():
        model = base
        if adapter_dir is not None:  # merging changes the weights: a copy of the base
            model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir)
            model = model.merge_and_unload().eval()
        out[name] = greedy_tokens(model, prompts, num_tokens)
    return out


def peft_prompt_logprobs(base_dir: Path, adapter_dir: Path | None, ids: Sequence[int],
                         dtype: torch.dtype) -> torch.Tensor:
    """transformers + PEFT (merged) in ``dtype``: each prompt token's log-probability (after
    the first), what lm-evaluation-harness's loglikelihood reads; the base alone when
    ``adapter_dir`` is None. Kept across sessions (:func:`kept`)."""
    folders = [base_dir] if adapter_dir is None else [base_dir, adapter_dir]
    parts = ["prompt-logprobs", list(ids), str(dtype), adapter_dir is None]
    logprobs: list[float] = kept(parts, folders,
                                 lambda: _prompt_logprobs(base_dir, adapter_dir, ids, dtype))
    return torch.tensor(logprobs, dtype=torch.float32)


def _prompt_logprobs(base_dir: Path, adapter_dir: Path | None, ids: Sequence[int],
                     dtype: torch.dtype) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    if adapter_dir is not None:
        from peft import PeftModel  # (seconds to import: only where an adapter is merged)

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    picked = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return [float(x) for x in picked]


def kept(parts: list[Any], folders: Sequence[Path], compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON value, kept across sessions beside the e2e markets by a
    digest of all it depends on: ``parts`` (its arguments), the files of ``folders``
    (the checkpoints it reads), this module's code and the torch, transformers and peft
    versions. A session computes it again only when one of those changed (a file
    rewritten with the same bytes: the same key)."""
    from aegaeon_common.kept import write_atomic

    path = _kept_path(parts, folders)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not kept yet (or cut short): computed, then kept
        pass
    value = compute()
    write_atomic(path, json.dumps(value))
    return value


def _kept_path(parts: list[Any], folders: Sequence[Path]) -> Path:
    """Where what :func:`kept` keys by ``parts`` and ``folders`` is kept (its folder made)."""
    versions = [version(name) for name in ("torch", "transformers", "peft")]
    digest = hashlib.sha256(json.dumps([parts, versions]).encode())
    digest.update(Path(__file__).read_bytes())
    for read in map(Path, folders):
        digest.update(_folder_digest(read, _signature(read)))
    folder = kept_root() / f"aegaeon-test-references-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{digest.hexdigest()[:32]}.json"


def _signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """The files of ``folder`` by name, size and modification time."""
    files = sorted(f for f in folder.iterdir() if f.is_file())
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@functools.cache
def _folder_digest(folder: Path, signature: tuple[tuple[str, int, int], ...]) -> bytes:
    """The digest of the files of ``folder`` (names and contents), once per ``signature``
    in a session: a 135M checkpoint takes a third of a second to hash."""
    digest = hashlib.sha256()
    for name, _, _ in signature:
        digest.update(name.encode())
        with (folder / name).open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.digest()


def lora_market(root: Path, bases: dict[str, Path]) -> Path:
    """A market in ``root`` whose models are ``bases`` (name -> checkpoint directory,
    linked in, not copied: a test adds adapters to it without touching the shared
    markets those checkpoints live in)."""
    from aegaeon_common.market_index import Manifest, MarketEntry
    from aegaeon_engine import ModelSpec
    from aegaeon_market.manifest import write_manifest

    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, path in bases.items():
        (root / name).symlink_to(path.resolve(), target_is_directory=True)
        spec = ModelSpec.from_dir(path)
        entries.append(MarketEntry(name, root / name, spec.architecture, 0, spec.dtype,
                                   source=str(path)))
    write_manifest(root, Manifest(0, "", "", tuple(entries)))
    return root
