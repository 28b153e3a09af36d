"""The `nanoserve` command line: `generate` (one prompt, streamed) and `serve` (HTTP).

Arguments are parsed before torch is imported (the packages load lazily), so `--help`,
`--version` and a bad option answer at once; a command imports what it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence

from nanoserve.cli_parser import OneLineErrorParser
from nanoserve.engine.options import add_engine_args, engine_options
from nanoserve.engine.sampling_params import DEFAULT_MAX_TOKENS
from nanoserve.model_path import DEFAULT_MODEL
from nanoserve.serve.cli import add_serve_subcommand


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanoserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r} (default)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                       help="most new tokens to generate (default %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off, default)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens below min_p x the top one's probability (0 = off, default)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="tokens already in the prompt or reply get their positive logits divided "
                            "and negative ones multiplied by this (>1 repeats less; 1.0 = off, default)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtract this from the logit of every token the reply already holds "
                            "(-2 to 2; 0 = off, default)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtract this times its count in the reply from each token's logit "
                            "(-2 to 2; 0 = off, default)")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--seed", type=int, default=None, help="seed for sampling (default: none)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="nanoserve", description="A readable LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", help="generate text for one prompt and stream it to stdout",
                                   description="Generate text for one prompt and stream it to stdout; "
                                               "what was loaded and the token counts go to stderr.")
    add_model_args(generate)
    add_sampling_args(generate)
    add_engine_args(generate, max_batch_size=1, kv_cache_bytes=None,
                    kv_cache_default="what --max-batch-size rows of --max-model-len need, at most 16,384 tokens' worth")
    generate.add_argument("--chat", action="store_true",
                          help="wrap the prompt in the chat template (the model's, or --chat-template's)")
    generate.add_argument("--system", default=None, help="system message (with --chat)")
    generate.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    generate.set_defaults(handler=run_generate)
    serve = add_serve_subcommand(commands)
    serve.set_defaults(handler=run_serve_handler)
    chat = commands.add_parser("chat", help="talk with a model in the terminal, turn by turn",
                               description="Talk with a model in the terminal: each reply streams as it is "
                                           "decoded; /reset forgets the conversation, /exit (or Ctrl-D) ends it, "
                                           "Ctrl-C stops a reply.")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help=f"a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r} (default)")
    add_sampling_args(chat)
    add_engine_args(chat, max_batch_size=1, kv_cache_bytes=None,
                    kv_cache_default="what --max-batch-size rows of --max-model-len need, at most 16,384 tokens' worth")
    chat.add_argument("--system", default=None, help="system message, kept across /reset")
    chat.set_defaults(handler=run_chat_handler)
    warmup = commands.add_parser(
        "warmup", help="build every decode graph a configuration needs into the compile cache",
        description="Build every compiled decode graph that MODEL with these engine options needs into the "
                    "compile cache ($NANOSERVE_CACHE_DIR, default ~/.cache/nanoserve/compile), so that a later "
                    "`generate` or `serve` with the same options loads them in seconds (for images and CI).")
    warmup.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r} (default)")
    add_engine_args(warmup, max_batch_size=32, kv_cache_bytes=None,
                    kv_cache_default="what --max-batch-size rows of --max-model-len need, at most 16,384 tokens' worth")
    warmup.set_defaults(handler=run_warmup)
    return parser


def run_warmup(args: argparse.Namespace) -> int:
    """Load the model with only cached graphs, then build each missing bucket here, one progress
    line per bucket with its time (the draft model's too, when speculating)."""
    options = {**engine_options(args, args.model), "warmup": "none"}
    from tqdm import tqdm

    from nanoserve.engine import build_engine

    if options.get("compile") is False:
        raise ValueError("warmup builds compiled graphs: drop --no-compile")
    options["compile"] = True
    started = time.perf_counter()
    if args.tensor_parallel_size > 1:  # every rank builds its own graphs at once, at build
        with build_engine(args.model, **{**options, "warmup": "eager"}) as engine:
            stats = engine.stats()
        print(f"nanoserve: model: {stats.graphs_ready} graphs ready on each of {args.tensor_parallel_size} ranks "
              f"({stats.graphs_loaded} already cached, {stats.graphs_built} built)", file=sys.stderr)
        print(f"nanoserve: warm-up done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        return 0
    with build_engine(args.model, **options) as engine:
        steps = [("model", engine.worker.decode_step)]
        if engine.worker.draft is not None:
            steps.append(("draft", engine.worker.draft.worker.decode_step))
        for name, step in steps:
            built = loaded = 0
            with tqdm(total=len(step.shapes), desc=f"{name} graphs", unit="graph", file=sys.stderr) as bar:
                def done(shape, seconds, compiled, bar=bar):
                    nonlocal built
                    built += compiled
                    bar.set_postfix_str(f"rows={shape[0]} width={shape[1]} queries={shape[2]} "
                                        f"{'built' if compiled else 'cached'} in {seconds:.1f} s")
                    bar.update()
                loaded = len(step.graphs)
                step.warmup(progress=done)
            print(f"nanoserve: {name}: {len(step.shapes)} graphs ready ({loaded} already cached, {built} built) "
                  f"in {step.graph_cache.root if step.graph_cache else 'this process'}", file=sys.stderr)
    print(f"nanoserve: warm-up done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def run_serve_handler(args: argparse.Namespace) -> int:
    args.func(args)
    return 0


def prompt_text(args: argparse.Namespace, tokenizer) -> str:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.chat:
        return text
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(no_chat_template(args.model))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def sampling_params(args: argparse.Namespace):
    """The sampling options of add_sampling_args as SamplingParams."""
    from nanoserve.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=tuple(args.stop), seed=args.seed)


def run_chat_handler(args: argparse.Namespace) -> int:
    from nanoserve.chat_cli import run_chat

    return run_chat(args)


def no_chat_template(model: str) -> str:
    from nanoserve.model.formats.chat_templates import BUILTIN

    return (f"{model}: the model has no chat template; give one with --chat-template FILE|NAME "
            f"(built-in: {', '.join(sorted(BUILTIN))}) or run without --chat")


def run_generate(args: argparse.Namespace) -> int:
    options = engine_options(args, args.model)  # a bad option or a missing model, before torch loads
    from nanoserve.engine import build_engine
    from nanoserve.model.formats.loader import has_chat_template

    params = sampling_params(args)
    started = time.perf_counter()
    if args.chat and args.chat_template is None and not has_chat_template(args.model):
        raise ValueError(no_chat_template(args.model))  # said before the weights load
    with build_engine(args.model, **options) as engine:
        return _generate(args, engine, params, started)


def _generate(args: argparse.Namespace, engine, params, started: float) -> int:
    from nanoserve.engine import RequestError
    from nanoserve.summary import describe_engine

    for line in describe_engine(engine, args.model, time.perf_counter() - started):
        print(f"nanoserve: {line}", file=sys.stderr)
    prompt = prompt_text(args, engine.tokenizer)
    generating = time.perf_counter()
    last = None
    for last in outputs(engine, prompt, params):
        sys.stdout.write(last.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - generating
    if last.finish_reason == "error":
        raise RequestError(last.error)
    count = len(last.token_ids)
    print(f"[{len(last.prompt_token_ids)} prompt + {count} new tokens in {elapsed:.2f} s, "
          f"{count / elapsed:.1f} tok/s; finish: {finish_note(engine, last, params)}]", file=sys.stderr)
    if engine.speculator is not None:
        print(f"[{speculation_note(engine.stats())}]", file=sys.stderr)
    return 0


def speculation_note(stats) -> str:
    """What speculation did for the reply: its acceptance, or why it did not run."""
    if not stats.spec_verify_steps:
        return ("speculative decoding: nothing was verified (no proposal: the reply never repeated a "
                "stretch of its context, or the row's adaptive length fell to 0)")
    return (f"speculative decoding: {stats.spec_accepted_tokens} of {stats.spec_proposed_tokens} proposed tokens "
            f"accepted ({stats.spec_acceptance_rate:.0%}), {stats.spec_mean_accepted_length:.2f} tokens per "
            f"verify step over {stats.spec_verify_steps} verify steps")


def outputs(engine, prompt: str, params) -> Iterator:
    """One request's RequestOutputs as the engine steps, to the finished one (the request is
    aborted if the caller stops early)."""
    request_id = engine.add_request(prompt, params)
    try:
        while True:
            for output in engine.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        return
    finally:
        engine.abort(request_id)


def finish_note(engine, output, params) -> str:
    """Why the reply ended, in words: which limit it reached, or what stopped it."""
    if output.finish_reason == "length":
        limit = engine.resolved.max_model_len
        if len(output.prompt_token_ids) + len(output.token_ids) >= limit:
            return f"length (max_model_len {limit} reached; raise --max-model-len)"
        return f"length (max_tokens {params.max_tokens} reached)"
    if output.finish_reason == "stop":
        stops = engine.eos_token_ids | set(params.stop_token_ids)
        what = "an end-of-text token" if output.token_ids and output.token_ids[-1] in stops else "a stop string"
        return f"stop ({what})"
    return str(output.finish_reason)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; `argv` None reads the process's own command line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except (FileNotFoundError, ValueError) as e:  # a missing model, a bad value, a refused prompt
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    if argv is None and args.command == "serve":
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process once the server has drained and stopped, its log flushed, without the
    interpreter's teardown of torch and its modules: that takes a good part of a second, which
    would count against an orchestrator's grace period, and nothing is left to finalize."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
