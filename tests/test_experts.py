"""Mixtures of experts: Qwen3-MoE, Mixtral and Qwen2-MoE from safetensors and GGUF against
transformers' own models, the grouped expert op against a plain loop, packed experts on every
kernel tier, and a compiled decode whose routing changes every step without recompiling."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.architectures import EXPERT_LAYER_TENSORS
from nanoserve.model.network.experts import ExpertMLP, PackedExperts
from nanoserve.model.network.llama import dense_forward, unfuse_hf_weights
from nanoserve.model.quant.cpu_kernels import host_tiers
from nanoserve.model.quant.weight_plan import WeightPlan

transformers = pytest.importorskip("transformers")

# fp32 logits of the same weights through two implementations (the dense tests' tolerance).
ATOL = 2e-4
COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _qwen3moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))


def _qwen2moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False))


MODELS = {"qwen3moe": _qwen3moe, "mixtral": _mixtral, "qwen2moe": _qwen2moe}


def _reference(name: str):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():  # O(1) activations: HF's init leaves the experts at 0.02 and the router too flat
        for pname, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in pname:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request, tmp_path_factory):
    """(name, transformers model, its safetensors directory)."""
    model = _reference(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


PROMPTS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 64, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def _hf_logits(model, ids=PROMPTS):
    with torch.no_grad():
        return model(ids).logits


def test_safetensors_logits_match_transformers(reference):
    name, model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    assert ours.config.architecture == name and ours.config.num_experts == model.config.num_experts
    assert all(isinstance(layer.mlp, ExpertMLP) for layer in ours.layers)
    torch.testing.assert_close(dense_forward(ours, PROMPTS), _hf_logits(model), atol=ATOL, rtol=0)


def _gguf_name(hf: str) -> str | None:
    """This model's HF name (experts stacked) -> the GGUF tensor name llama.cpp's converter writes."""
    from nanoserve.model.network.architectures import DENSE_LAYER_TENSORS, GLOBAL_TENSORS
    for table in (GLOBAL_TENSORS,):
        for g, h in table.items():
            if h == hf:
                return g
    layer, rest = hf.split(".", 3)[2], hf.split(".", 3)[3]
    for table in (EXPERT_LAYER_TENSORS, DENSE_LAYER_TENSORS):
        for g, h in table.items():
            if h == rest:
                return f"blk.{layer}.{g}"
    return None


def write_moe_gguf(path, ours, *, qtype=gguf.GGMLQuantizationType.F32, merged_gate_up=False):
    """The model's weights as llama.cpp's converter writes an expert GGUF: the arch's keys, the
    experts as 3-D tensors [experts, out, in] (stored innermost first), q/k rows permuted for llama."""
    c = ours.config
    arch = {"mixtral": "llama"}.get(c.architecture, c.architecture)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if c.architecture != "mixtral":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if c.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    from tests.conftest import _byte_alphabet
    tokens = _byte_alphabet() + [f"<|special_{i}|>" for i in range(c.vocab_size - 256)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (c.vocab_size - 256))
    writer.add_token_merges([])
    writer.add_eos_token_id(c.vocab_size - 1)
    weights = unfuse_hf_weights(ours)
    if merged_gate_up:
        for i in range(c.num_layers):
            gate, up = (weights.pop(f"model.layers.{i}.mlp.experts.{p}_proj") for p in ("gate", "up"))
            weights[f"merged.{i}"] = torch.cat([gate, up], dim=1)
    for hf, tensor in weights.items():
        name = f"blk.{hf.split('.')[1]}.ffn_gate_up_exps.weight" if hf.startswith("merged.") else _gguf_name(hf)
        data = tensor.detach().float().numpy().copy()
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)
        if c.architecture == "mixtral" and (".attn_q." in name or ".attn_k." in name):
            heads = c.num_heads if ".attn_q." in name else c.num_kv_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or "ffn_gate_inp" in name:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("merged", [False, True])
def test_gguf_logits_match_transformers(reference, tmp_path, merged):
    name, model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    path = write_moe_gguf(tmp_path / f"{name}.gguf", ours, merged_gate_up=merged)
    from_gguf, _ = load_model(str(path), dtype=torch.float32)
    assert from_gguf.config.architecture == name
    assert from_gguf.config.norm_topk_prob == ours.config.norm_topk_prob
    torch.testing.assert_close(dense_forward(from_gguf, PROMPTS), _hf_logits(model), atol=ATOL, rtol=0)


def _loop_reference(mlp: ExpertMLP, x: torch.Tensor) -> torch.Tensor:
    """Each row alone through its k experts, in plain torch."""
    ids, weights = mlp.route(x)
    e = mlp.experts
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            i = int(ids[r, slot])
            h = torch.nn.functional.silu(x[r] @ e.gate_proj[i].T) * (x[r] @ e.up_proj[i].T)
            out[r] += weights[r, slot] * (h @ e.down_proj[i].T)
    return out


def test_grouped_op_equals_a_plain_loop_with_uneven_routing():
    torch.manual_seed(0)
    ours = load_model_from(_reference("qwen3moe"))
    mlp = ours.layers[0].mlp
    x = torch.randn(9, 64)
    torch.testing.assert_close(mlp(x), _loop_reference(mlp, x), atol=1e-5, rtol=0)
    # Every row to experts 0 and 1 (the others get none): the router's bias decides.
    with torch.no_grad():
        mlp.gate.weight.zero_()
        mlp.gate.weight[0, 0] = mlp.gate.weight[1, 0] = 50.0
    x[:, 0] = 1.0
    ids, _ = mlp.route(x)
    assert set(ids.unique().tolist()) == {0, 1}
    torch.testing.assert_close(mlp(x), _loop_reference(mlp, x), atol=1e-5, rtol=0)


def load_model_from(hf_model):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        return load_model(d, dtype=torch.float32, with_tokenizer=False)[0]


def _tiers():
    return [t for t in host_tiers() if t != "torch"]


@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0])
def test_packed_experts_from_blocks_match_their_dequantised_weights(tmp_path, tier, qtype):
    """The packed experts (from the file's blocks, on ``tier``) against the same model held dense
    in fp32 from gguf's dequantisation, at 1 row, 8 rows and a prompt (the dequantise path)."""
    ours = load_model_from(_reference("qwen3moe"))
    path = write_moe_gguf(tmp_path / "q.gguf", ours, qtype=qtype)
    dense, _ = load_model(str(path), dtype=torch.float32, with_tokenizer=False)
    plan = WeightPlan("int4", kernel=tier)
    packed, _ = load_model(str(path), weights=plan, with_tokenizer=False)
    assert all(isinstance(layer.mlp.experts, PackedExperts) for layer in packed.layers)
    assert "packed" in packed.weight_types[qtype.name].split("+")
    for rows in (1, 8, 80):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        want = dense.layers[0].mlp(x)
        got = packed.layers[0].mlp(x.to(plan.dtype)).float()
        # int8 activations (bf16 where the tier computes bf16): the other packed layers' tolerance.
        scale = want.abs().max()
        assert (got - want).abs().max() <= 0.05 * scale + 1e-3, f"{rows} rows"


def test_compiled_decode_never_recompiles_as_routing_changes(tmp_path):
    ours = load_model_from(_reference("qwen2moe"))
    engine = build_engine(ours, compile=True, compile_backend="inductor", warmup="eager", max_batch_size=4,
                          kv_cache_bytes=1 << 22, block_size=16, max_model_len=64, row_buckets=(1, 4),
                          width_buckets=(32, 64))
    eager = build_engine(ours, max_batch_size=4, kv_cache_bytes=1 << 22, block_size=16, max_model_len=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 42], list(range(40, 70)), [9] * 7]
    got = engine.generate(prompts, greedy, use_tqdm=False)
    want = eager.generate(prompts, greedy, use_tqdm=False)
    stats = engine.stats()
    assert stats.recompiles_after_warmup == 0 and stats.eager_steps == 0
    routed = {tuple(layer.mlp.route(ours.embed_tokens(torch.tensor(o.token_ids)))[0].flatten().tolist())
              for o in got for layer in ours.layers[:1]}
    assert len(routed) > 1  # the replies route to different experts
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids


