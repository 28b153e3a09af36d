"""From a model argument (a .gguf path, a HF directory, or "smollm2") to a network and a tokenizer."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.gguf_loader import GGUFCheckpoint
from nanoserve.model.formats.hf_loader import SafetensorsWeights, safetensors_files
from nanoserve.model.formats.pooling import model_pooling
from nanoserve.model.formats.tokenizer import Tokenizer, hf_chat_template
from nanoserve.model.formats.validate import checked_gguf_config
from nanoserve.model.formats.validate_hf import checked_hf_config
from nanoserve.model.network.architectures import architecture
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.llama import LlamaModel, hf_norm_offset, unfuse_hf_weights
from nanoserve.model.quant.gguf_blocks import BlockTensor
from nanoserve.model.quant.group_codes import GroupCodes
from nanoserve.model.quant.weight_plan import (
    WeightPlan,
    hf_parts,
    pack_head,
    pack_linears,
    pack_model,
    weight_types,
)
from nanoserve.model_path import DEFAULT_MODEL, resolve_model_path


def build_model(config: ModelConfig, hf_weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaModel:
    """A LlamaModel holding `hf_weights` (HF naming), in eval mode, without gradients."""
    # Built on the meta device so no time is spent initialising weights about to be replaced.
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_hf_weights(hf_weights)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


@dataclass
class ModelHeader:
    """What the host side reads of a model argument, the file opened once: its config, and the
    source its tokenizer is built from (no weights are read)."""

    path: Path
    config: ModelConfig
    checkpoint: GGUFCheckpoint | None  # None for a HF directory

    def tokenizer(self) -> Tokenizer:
        return _tokenizer(self.path, self.checkpoint)


def _tokenizer(path: Path, checkpoint: GGUFCheckpoint | None) -> Tokenizer:
    """The tokenizer of a HF directory (no checkpoint) or of an opened GGUF's metadata."""
    if checkpoint is None:
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_metadata(checkpoint.metadata, source=str(path))


def read_header(model: str) -> ModelHeader:
    """The ModelHeader of a model argument (opening a GGUF parses its vocabulary: do it once)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return ModelHeader(path, checked_hf_config(path), None)
    checkpoint = GGUFCheckpoint.open(path)
    return ModelHeader(path, checked_gguf_config(checkpoint), checkpoint)


def load_config(model: str) -> ModelConfig:
    """Only the ModelConfig of a model argument (no weights are read)."""
    return read_header(model).config


def load_tokenizer(model: str) -> Tokenizer:
    """Only the tokenizer of a model argument (no weights are read)."""
    path = resolve_model_path(model)
    return _tokenizer(path, None if path.is_dir() else GGUFCheckpoint.open(path))


def has_chat_template(model: str) -> bool:
    """Whether a model argument carries a chat template (read from its metadata, no weights)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return bool(hf_chat_template(path))
    return bool(GGUFCheckpoint.open(path).metadata.get("tokenizer.chat_template"))


PROGRESS_FROM_BYTES = 1 << 30  # a file this large loads with a progress bar over its layers


