"""The `nanoserve` command line: `generate` (one prompt, streamed) and `serve` (HTTP)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from nanoserve.engine import RequestError, SamplingParams, build_engine
from nanoserve.engine.options import add_engine_args, engine_kwargs
from nanoserve.model.errors import ModelLoadError
from nanoserve.model.loader import DEFAULT_MODEL
from nanoserve.serve.cli import add_serve_subcommand


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r} (default)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A readable LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    add_model_args(generate)
    add_sampling_args(generate)
    add_engine_args(generate)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="system message (with --chat)")
    generate.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    generate.set_defaults(handler=run_generate)
    serve = add_serve_subcommand(commands)
    serve.set_defaults(handler=run_serve_handler)
    return parser


def run_serve_handler(args: argparse.Namespace) -> int:
    args.func(args)
    return 0


def prompt_text(args: argparse.Namespace, tokenizer) -> str:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.chat:
        return text
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=tuple(args.stop), seed=args.seed)
    started = time.perf_counter()
    engine = build_engine(args.model, **engine_kwargs(args))
    loaded = time.perf_counter()
    for delta in engine.stream(prompt_text(args, engine.tokenizer), params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - loaded
    stats = engine.stats()
    count = stats["decode_tokens"] + 1
    print(f"[{stats['prefill_tokens']} prompt + {count} new tokens in {elapsed:.2f} s, "
          f"{count / elapsed:.1f} tok/s; load {loaded - started:.1f} s]", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (FileNotFoundError, ModelLoadError, RequestError, ValueError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
