"""The HTTP layer: an OpenAI-compatible server over one Engine owned by one background thread.

``create_app`` needs FastAPI (the ``serve`` extra); import it from ``nanoserve.serve.app``.
The CLI entry points live in ``nanoserve.serve.cli`` and import nothing heavy.
"""

from nanoserve.serve.cli import add_serve_subcommand, run_serve

__all__ = ["add_serve_subcommand", "run_serve"]
