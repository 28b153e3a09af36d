"""`nanoserve serve`: build an engine from command-line options and serve it over HTTP.

Nothing here imports FastAPI, uvicorn or torch until the command runs, so `--help` answers at
once and the rest of the CLI works without the `serve` extra installed. The port is bound
before the model loads: a busy port fails in a second, not after the load.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import time
from pathlib import Path

from nanoserve.engine.options import add_engine_args, engine_options, parse_bytes
from nanoserve.model_path import DEFAULT_MODEL, resolve_model_path
from nanoserve.serve.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_WAITING,
    SHUTDOWN_GRACE,
)
from nanoserve.structured.tool_parsers import FORMATS as TOOL_CALL_FORMATS

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_serve_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, Anthropic's /v1/messages, /v1/models, /tokenize, /detokenize, /health, "
                    "/metrics); "
                    "SIGTERM or SIGINT drains it (see --drain-timeout).")
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as `vllm serve MODEL` takes it (same as --model)")
    parser.add_argument("--model", default=None,
                        help=f"{DEFAULT_MODEL!r} (the default), a .gguf file, or a Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: from the model argument)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and /metrics "
                             "(the API, /tokenize, /detokenize, /docs, /openapi.json; "
                             "default: $NANOSERVE_API_KEY)")
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted, e.g. 1M (413 beyond it; default 16M)")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                        help="seconds a request body may go without a byte arriving before the request "
                             "gets a 408 (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                        help="on SIGTERM/SIGINT: seconds requests in flight may take to finish before "
                             "they are ended (default %(default)s); the process exits about 2 s after")
    parser.add_argument("--max-waiting-requests", type=_non_negative_int, default=DEFAULT_MAX_WAITING,
                        help="requests that may wait for a row; past them a new request gets a 503 with "
                             "Retry-After instead of waiting without limit (default %(default)s)")
    add_engine_args(parser, max_batch_size=32, kv_cache_bytes=None,
                    kv_cache_default="what the rows need at the model's context, at most 16,384 tokens' worth")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_FORMATS),
                        help="the format tool calls are prompted and parsed in (default: chosen from the "
                             "chat template; 'generic' for any model: a JSON reply enforced by a grammar)")
    parser.add_argument("--pooling", default=None, choices=["last", "mean", "cls", "rank"],
                        help="serve /v1/embeddings (last, mean, cls) or /v1/rerank (rank: a Qwen3-Reranker) "
                             "with this pooling (default: the model's own, from its GGUF pooling_type or "
                             "Sentence-Transformers config; a model with none answers those routes 400)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="default %(default)s")
    parser.set_defaults(func=run_serve)
    return parser


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def served_name(model: str) -> str:
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def chosen_model(args: argparse.Namespace) -> str:
    """The model named by MODEL or --model (the default when neither); both, differing, is an error."""
    if args.model_path and args.model and args.model_path != args.model:
        raise SystemExit(f"nanoserve serve: two models given ({args.model_path!r} and --model "
                         f"{args.model!r}); name one")
    return args.model_path or args.model or DEFAULT_MODEL


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening (uvicorn listens once the app is up);
    SystemExit with the reason when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = "; another process listens there: stop it or choose another --port" \
            if exc.errno == errno.EADDRINUSE else ""
        raise SystemExit(f"nanoserve serve: cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def describe_chat(engine) -> tuple[str, bool]:
    """The startup summary's line on chat, and whether /v1/chat/completions can serve."""
    if getattr(engine.tokenizer, "chat_template", None) is not None:
        given = engine.config.chat_template
        return "chat template: " + ("the model's own" if given is None else repr(given)), True
    from nanoserve.model.formats.chat_templates import BUILTIN

    return ("chat unavailable: the model has no chat template, so /v1/chat/completions answers 400; "
            f"--chat-template FILE|NAME gives it one (built-in: {', '.join(sorted(BUILTIN))})"), False


def run_serve(args: argparse.Namespace) -> None:
    """Bind the port, build the engine, then serve until interrupted."""
    model = chosen_model(args)
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        # A torchrun rank other than 0 applies rank 0's plans and binds no port (ranks may
        # share a host); build_engine returns only on rank 0, so this exits with the rank.
        from nanoserve.engine import build_engine
        build_engine(model, **engine_options(args))
        return
    sock = bind(args.host, args.port)
    try:
        try:
            resolve_model_path(model)  # a missing model is refused before torch loads
        except FileNotFoundError as exc:
            raise SystemExit(f"nanoserve serve: {exc}") from None
        _serve(args, model, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, model: str, sock: socket.socket) -> None:
    try:
        import uvicorn

        from nanoserve.serve.app import create_app
        from nanoserve.serve.engine_loop import EngineLoop
        from nanoserve.serve.server import DrainingServer
    except ImportError as exc:
        raise SystemExit(f"nanoserve serve needs FastAPI and uvicorn: pip install 'nanoserve[serve]' "
                         f"({exc})") from exc
    from nanoserve.engine import build_engine
    from nanoserve.summary import describe_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("nanoserve.serve")
    if args.host not in _LOOPBACK and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                    args.host)
    started = time.perf_counter()
    try:
        engine = build_engine(model, **engine_options(args))
    except (FileNotFoundError, ValueError) as exc:  # a missing or bad model file, a pool too small
        raise SystemExit(f"nanoserve serve: {exc}") from exc
    for line in describe_engine(engine, model, time.perf_counter() - started):
        log.info("%s", line)
    chat, available = describe_chat(engine)
    (log.info if available else log.warning)("%s", chat)
    name = args.served_model_name or served_name(model)
    app = create_app(EngineLoop(engine, max_waiting=args.max_waiting_requests), name, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout,
                     tool_call_parser=args.tool_call_parser, pooling=args.pooling)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("serving %r at http://%s:%d%s", name, host, sock.getsockname()[1],
             " (API key required)" if args.api_key else "")
    try:
        DrainingServer(config, app, args.drain_timeout).run(sockets=[sock])
    finally:
        engine.close()  # a tensor-parallel engine's ranks leave with the server
