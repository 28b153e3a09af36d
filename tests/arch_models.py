"""Tiny random models of every supported architecture in transformers' own implementation,
shared by the per-architecture suites (HF directories, GGUF files, the engine)."""

from __future__ import annotations

import torch

VOCAB = 256
WINDOW = 8  # sliding_window of the windowed variants: prompts run well past it
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}

# variant -> (transformers class, config class, config kwargs)
ARCHITECTURES = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(TINY, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(TINY, sliding_window=WINDOW)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(TINY, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})),
    # head_dim 32 while hidden / heads is 16: the head size comes from the config, not the ratio.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(TINY, head_dim=32, tie_word_embeddings=True)),
    # Sliding and full layers interleaved, a global rope with linear scaling beside the local
    # base, a query_pre_attn_scalar that is not head_dim, and a final soft-cap.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        TINY, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=GEMMA3_ROPE, final_logit_softcapping=5.0)),
}
WINDOWED = ("mistral", "gemma3")


def make_hf_model(variant: str, seed: int = 0, **overrides):
    """The variant's transformers model, fp32, eval mode; norms and biases randomised (HF
    initialises them to constants) so that they are tested."""
    import transformers

    model_cls, config_cls, kwargs = ARCHITECTURES[variant]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()
