"""The `nanoserve` command line: one subcommand per job (`generate` now; `serve` joins later)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from nanoserve.model.errors import ModelLoadError
from nanoserve.model.loader import DEFAULT_MODEL, load_model
from nanoserve.model.simple_generate import SimpleSampling, generate_tokens
from nanoserve.model.tokenizer import IncrementalDetokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by every subcommand that loads a model."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r} (default)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight/activation dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A readable LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    add_model_args(generate)
    add_sampling_args(generate)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="system message (with --chat)")
    generate.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    generate.set_defaults(handler=run_generate)
    return parser


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.chat:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def run_generate(args: argparse.Namespace) -> int:
    params = SimpleSampling(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    loaded = time.perf_counter()
    ids = prompt_ids(args, tokenizer)
    stops = set(tokenizer.stop_token_ids) | set(model.config.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    count = 0
    for token in generate_tokens(model, ids, params, stop_ids=sorted(stops)):
        count += 1
        if token in stops:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    elapsed = time.perf_counter() - loaded
    print(f"[{len(ids)} prompt + {count} new tokens in {elapsed:.2f} s, {count / elapsed:.1f} tok/s; "
          f"load {loaded - started:.1f} s]", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (FileNotFoundError, ModelLoadError, ValueError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
