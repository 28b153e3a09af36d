"""gpt-oss: a tiny random GptOssForCausalLM (attention sinks, alternating sliding and full
layers, YaRN rope, top-k-then-softmax routing over biased experts with the clamped SwiGLU)
against transformers' own model, from safetensors and from GGUF, eager and through the paged
engine; YaRN's frequencies against transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.experts import ExpertMLP
from nanoserve.model.network.llama import dense_forward, yarn_parameters

transformers = pytest.importorskip("transformers")

ATOL = 2e-4  # fp32 logits of the same weights through two implementations (the dense tests' tolerance)
WINDOW = 8
PROMPTS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 64, 11, 12, 13, 14, 15, 16, 200, 201, 202, 9, 1],
                        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])


def gpt_oss_config(**overrides):
    fields = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                  sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-5)
    return transformers.GptOssConfig(**{**fields, **overrides})


def tiny_gpt_oss(seed: int = 0):
    """A random fp32 GptOssForCausalLM whose every part matters: O(1) activations, experts wide
    enough that the SwiGLU's clamps bite, and random sinks and biases (HF inits sinks and the
    expert biases to zero)."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(gpt_oss_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.normal_(0.0, 3 * p.shape[-2] ** -0.5)  # x @ W: the input is dimension -2
            elif "experts.down_proj" in name and not name.endswith("bias"):
                p.normal_(0.0, p.shape[-2] ** -0.5)
            elif p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "sinks" in name or name.endswith("bias"):
                p.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers model, its safetensors directory)."""
    model = tiny_gpt_oss()
    directory = tmp_path_factory.mktemp("gptoss")
    model.save_pretrained(directory)
    return model, directory


def _hf_logits(model, ids=PROMPTS):
    with torch.no_grad():
        return model(ids).logits


def test_clamps_bite(reference):
    """The SwiGLU's clamps are exercised: some gate and up values of the reference pass 7."""
    model, _ = reference
    seen = []
    experts = model.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        _hf_logits(model)
    finally:
        hook.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7).any()


def test_safetensors_logits_match_transformers(reference):
    model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    c = ours.config
    assert c.architecture == "gptoss" and c.attention_sinks and c.expert_bias and c.swiglu_limit == 7.0
    assert c.layer_types == ("sliding_attention", "full_attention") * 2 and c.sliding_window == WINDOW
    assert c.rope_type == "yarn"
    assert all(isinstance(layer.mlp, ExpertMLP) for layer in ours.layers)
    assert PROMPTS.shape[1] > 2 * WINDOW  # the window cuts
    torch.testing.assert_close(dense_forward(ours, PROMPTS), _hf_logits(model), atol=ATOL, rtol=0)


