"""The shape of a decoder-only network (the families of ``architectures``), independent of where
its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Rope variants RotaryEmbedding knows how to build ("freq_factors": llama.cpp's explicit
# per-frequency divisors, how GGUF files carry Llama 3.x scaling).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")
# MLP activations: SwiGLU's silu, and Gemma's tanh-approximated GELU.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Per-layer attention kinds (Hugging Face's layer_types vocabulary).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama-style transformer.

    The Llama layer (pre-norm attention and SwiGLU MLP) is the default; the other families
    switch on what they add: ``qk_norm`` (Qwen3, Gemma 3: an RMS norm over each head of q and k
    before rotary), ``sandwich_norms`` (Gemma 3: a norm after attention and a norm before and
    after the MLP), ``scale_embeddings`` (Gemma: the embedding times sqrt(hidden_size)),
    ``query_pre_attn_scalar`` (Gemma: scores scaled by its inverse square root instead of
    head_dim's), sliding-window layers (``sliding_window`` and ``layer_types``) with their own
    rope base ``rope_local_theta``, and ``final_logit_softcapping``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama with attention_bias only)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architecture: str = "llama"
    # Extra stop ids (e.g. several eos ids in a HF config); eos_token_id is always the first.
    extra_eos_token_ids: tuple[int, ...] = field(default=())
    hidden_act: str = "silu"
    qk_norm: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None  # None: head_dim
    # A sliding layer attends to the last `sliding_window` positions (its own included).
    sliding_window: int | None = None
    # One of LAYER_TYPES per layer; empty: every layer sliding if sliding_window is set, else full.
    layer_types: tuple[str, ...] = field(default=())
    rope_local_theta: float | None = None  # sliding layers' rope base (unscaled); None: the global rope
    final_logit_softcapping: float | None = None
    # Mixture of experts (num_experts > 0): each sparse layer's MLP routes a token to
    # ``num_experts_per_tok`` of ``num_experts`` experts of width ``moe_intermediate_size``
    # (softmax over all, the top k, renormalised where ``norm_topk_prob``), plus a shared expert
    # of width ``shared_expert_intermediate_size`` behind a sigmoid gate where that is set.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # Which layers are sparse (one flag per layer); empty: every layer, when num_experts > 0.
    sparse_layers: tuple[bool, ...] = field(default=())
    # gpt-oss: a learned sink logit per query head in every attention softmax (``sinks``), biases
    # on the router and the experts, and the experts' clamped SwiGLU (``swiglu_limit``: the gate
    # clamped above, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        self._check_windows()
        self._check_experts()

    def _check_experts(self) -> None:
        if not self.num_experts:
            if self.num_experts_per_tok or self.sparse_layers:
                raise ValueError("experts used per token or sparse layers given without experts")
            return
        if self.num_experts < 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"experts used per token ({self.num_experts_per_tok}) must be between 1 and the "
                             f"expert count ({self.num_experts})")
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError(f"expert width must be positive, got {self.moe_intermediate_size}")
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit}")
        if self.sparse_layers and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")

    @property
    def expert_activation(self) -> str:
        """The experts' activation: gpt-oss's clamped SwiGLU where swiglu_limit is set."""
        return "swiglu_oai" if self.swiglu_limit is not None else self.hidden_act

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (not self.sparse_layers or self.sparse_layers[layer])

    def _check_windows(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")

    def layer_window(self, layer: int) -> int | None:
        """How many positions layer `layer` attends back over (its own included), None for all."""
        if self.sliding_window is None:
            return None
        kind = self.layer_types[layer] if self.layer_types else "sliding_attention"
        return self.sliding_window if kind == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: 1/sqrt(query_pre_attn_scalar), else 1/sqrt(head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + tuple(i for i in self.extra_eos_token_ids if i not in first)
