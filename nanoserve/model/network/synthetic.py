"""Random models in a given shape: tiny ones for tests, and the default model's exact shape
for speed checks where its weights cannot travel (speed does not depend on the values)."""

from __future__ import annotations

import torch

from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.llama import LlamaModel


def smollm2_135m_config(max_position_embeddings: int = 8192) -> ModelConfig:
    """SmolLM2-135M's geometry (REFERENCE-NOTES.md)."""
    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, architecture="llama")


def tiny_config(**overrides) -> ModelConfig:
    """2 layers, hidden 64, 4 heads over 2 kv heads, a 256-token vocabulary."""
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=1024,
                  eos_token_id=None)
    fields.update(overrides)
    return ModelConfig(**fields)


@torch.no_grad()
def random_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LlamaModel:
    """A LlamaModel with weights drawn so that activations and logits stay O(1): embeddings
    N(0, 1), matrices N(0, 1/fan_in), norms 1. Deterministic in ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:  # biases
            param.normal_(0.0, 0.1, generator=generator)
        elif "embed" in name:
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)  # fan-in (experts: [E, out, in])
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
