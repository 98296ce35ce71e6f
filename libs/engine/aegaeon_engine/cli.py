"""``aegaeon generate``: run one model with the engine alone (no services).

Nothing heavy is imported at module level: the CLI table imports this module
to build its parser.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``generate`` parser."""
    parser = sub.add_parser("generate", help="generate text with the engine alone",
                            description="Tokenize a prompt with the model's tokenizer, "
                                        "generate, print the text.")
    parser.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    parser.add_argument("--prompt", help="prompt text (default: read stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user turn with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", default=None, help="serving dtype (default: checkpoint's)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--ids", action="store_true", help="also print the generated token ids")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate and print; returns the process exit code."""
    from .errors import CheckpointError
    from .sampling import SamplingParams
    from .text import TextCodec

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens,
                                ignore_eos=args.ignore_eos)
        from .llm import LLM

        llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
        codec = TextCodec(args.model)
        ids = (codec.encode_chat([{"role": "user", "content": prompt}]) if args.chat
               else codec.encode(prompt))
        out = llm.generate([ids], params)[0]
    except (CheckpointError, ValueError, RuntimeError) as exc:
        print(f"aegaeon generate: error: {exc}", file=sys.stderr)
        return 2
    print(codec.decode(out))
    if args.ids:
        print(out)
    return 0
