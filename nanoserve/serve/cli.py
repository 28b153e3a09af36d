"""`nanoserve serve`: build an engine from command-line options and serve it over HTTP.

Nothing here imports FastAPI or uvicorn until the command runs, so the rest of the CLI works
without the `serve` extra installed.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from nanoserve.engine.options import add_engine_args, engine_kwargs, parse_bytes
from nanoserve.serve.limits import DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_serve_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics); "
                    "SIGTERM or SIGINT drains it (see --drain-timeout).")
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default), a .gguf file, or a Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                             "(default: $NANOSERVE_API_KEY)")
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted, e.g. 1M (413 beyond it; default 16M)")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                        help="on SIGTERM/SIGINT: seconds requests in flight may take to finish before "
                             "they are ended (default %(default)s)")
    add_engine_args(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=run_serve)
    return parser


def served_name(model: str) -> str:
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def run_serve(args: argparse.Namespace) -> None:
    """Build the engine, then serve until interrupted."""
    try:
        import uvicorn

        from nanoserve.serve.app import create_app
        from nanoserve.serve.engine_loop import EngineLoop
        from nanoserve.serve.server import DrainingServer
    except ImportError as exc:
        raise SystemExit(f"nanoserve serve needs FastAPI and uvicorn: pip install 'nanoserve[serve]' "
                         f"({exc})") from exc
    from nanoserve.engine import build_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("nanoserve.serve")
    if args.host not in _LOOPBACK and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                    args.host)
    try:
        engine = build_engine(args.model, **engine_kwargs(args))
    except (FileNotFoundError, ValueError) as exc:  # a missing or bad model file, a pool too small
        raise SystemExit(f"nanoserve serve: {exc}") from exc
    name = args.served_model_name or served_name(args.model)
    stats = engine.stats()
    log.info("serving %s as %r: max_model_len=%d, %d KV blocks of %d tokens, up to %d requests per step",
             args.model, name, engine.config.max_model_len, stats["blocks_total"], args.block_size,
             args.max_batch_size)
    app = create_app(EngineLoop(engine), name, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    DrainingServer(config, app, args.drain_timeout).run()
