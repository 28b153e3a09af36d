"""`nanoserve serve`: build an engine from command-line options and serve it over HTTP.

Nothing here imports FastAPI or uvicorn until the command runs, so the rest of the CLI works
without the `serve` extra installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1.5GiB' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 536870912, 512M, 2G)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def add_serve_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics).")
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default), a .gguf file, or a Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                             "(default: $NANOSERVE_API_KEY)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-batch-size", type=int, default=32)
    engine.add_argument("--kv-cache-bytes", type=parse_bytes, default=None, help="KV budget, e.g. 512M, 2G")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    engine.add_argument("--warmup", default="lazy", choices=["lazy", "eager"],
                        help="with --compile: build every bucket's graph before serving (eager) or on "
                             "first use (lazy, the default: quick start, slow first requests)")
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
        engine = build_engine(
            args.model, max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
            kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size, dtype=args.dtype,
            device=args.device, compile=args.compile, warmup=args.warmup)
    except (FileNotFoundError, ValueError) as exc:  # a missing or bad model file, a pool too small
        raise SystemExit(f"nanoserve serve: {exc}") from exc
    name = args.served_model_name or served_name(args.model)
    stats = engine.stats()
    log.info("serving %s as %r: max_model_len=%d, %d KV blocks of %d tokens, up to %d requests per step",
             args.model, name, engine.config.max_model_len, stats["blocks_total"], args.block_size,
             args.max_batch_size)
    app = create_app(EngineLoop(engine), name, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