def load_model(model: str | ModelHeader = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", weights: WeightPlan | None = None,
               shard: Callable[[LlamaModel, dict[str, GroupCodes]], dict[str, GroupCodes]] | None = None,
               with_tokenizer: bool = True) -> tuple[LlamaModel, Tokenizer | None]:
    """Load weights and tokenizer. Raises FileNotFoundError or ModelLoadError naming the file at fault.

    With ``weights`` the model is held in that plan's format and dtype (``dtype`` is then
    ignored); with "int4" a GGUF's block-quantised tensors run from their own blocks
    (gguf_blocks), never rounded again. ``model.weight_types`` says how each tensor type runs.
    The file is read one tensor at a time (``fill_model``): no float copy of the whole model is
    ever made. ``shard`` (tensor parallelism) cuts the float model and its block groups to one
    rank's part before they are packed, and returns the groups it kept: that path builds the
    whole float model first. ``with_tokenizer=False`` (a tensor-parallel rank's worker) reads no
    tokenizer and returns None for it. A ModelHeader is a file already opened (read_header).
    """
    timer = LoadTimer()
    header = model if isinstance(model, ModelHeader) else read_header(model)
    path, config, ckpt = header.path, header.config, header.checkpoint
    weights_file: WeightFile = (SafetensorsWeights(path, architecture(config.architecture)) if ckpt is None
                                else GGUFWeights(ckpt, config))
    timer.lap("metadata")
    tokenizer = header.tokenizer() if with_tokenizer else None
    if with_tokenizer:
        timer.lap("tokenizer")
    files = safetensors_files(path) if path.is_dir() else [path]
    file_bytes = sum(f.stat().st_size for f in files)
    if shard is not None:
        built = _load_whole(path, config, weights_file, dtype, device, weights, shard)
    else:
        built = _build_meta(path, config, weights_file)
        fill_model(built, weights_file, weights, dtype if weights is None else weights.dtype,
                   progress=f"loading {path.name}" if file_bytes > PROGRESS_FROM_BYTES else None)
        built = built.to(device)
    timer.lap("weights")
    built.load_stages = timer.stages
    built.file_bytes = file_bytes
    # The pooling the files declare (embedding and reranking models), None for a generation model.
    built.pooling = model_pooling(path, None if ckpt is None else ckpt.metadata)
    return built, tokenizer


class WeightFile(Protocol):
    """A model file's weights, read one tensor at a time by HF name."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...
    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...
    def blocks(self) -> dict[str, BlockTensor]: ...
    def types(self) -> dict[str, str]: ...  # each tensor's type in the file ("Q4_K", "F32"), by HF name
    def release(self) -> None: ...  # the file's pages read so far need not stay resident


@dataclass
class GGUFWeights:
    """A GGUF checkpoint as a WeightFile, its tensors in HF naming and row order for ``config``
    (a SafetensorsWeights is one as it is)."""

    ckpt: GGUFCheckpoint
    config: ModelConfig

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.ckpt.shapes(self.config)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.ckpt.read(name, self.config, dtype)

    def blocks(self) -> dict[str, BlockTensor]:
        return self.ckpt.block_tensors(self.config)

    def types(self) -> dict[str, str]:
        return self.ckpt.tensor_types()

    def release(self) -> None:
        self.ckpt.reader.release_pages()


class LoadTimer:
    """Wall seconds of a load's named stages, in order (the startup summary's load line)."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now


def _build_meta(path: Path, config: ModelConfig, weights_file: WeightFile) -> LlamaModel:
    """The model on the meta device, its tensors' names and shapes checked against the file's."""
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in unfuse_hf_weights(model).items()}
    found = weights_file.shapes()
    missing, unused = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or unused:
        raise ModelLoadError(path, f"weights do not match the model config: missing {missing[:8]}, "
                                   f"unused {unused[:8]}")
    wrong = [f"size mismatch for {n}: the file has {list(found[n])}, the config needs {list(s)}"
             for n, s in expected.items() if found[n] != s]
    if wrong:
        raise ModelLoadError(path, f"weights do not match the model config: {'; '.join(wrong[:4])}")
    return model


