"""One record per architecture: what the loaders, the validators, the network and the sharder
need to know about a family, in one place.

A record names the family's GGUF ``general.architecture`` and its Hugging Face classes and
model types, how its GGUF tensors are named in HF terms, the norm convention (Gemma's HF
checkpoints hold ``w`` of a ``1 + w`` multiplier), whether q and k are normed per head, whether
llama.cpp's converter permuted the q/k rows, the biases, the window rule, and the MLP: dense,
or experts with their routing. Adding an architecture is adding a record here (plus whatever
new arithmetic it brings to the network).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Routing of a mixture-of-experts layer: "softmax_topk" takes the softmax over every expert,
# then the k largest (renormalised to sum 1 where the config's norm_topk_prob says). Mixtral's
# "top-k then softmax" is the renormalised form of it. "topk_softmax" (gpt-oss): the k largest
# router logits (the router biased), then the softmax over those k.
ROUTINGS = ("softmax_topk", "topk_softmax")

# GGUF tensor name -> HF name, per layer (under blk.{i}. / model.layers.{i}.).
DENSE_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
})
# A mixture-of-experts layer: the router, each projection's experts stacked in one 3-D tensor
# [experts, out, in] (HF checkpoints hold one tensor per expert; hf_loader stacks them), and
# Qwen2-MoE's shared expert with its sigmoid gate.
EXPERT_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
})
# Gemma 3 norms its sublayers' outputs too, and its ffn_norm is the MLP's pre-norm.
GEMMA3_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **DENSE_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
})
# gpt-oss: its MLP's pre-norm is post_attention_norm, a learned sink logit per head, and biases
# on the router and the experts (gate's and up's written apart by llama.cpp's converter).
GPT_OSS_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **{g: h for g, h in DENSE_LAYER_TENSORS.items() if g != "ffn_norm.weight"},
    **EXPERT_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_bias",
    "ffn_up_exps.bias": "mlp.experts.up_bias",
    "ffn_down_exps.bias": "mlp.experts.down_bias",
})
GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})


@dataclass(frozen=True)
class Architecture:
    """A family's facts. ``name`` is ModelConfig.architecture. ``windows``: how a HF config's
    sliding window applies ("none": never; "all": every layer, as Mistral; "qwen": only with
    use_sliding_window, from layer max_window_layers on; "gemma3": every layer but each
    pattern-th; "alternate": every other layer from the first, as gpt-oss). ``hf_expert_names``: a HF checkpoint's per-expert tensor names (``{e}`` the
    expert) -> this record's stacked name (EXPERT_LAYER_TENSORS' values), ``{p}`` the
    projection. ``hf_fused_experts``: the checkpoint holds gpt-oss's fused expert tensors
    (``mlp.experts.gate_up_proj`` [E, H, 2 I], gate and up interleaved column by column, and
    ``down_proj`` [E, I, H], both as x @ W, with their biases), which hf_loader splits into
    this record's stacked names. ``sinks``: a learned attention sink per head. ``yarn_truncate``:
    whether YaRN's correction range is rounded out to whole dimensions where a file is silent."""

    name: str
    gguf: str | None = None  # general.architecture of its GGUF files (None: none exist)
    hf_classes: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: DENSE_LAYER_TENSORS)
    norm_offset: float = 0.0
    qk_norm: bool = False
    permuted_qk: bool = False  # llama.cpp's converter interleaved each head's q/k rows
    qkv_bias: bool = False  # q/k/v always biased and o never (Qwen2); else the config's flag
    windows: str = "none"
    experts: bool = False
    routing: str | None = None
    norm_topk_prob: bool = True  # the default where a file is silent
    shared_expert: bool = False
    hf_expert_names: Mapping[str, str] = field(default_factory=dict)
    hf_fused_experts: bool = False
    sinks: bool = False
    expert_bias: bool = False
    yarn_truncate: bool = True
    swiglu_limit: float | None = None  # the experts' clamped SwiGLU where a GGUF file is silent (gpt-oss: 7)

    @property
    def mlp(self) -> str:
        return "experts" if self.experts else "dense"