def test_expert_metadata_that_contradicts_itself_is_refused_in_one_line(tmp_path):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gguf_files import V, tiny_chat_gguf

    from nanoserve.model.formats.errors import ModelLoadError

    ok = tiny_chat_gguf(experts=True)
    model, _ = load_model(str(ok.write(tmp_path / "ok.gguf")))
    assert model.config.architecture == "mixtral" and model.config.num_experts == 4
    for key, value, message in (("llama.expert_used_count", 5, "between 1 and the expert count"),
                                ("llama.expert_count", 3, "shape"),
                                ("llama.expert_used_count", 0, "between 1 and the expert count")):
        d = tiny_chat_gguf(experts=True)
        d.set(key, value, V.UINT32)
        with pytest.raises(ModelLoadError, match=message) as refused:
            load_model(str(d.write(tmp_path / "bad.gguf")))
        assert "\n" not in str(refused.value)


def test_random_expert_files_of_the_benchmark_load_packed_and_generate(tmp_path):
    """compile/model_files' expert shapes (Qwen3-MoE, Mixtral-style, gpt-oss with MXFP4 experts), in miniature."""
    from compile.model_files import Shape, write_model

    for arch, file_type in (("qwen3moe", "Q4_K_M"), ("llama", "Q4_K_M"), ("gpt-oss", "MXFP4_MOE")):
        shape = Shape(256, 2, 4, 2, 512, tied=arch == "llama", arch=arch, head_dim=None if arch == "llama" else 64,
                      experts=8, experts_used=2, expert_ffn=256)
        path = write_model(tmp_path / f"{arch}.gguf", shape, file_type)
        engine = build_engine(str(path), max_batch_size=2, max_model_len=64, kv_cache_bytes=1 << 22)
        assert engine.model.config.architecture == {"llama": "mixtral", "gpt-oss": "gptoss"}.get(arch, arch)
        assert all(isinstance(layer.mlp.experts, PackedExperts) for layer in engine.model.layers)
        out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
        assert len(out[0].token_ids) == 4


