"""The model layer: configuration, weight loading, tokenizer and the Llama network."""

from nanoserve.model.config import ModelConfig
from nanoserve.model.errors import ModelLoadError
from nanoserve.model.llama import LlamaModel, dense_forward
from nanoserve.model.loader import DEFAULT_MODEL, build_model, load_config, load_model, resolve_model_path
from nanoserve.model.reference_attention import DenseCausalAttention
from nanoserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "DEFAULT_MODEL", "DenseCausalAttention", "IncrementalDetokenizer", "LlamaModel", "ModelConfig",
    "ModelLoadError", "Tokenizer", "build_model", "dense_forward",
    "load_config", "load_model", "resolve_model_path",
]