_QWEN_EXPERTS = {"mlp.experts.{e}.gate_proj.weight": "mlp.experts.gate_proj",
                 "mlp.experts.{e}.up_proj.weight": "mlp.experts.up_proj",
                 "mlp.experts.{e}.down_proj.weight": "mlp.experts.down_proj"}
_MIXTRAL_EXPERTS = {"block_sparse_moe.experts.{e}.w1.weight": "mlp.experts.gate_proj",
                    "block_sparse_moe.experts.{e}.w3.weight": "mlp.experts.up_proj",
                    "block_sparse_moe.experts.{e}.w2.weight": "mlp.experts.down_proj"}
_MOE_TENSORS = MappingProxyType({**DENSE_LAYER_TENSORS, **EXPERT_LAYER_TENSORS})

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", gguf="llama", hf_classes=("LlamaForCausalLM",), hf_model_types=("llama",),
                 permuted_qk=True),
    Architecture("mistral", hf_classes=("MistralForCausalLM",), hf_model_types=("mistral",), windows="all"),
    Architecture("qwen2", gguf="qwen2", hf_classes=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                 qkv_bias=True, windows="qwen"),
    Architecture("qwen3", gguf="qwen3", hf_classes=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                 qk_norm=True, windows="qwen"),
    Architecture("gemma3", gguf="gemma3",
                 hf_classes=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),  # the latter: its text model
                 hf_model_types=("gemma3_text", "gemma3"), layer_tensors=GEMMA3_LAYER_TENSORS, norm_offset=1.0,
                 qk_norm=True, windows="gemma3"),
    # A llama GGUF with llama.expert_count is Mixtral-style (its converter permutes q/k as llama's).
    Architecture("mixtral", hf_classes=("MixtralForCausalLM",), hf_model_types=("mixtral",),
                 layer_tensors=_MOE_TENSORS, permuted_qk=True, windows="all", experts=True,
                 routing="softmax_topk", hf_expert_names={
                     **_MIXTRAL_EXPERTS, "block_sparse_moe.gate.weight": "mlp.gate.weight"}),
    Architecture("qwen3moe", gguf="qwen3moe", hf_classes=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
                 layer_tensors=_MOE_TENSORS, qk_norm=True, windows="qwen", experts=True,
                 routing="softmax_topk", hf_expert_names=_QWEN_EXPERTS),
    Architecture("qwen2moe", gguf="qwen2moe", hf_classes=("Qwen2MoeForCausalLM",), hf_model_types=("qwen2_moe",),
                 layer_tensors=_MOE_TENSORS, qkv_bias=True, windows="qwen", experts=True,
                 routing="softmax_topk", norm_topk_prob=False, shared_expert=True, hf_expert_names=_QWEN_EXPERTS),
    Architecture("gptoss", gguf="gpt-oss", hf_classes=("GptOssForCausalLM",), hf_model_types=("gpt_oss",),
                 layer_tensors=GPT_OSS_LAYER_TENSORS, windows="alternate", experts=True, routing="topk_softmax",
                 hf_expert_names={"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias"},
                 hf_fused_experts=True, sinks=True, expert_bias=True, yarn_truncate=False, swiglu_limit=7.0),
)}
GGUF_ARCHITECTURES = tuple(a.gguf for a in ARCHITECTURES.values() if a.gguf)
HF_CLASSES = {cls: a.name for a in ARCHITECTURES.values() for cls in a.hf_classes}
HF_MODEL_TYPES = {t: a.name for a in ARCHITECTURES.values() for t in a.hf_model_types}


def architecture(name: str) -> Architecture:
    """The record of ModelConfig.architecture ``name`` (KeyError naming the known ones)."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r} (known: {', '.join(ARCHITECTURES)})") from None


def gguf_architecture(general_architecture: str, expert_count: int) -> Architecture | None:
    """The record of a GGUF file's ``general.architecture`` (a llama file with experts is
    Mixtral-style), or None when nanoserve does not run it."""
    if general_architecture == "llama" and expert_count > 0:
        return ARCHITECTURES["mixtral"]
    return next((a for a in ARCHITECTURES.values() if a.gguf == general_architecture), None)