def test_left_padded_batch_matches_transformers(reference):
    model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    mask = torch.ones_like(PROMPTS)
    mask[1, :5] = 0
    ids = PROMPTS.clone()
    ids[1, :5] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    out = dense_forward(ours, ids, mask)
    torch.testing.assert_close(out[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, 5:], ref[1, 5:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim,factor,original", [(64, 32.0, 4096), (16, 32.0, 4096), (128, 8.0, 8192)])
def test_yarn_matches_transformers(truncate, head_dim, factor, original):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanoserve.model.network.config import ModelConfig

    rope = {"rope_type": "yarn", "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": original}
    hf = gpt_oss_config(head_dim=head_dim, rope_parameters={**rope, "rope_theta": 150000.0},
                        max_position_embeddings=131072)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=4,
                       head_dim=head_dim, rope_theta=150000.0, rope_scaling=rope, max_position_embeddings=131072)
    our_inv_freq, our_factor = yarn_parameters(ours)
    assert torch.equal(our_inv_freq, inv_freq.float())
    assert our_factor == pytest.approx(attention_factor, abs=0, rel=1e-12)
    assert dataclasses.replace(ours, rope_scaling={**rope, "factor": 1.0}).rope_type == "yarn"


def write_gpt_oss_gguf(path, model, *, experts_qtype=None, merged_gate_up=False, template: str | None = None):
    """The transformers model's weights as llama.cpp's converter writes a gpt-oss GGUF: its keys
    (the window, the expert width, YaRN), the fused gate_up experts split into gate and up (even
    and odd columns, transposed to [experts, out, in]) or merged (gate's rows, then up's), down
    transposed, the sinks as attn_sinks.weight; the experts F32 or ``experts_qtype`` blocks."""
    import gguf
    import numpy as np

    from tests.conftest import _byte_alphabet

    c = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    specials = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    tokens = _byte_alphabet() + specials + [f"<|special_{i}|>" for i in range(c.vocab_size - 256 - len(specials))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (c.vocab_size - 256))
    writer.add_token_merges([])
    writer.add_eos_token_id(tokens.index("<|return|>"))
    if template is not None:
        writer.add_chat_template(template)

    def add(name, tensor, qtype=None):
        data = tensor.detach().float().contiguous().numpy().copy()
        if qtype is None:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    state = model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        add(dst + "attn_norm.weight", state[src + "input_layernorm.weight"])
        add(dst + "post_attention_norm.weight", state[src + "post_attention_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            add(f"{dst}{ours}.weight", state[f"{src}self_attn.{theirs}.weight"])
            add(f"{dst}{ours}.bias", state[f"{src}self_attn.{theirs}.bias"])
        add(dst + "attn_sinks.weight", state[src + "self_attn.sinks"])
        add(dst + "ffn_gate_inp.weight", state[src + "mlp.router.weight"])
        add(dst + "ffn_gate_inp.bias", state[src + "mlp.router.bias"])
        gate_up = state[src + "mlp.experts.gate_up_proj"].transpose(-1, -2)  # [E, 2I, H], rows interleaved
        bias = state[src + "mlp.experts.gate_up_proj_bias"]
        gate, up, gate_b, up_b = gate_up[:, ::2], gate_up[:, 1::2], bias[..., ::2], bias[..., 1::2]
        if merged_gate_up:
            add(dst + "ffn_gate_up_exps.weight", torch.cat([gate, up], dim=1), experts_qtype)
            add(dst + "ffn_gate_up_exps.bias", torch.cat([gate_b, up_b], dim=-1))
        else:
            add(dst + "ffn_gate_exps.weight", gate, experts_qtype)
            add(dst + "ffn_up_exps.weight", up, experts_qtype)
            add(dst + "ffn_gate_exps.bias", gate_b)
            add(dst + "ffn_up_exps.bias", up_b)
        add(dst + "ffn_down_exps.weight", state[src + "mlp.experts.down_proj"].transpose(-1, -2), experts_qtype)
        add(dst + "ffn_down_exps.bias", state[src + "mlp.experts.down_proj_bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("merged", [False, True])
def test_gguf_logits_match_transformers(reference, tmp_path, merged):
    model, _ = reference
    path = write_gpt_oss_gguf(tmp_path / "gptoss.gguf", model, merged_gate_up=merged)
    ours, _ = load_model(str(path), dtype=torch.float32)
    c = ours.config
    assert c.architecture == "gptoss" and c.attention_sinks and c.expert_bias and c.swiglu_limit == 7.0
    assert c.layer_types == ("sliding_attention", "full_attention") * 2 and c.sliding_window == WINDOW
    assert c.rope_scaling["truncate"] is False and c.rope_scaling["factor"] == 32.0
    assert set(c.eos_token_ids) == {256 + 5, 256 + 6}  # <|return|> and <|call|> end a reply
    torch.testing.assert_close(dense_forward(ours, PROMPTS), _hf_logits(model), atol=ATOL, rtol=0)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _engine_prompts() -> list[list[int]]:
    """A shared prefix under two prompts (prefix caching), lengths from below the window to
    several windows."""
    import random
    rng = random.Random(0)
    system = [rng.randrange(3, 300) for _ in range(13)]
    return [system + [rng.randrange(3, 300) for _ in range(27)], system + [7, 8, 9],
            [rng.randrange(3, 300) for _ in range(WINDOW - 3)], system + [rng.randrange(3, 300) for _ in range(20)]]


@pytest.mark.parametrize("mode", ["eager", "compiled", "kernel", "bf16-kernel"])
def test_paged_engine_greedy_equals_transformers(reference, mode, fresh_dynamo):
    """Batched through the paged cache with chunked prefill and prefix caching (prefill with
    sinks; decode with sinks through SDPA's gathers, or through nanoserve's decode kernel on the
    host's tier: fp32 cells forced onto it, and bf16 as the engine picks it), eager and compiled
    (no recompile): transformers' greedy tokens and logprobs (bf16: its tokens where the margins
    allow, the logprobs within 0.5)."""
    from engine_oracle_helpers import engine_for, generate, greedy
    from test_architectures_engine import MAX_TOKENS, TOLERANCE, assert_matches_transformers

    from nanoserve.model.quant import cpu_kernels

    tier = cpu_kernels.resolve_tier()
    if mode in ("kernel", "bf16-kernel") and tier == "torch":
        pytest.skip("no kernel tier of nanoserve's on this host")
    model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    options = {}
    if mode == "compiled":
        options = dict(compile=True, compile_backend="inductor", row_buckets=(1, 4), width_buckets=(64,),
                       warmup="eager")
    elif mode == "bf16-kernel":
        options = dict(weights="bf16", compile=True, compile_backend="eager", row_buckets=(4,), width_buckets=(64,),
                       warmup="eager")
    engine = engine_for(ours, max_num_batched_tokens=11, max_model_len=64, **options)
    if mode == "kernel":  # fp32 cells through the kernel (the engine keeps SDPA for fp32 weights)
        engine.worker.decode_step.attention_kernel = cpu_kernels.handle(tier)
    if mode in ("kernel", "bf16-kernel"):
        assert engine.worker.decode_step.attention_kernel is not None
    batch = _engine_prompts()
    first = generate(engine, batch, greedy(MAX_TOKENS, logprobs=2))
    again = generate(engine, batch[1:], greedy(MAX_TOKENS, logprobs=2))  # from the cached prefixes
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefill_steps > len(batch)
    if mode in ("compiled", "bf16-kernel"):
        assert stats.recompiles_after_warmup == 0
    for output, prompt in zip(first + again, batch + batch[1:]):
        assert_matches_transformers(output, model, prompt, TOLERANCE if mode != "bf16-kernel" else 0.5)
    engine.check_drained()


def test_chunked_teacher_forcing_equals_the_dense_forward(reference):
    """fidelity's chunk-at-a-time attention honours the window and the sinks."""
    from nanoserve.model.network.fidelity import teacher_forced_logits

    _, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    ids = PROMPTS[0]
    torch.testing.assert_close(teacher_forced_logits(ours, ids, chunk_rows=3), teacher_forced_logits(ours, ids),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_verify_and_window_reads_with_sinks_equal_the_reference(window):
    """The SDPA-side reads with sinks (a decode row, a verify row of several queries) against
    paged_attention_reference, one query at a time."""
    from attention_support import paged_attention_reference

    from nanoserve.worker.attention import WindowAttention
    from nanoserve.worker.kv_cells import KVLayers

    torch.manual_seed(1)
    rows, queries, slots, width, heads, kv, dim = 2, 3, 100, 24, 6, 2, 16
    k_cache, v_cache = torch.randn(slots, kv, dim), torch.randn(slots, kv, dim)
    table = torch.randint(1, slots, (rows, width))
    lengths = torch.tensor([20, 21, 22, 5, 6, 0])  # the last query is padding
    q = 2 * torch.randn(rows * queries, heads, dim)
    sinks = 3 * torch.randn(heads)
    k_new, v_new = torch.randn(rows * queries, kv, dim), torch.randn(rows * queries, kv, dim)
    scratch = torch.zeros(rows * queries, dtype=torch.long)
    attention = WindowAttention(KVLayers([k_cache], [v_cache], [], []), scratch, table, lengths)
    k_cache[0], v_cache[0] = k_new[-1], v_new[-1]  # what the write leaves in the scratch slot
    got = attention(0, q, k_new, v_new, window=window, sinks=sinks)
    want = paged_attention_reference(q, k_cache, v_cache, table.repeat_interleave(queries, 0), lengths,
                                     window=window, sinks=sinks)
    torch.testing.assert_close(got[:-1], want[:-1], atol=1e-5, rtol=0)
    single = WindowAttention(KVLayers([k_cache], [v_cache], [], []), scratch[:rows], table, lengths[::queries])
    got = single(0, q[::queries], k_new[::queries], v_new[::queries], window=window, sinks=sinks)
    want = paged_attention_reference(q[::queries], k_cache, v_cache, table, lengths[::queries], window=window,
                                     sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _tiers():
    from nanoserve.model.quant.cpu_kernels import host_tiers
    return [t for t in host_tiers() if t != "torch"]


@pytest.mark.parametrize("tier", _tiers())
def test_mxfp4_experts_run_packed_from_their_blocks(reference, tmp_path, tier):
    """gpt-oss's experts as MXFP4 blocks (as its GGUF files hold them) run packed from those
    blocks with their biases and the clamped SwiGLU: against the same file held dense in fp32
    from gguf's dequantisation, at 1 row, 8 rows and a prompt (the dequantise path)."""
    import gguf

    from nanoserve.model.network.experts import PackedExperts
    from nanoserve.model.quant.weight_plan import WeightPlan

    model, _ = reference
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", model, experts_qtype=gguf.GGMLQuantizationType.MXFP4)
    dense, _ = load_model(str(path), dtype=torch.float32, with_tokenizer=False)
    plan = WeightPlan("int4", kernel=tier)
    packed, _ = load_model(str(path), weights=plan, with_tokenizer=False)
    assert all(isinstance(layer.mlp.experts, PackedExperts) for layer in packed.layers)
    assert packed.layers[0].mlp.experts.gate_up_bias is not None
    assert "packed" in packed.weight_types["MXFP4"].split("+")
    for rows in (1, 8, 80):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        want = dense.layers[0].mlp(x)
        got = packed.layers[0].mlp(x.to(plan.dtype)).float()
        assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-3, f"{rows} rows"