def test_an_expert_model_is_served_to_the_openai_client(smollm2_path):
    openai = pytest.importorskip("openai")
    from conftest import random_smollm2_shaped, served

    model, tokenizer = random_smollm2_shaped(smollm2_path, architecture="qwen3moe", num_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=256)
    options = dict(max_batch_size=4, max_model_len=256, kv_cache_bytes=8 << 20, block_size=16)
    messages = [{"role": "user", "content": "Name three experts."}]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    want = build_engine(model, tokenizer=tokenizer, **options).chat(messages, greedy)
    with served(build_engine(model, tokenizer=tokenizer, **options), "moe", "key") as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="key", max_retries=0, timeout=60) as client:
            got = client.chat.completions.create(model="moe", messages=messages, temperature=0, max_tokens=12)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                model="moe", messages=messages, temperature=0, max_tokens=12, stream=True) if chunk.choices)
    assert got.choices[0].message.content == want.text == streamed


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_paged_engine_greedy_equals_transformers_at_batches_1_and_8(reference, mode):
    """Through the paged cache with chunked prefill, eager and compiled (no recompile), one
    prompt alone and eight together: transformers' greedy tokens and logprobs, up to where its
    top two are too close to tell apart."""
    import random

    from engine_oracle_helpers import engine_for, generate, greedy
    from test_architectures_engine import MAX_TOKENS, TOLERANCE, assert_matches_transformers
    name, model, directory = reference
    ours, _ = load_model(str(directory), dtype=torch.float32, with_tokenizer=False)
    options = dict(compile=True, compile_backend="inductor", row_buckets=(1, 8), width_buckets=(64,),
                   warmup="eager") if mode == "compiled" else {}
    torch._dynamo.reset()
    engine = engine_for(ours, max_num_batched_tokens=24, max_batch_size=8, kv_cache_bytes=1 << 22, max_model_len=64,
                        **options)
    rng = random.Random(1)
    batch = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))] for _ in range(8)]
    for prompts in (batch[:1], batch):
        for output, prompt in zip(generate(engine, prompts, greedy(MAX_TOKENS, logprobs=2)), prompts):
            assert_matches_transformers(output, model, prompt, TOLERANCE)
    if mode == "compiled":
        assert engine.stats().recompiles_after_warmup == 0
    engine.check_drained()
