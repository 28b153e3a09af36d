"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE: ``experts``) in plain torch, written once for prefill and decode.

Tokens are flat: a step is `N` tokens from any number of sequences, each with its own
position. The network owns no cache: attention is a callable handed to `forward`, called per
layer with rotary already applied, so the same weights serve the dense oracle below (its
attention: ``reference_attention``) and the paged backends. A sliding-window layer
passes its window as the keyword ``window`` (the number of positions it attends back over, its
own included); other layers call without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.network.architectures import architecture
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.experts import ACTIVATIONS, ExpertMLP
from nanoserve.model.network.reference_attention import DenseCausalAttention


class Attention(Protocol):
    """`attention(layer_idx, q [N, H, D], k [N, KV, D], v [N, KV, D], *, window=None, sinks=None)
    -> [N, H, D]`.

    Scores are scaled by 1/sqrt(D). ``window`` (only passed by sliding-window layers): a query
    at position p sees keys at positions p - window + 1 .. p. ``sinks`` [H] (only passed by
    layers that have them, gpt-oss): one more logit per head in the softmax's denominator, a
    sink that takes probability mass and contributes no value."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


# (cos, sin) for one step's tokens, each [N, 1, head_dim].
RotaryTables = tuple[torch.Tensor, torch.Tensor]

def hf_norm_offset(config: ModelConfig) -> float:
    """What HF checkpoints of this architecture leave out of a norm's multiplier (0 or 1: Gemma's
    hold w of 1 + w); this module, like GGUF files, holds the multiplier itself."""
    return architecture(config.architecture).norm_offset


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same result as the steps below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32, scale in the input dtype: the reference's rounding order in bf16/fp16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Per-pair rotary frequencies [head_dim // 2] (fp32), with the config's scaling applied;
    ``local``: the sliding layers' own unscaled rope of base ``rope_local_theta``."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / ((config.rope_local_theta if local else config.rope_theta) ** exponents)
    if local:
        return inv_freq
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if config.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if config.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if config.rope_type == "yarn":
        return yarn_parameters(config)[0]
    return inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 * mscale * ln(scale) + 1 (1 for no scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [head_dim // 2] and its attention factor (cos and sin are
    multiplied by it), transformers' ``_compute_yarn_parameters`` arithmetic: each pair blends
    the interpolated frequency (divided by ``factor``) and the original one, by a linear ramp
    between the dimensions where beta_fast and beta_slow rotations fit in the original context;
    ``truncate`` rounds that range out to whole dimensions."""
    scaling, base, dim = config.rope_scaling or {}, config.rope_theta, config.head_dim
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_attention_factor(config: ModelConfig, local: bool = False) -> float:
    """What the rope's cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return yarn_parameters(config)[1] if config.rope_type == "yarn" and not local else 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping) -> torch.Tensor:
    # Llama 3.1: slow (long-wavelength) pairs are divided by `factor`, fast ones kept, and the
    # band in between interpolated smoothly.
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [N, heads, D] by per-token `cos`/`sin` [N, 1, D] (half-split, "neox" layout)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_position_embeddings`, gathered by `positions`.

    A table lookup (not a per-step computation) keeps forward free of Python ints and
    data-dependent branches, so it traces cleanly under torch.compile.
    """

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config, local)
        # Explicit cpu: the model may be constructed under a meta-device context, but these
        # tables are computed here, not loaded from the weights.
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(config, local)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:  # YaRN: both scaled, as the reference does
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> RotaryTables:
        """(cos, sin) for positions [N]; computed once per step and shared by every layer."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.qk_size, self.v_size = config.q_size + config.kv_size, config.kv_size
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.qk_size + self.v_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window = config.layer_window(layer_idx)
        # Backends scale scores by 1/sqrt(head_dim); another scale (Gemma's) is folded into q.
        self.query_scale = config.attention_scale * config.head_dim ** 0.5
        # gpt-oss: each head's learned sink logit (Attention's ``sinks``).
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None

    def forward(self, x: torch.Tensor, rotary: RotaryTables, attention: Attention) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.qk_size, self.v_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads sit side by side in the fused output: rotate them in one pass.
        q, k = apply_rotary(qk, *rotary).split([self.num_heads, self.num_kv_heads], dim=1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        v = v.view(n, self.num_kv_heads, self.head_dim)
        # Only what the layer has is passed: a backend without sinks is called as before.
        extra = {}
        if self.window is not None:
            extra["window"] = self.window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        out = attention(self.layer_idx, q, k, v, **extra)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or config.intermediate_size
        # gate and up stay two matrices while dense: measured in place on the default model
        # (fp32, 2-core CPU, MKL), two [1536, 576] products beat one [3072, 576] by ~15% at 32
        # rows. Packed weights fuse them (``fuse_gate_up``): there one kernel call per layer wins.
        self.gate_proj: nn.Module | None = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj: nn.Module | None = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_up_proj: nn.Module | None = None
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def fuse_gate_up(self, gate_up: nn.Module) -> None:
        """Run gate and up as one module whose output is ``[gate | up]`` along the last dimension."""
        self.gate_up_proj, self.gate_proj, self.up_proj = gate_up, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with ``sandwich_norms`` (Gemma) each output is normed too
    before it joins the residual (post_attention_layernorm is then that norm, and the MLP has
    pre_ and post_feedforward_layernorm)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = ExpertMLP(config) if config.layer_is_sparse(layer_idx) else LlamaMLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        # Which of the model's rotary tables this layer reads: 1 is the sliding layers' own rope.
        self.rope_index = int(config.layer_window(layer_idx) is not None and config.rope_local_theta is not None)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, attention: Attention) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, attention))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rotary, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head over flat tokens.

    `forward(input_ids [N], positions [N], attention) -> hidden [N, hidden_size]` (final norm
    applied); `compute_logits(hidden [M, hidden_size]) -> [M, vocab_size]` is only the LM head,
    so a caller can take logits for the last token of each sequence alone.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Uninitialised: weights always come from a checkpoint (and normal_ init on the meta
        # device imports torch's Python decompositions, ~2 s).
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(config.vocab_size, config.hidden_size), freeze=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.rotary_local = RotaryEmbedding(config, local=True) if config.rope_local_theta is not None else None
        # A buffer, so that it takes the model's dtype as the reference's scale does.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, device="cpu")
                             if config.scale_embeddings else None, persistent=False)
        # Tied models read the embedding matrix in compute_logits; no second copy.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        # Gathered once per step, not once per layer.
        tables = (self.rotary(positions), None if self.rotary_local is None else self.rotary_local(positions))
        for layer in self.layers:
            hidden = layer(hidden, tables[layer.rope_index], attention)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # lm_head may be a packed layer (nanoserve.model.quant.linear), so it is called, not read.
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load a state dict in Hugging Face naming (`model.layers.0.self_attn.q_proj.weight`...).

        The tensors are adopted as they are (no copy where dtype and device already match).
        Raises KeyError naming any tensor the checkpoint lacks or does not use.
        """
        fused = fuse_hf_weights(self.config, weights)
        expected = set(self.state_dict().keys())
        missing, unused = expected - fused.keys(), fused.keys() - expected
        if missing or unused:
            raise KeyError(f"checkpoint does not match the model: missing {sorted(missing)[:8]}, "
                           f"unused {sorted(unused)[:8]}")
        self.load_state_dict(fused, strict=True, assign=True)