def fill_model(model: LlamaModel, weights_file: WeightFile, plan: WeightPlan | None, dtype: torch.dtype,
               progress: str | None = None) -> None:
    """Fill a meta-device model from the file one decoder layer at a time, packing each layer as
    the plan says before the next is read: a GGUF's blocks go from the file's bytes to packed
    codes, a float tensor is read alone (in fp32 where it is rounded to a packed format, else
    in ``dtype``). Peak memory: the weights as held + one layer's float tensors. ``progress``
    names a progress bar over the layers on stderr (None: none)."""
    packs = plan is not None and plan.format in ("int8", "int4")
    sources: dict[str, BlockTensor] = weights_file.blocks() if packs and plan.format == "int4" else {}
    # A dense copy is made from the float weights, so with one every tensor is read.
    leave = set(sources) if plan is None or plan.dense_from_rows is None else set()
    read_dtype = torch.float32 if packs else dtype
    modes: dict[str, str] = {}
    layers = enumerate(model.layers)
    if progress is not None:
        from tqdm import tqdm

        layers = tqdm(layers, total=len(model.layers), desc=progress, unit="layer", file=sys.stderr, leave=False)
    for i, layer in layers:
        prefix = f"layers.{i}"
        linears = [hf for name, m in layer.named_modules()
                   if isinstance(m, nn.Linear) and not getattr(m, "keep_dense", False)
                   for hf in hf_parts(f"{prefix}.{name}")]
        experts = {f"model.{prefix}.{name}" for name, _ in layer.named_parameters() if ".experts." in name}
        # Linears stay meta for their sources only when every one has a source (gate and up fuse);
        # experts whenever theirs are there (each expert tensor packs on its own).
        _materialise(model, layer, prefix, weights_file, read_dtype,
                     (leave if leave.issuperset(linears) else set()) | (leave & experts))
        if packs:
            modes.update(pack_linears(layer, plan, sources, prefix))
        _materialise(model, layer, prefix, weights_file, dtype, set())  # what the packer left dense
        layer.to(dtype)
        weights_file.release()
    _materialise(model, model, "", weights_file, read_dtype, leave)
    if packs:
        modes.update(pack_head(model, plan, sources))
    _materialise(model, model, "", weights_file, dtype, set())
    model.to(dtype)
    weights_file.release()
    model.eval().requires_grad_(False)
    model.weight_types = weight_types(weights_file.types(), modes)


def _materialise(model: LlamaModel, module: nn.Module, prefix: str, weights_file: WeightFile, dtype: torch.dtype,
                 leave: set[str]) -> None:
    """Read every meta tensor under ``module`` (named ``prefix``) from the file, but those whose
    HF parts are all in ``leave``."""
    offset = hf_norm_offset(model.config)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_meta:
            continue
        owner_name, _, leaf = ".".join(filter(None, (prefix, name))).rpartition(".")
        parts = [p.removesuffix(".weight") + "." + leaf for p in hf_parts(owner_name)]
        if all(p in leave for p in parts):
            continue
        value = torch.cat([weights_file.read(p, dtype) for p in parts]) if len(parts) > 1 else \
            weights_file.read(parts[0], dtype)
        if offset and leaf == "weight" and owner_name.endswith("norm"):
            value = value + offset
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value


def _load_whole(path: Path, config: ModelConfig, weights_file: WeightFile, dtype: torch.dtype,
                device: str | torch.device, weights: WeightPlan | None,
                shard: Callable[[LlamaModel, dict[str, GroupCodes]], dict[str, GroupCodes]]) -> LlamaModel:
    """The whole float model, cut by ``shard``, then packed (tensor parallelism's path)."""
    load_dtype = dtype if weights is None else torch.float32
    state = {name: weights_file.read(name, load_dtype) for name in weights_file.shapes()}
    sources = {}
    if weights is not None and weights.format == "int4":
        sources = {name: blocks.group_codes() for name, blocks in weights_file.blocks().items()}
    try:
        built = build_model(config, state, load_dtype, device)
    except (KeyError, RuntimeError) as e:  # missing tensors, or shapes that contradict the config
        raise ModelLoadError(path, f"weights do not match the model config: {e}") from e
    del state
    sources = shard(built, sources)
    if weights is not None:
        pack_model(built, weights, sources, weights_file.types())
        built.to(weights.dtype)
    if not hasattr(built, "weight_types"):
        built.weight_types = weight_types(weights_file.types(), {})
    return built
