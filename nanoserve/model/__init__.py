"""The model layer: configuration, weight loading, tokenizer and the Llama network."""

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.loader import (
    DEFAULT_MODEL,
    build_model,
    load_config,
    load_model,
    resolve_model_path,
)
from nanoserve.model.formats.tokenizer import IncrementalDetokenizer, Tokenizer
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.llama import LlamaModel, dense_forward
from nanoserve.model.network.reference_attention import DenseCausalAttention

__all__ = [
    "DEFAULT_MODEL", "DenseCausalAttention", "IncrementalDetokenizer", "LlamaModel", "ModelConfig",
    "ModelLoadError", "Tokenizer", "build_model", "dense_forward",
    "load_config", "load_model", "resolve_model_path",
]