def fuse_hf_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF tensors to this module's names, stacking q/k/v into one matrix and adding
    ``hf_norm_offset`` to norm weights."""
    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return weights[name]

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"], dim=0)
        if config.attention_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"], dim=0)
        out[dst + "self_attn.o_proj.weight"] = take(f"{src}self_attn.o_proj.weight")
        if config.attention_sinks:
            out[dst + "self_attn.sinks"] = take(f"{src}self_attn.sinks")
        if config.attention_out_bias:
            out[dst + "self_attn.o_proj.bias"] = take(f"{src}self_attn.o_proj.bias")
        mlp = [f"mlp.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
        if config.layer_is_sparse(i):
            mlp = ["mlp.gate.weight", *(f"mlp.experts.{part}" for part in ("gate_proj", "up_proj", "down_proj"))]
            if config.expert_bias:
                mlp += ["mlp.gate.bias", *(f"mlp.experts.{part}_bias" for part in ("gate", "up", "down"))]
            if config.shared_expert_intermediate_size:
                mlp += ["mlp.shared_expert_gate.weight",
                        *(f"mlp.shared_expert.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj"))]
        for name in mlp:
            out[dst + name] = take(src + name)
        for norm in norms:
            out[f"{dst}{norm}.weight"] = take(f"{src}{norm}.weight")
    offset = hf_norm_offset(config)
    if offset:
        out.update({name: t + offset for name, t in out.items() if name.endswith("norm.weight")})
    return out


def dense_positions(batch: int, seq_len: int, attention_mask: torch.Tensor | None,
                    device: torch.device | str) -> torch.Tensor:
    """Positions [B, T]: 0.. for each row's real tokens; left padding is clamped to 0."""
    if attention_mask is None:
        return torch.arange(seq_len, device=device).expand(batch, seq_len)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def dense_forward(
    model: LlamaModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The no-cache reference forward: logits [B, T, V] for input_ids [B, T].

    This is the oracle that cached/paged forwards are graded against.
    """
    hidden = dense_hidden(model, input_ids, attention_mask)
    b, t = input_ids.shape
    return model.compute_logits(hidden.reshape(b * t, -1)).view(b, t, -1)


def dense_hidden(
    model: LlamaModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The no-cache reference forward's final hidden states [B, T, hidden] (after the final
    norm): what pooling (embeddings) reads."""
    if input_ids.dim() != 2:
        raise ValueError(f"dense_forward wants input_ids [batch, seq_len], got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    positions = dense_positions(b, t, attention_mask, input_ids.device)
    attention = DenseCausalAttention(b, t, attention_mask)
    return model(input_ids.reshape(-1), positions.reshape(-1), attention).view(b, t, -1)


def unfuse_hf_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The inverse of fuse_hf_weights: a model's weights in HF naming (views, no copies, but
    for norms of an offset-norm architecture)."""
    c, out = model.config, {}
    offset = hf_norm_offset(c)
    for name, t in model.state_dict().items():
        hf = name if name.startswith("lm_head") else "model." + name
        if ".qkv_proj." in name:
            for part, chunk in zip("qkv", t.split([c.q_size, c.kv_size, c.kv_size])):
                out[hf.replace("qkv_proj", f"{part}_proj")] = chunk
        else:
            out[hf] = t - offset if offset and name.endswith("norm.weight") else t
    return out
