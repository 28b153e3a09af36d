"""Packed linear layers: each format's product equals the dequantised fp32 product, the GGUF's
Q4 blocks repack without loss, and packed weights compile into the same decode as eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from engine_oracle_helpers import assert_greedy_agrees_up_to_near_ties
from quant_support import held_numbers, unpack_codes
from torch import nn

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.build import auto_cpu_plan, resolve_weights
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.group_codes import GroupCodes, quantize_int4, quantize_int8, quantize_int8_groups
from nanoserve.model.quant.linear import (
    DEQUANT_FROM_ROWS,
    GROUP_SIZE,
    HEAD_DENSE_FROM_ROWS,
    GroupLinear,
    Int8GroupLinear,
    Int8Linear,
    tensor_bytes,
)
from nanoserve.model.quant.weight_plan import WeightPlan, group_source, pack_model

# [N, K]: random small shapes and every linear shape of the default model (qkv, o, gate/up, down).
SHAPES = [(16, 32), (48, 96), (960, 576), (576, 576), (1536, 576), (576, 1536)]
# The kernels take bf16 activations, round the output to bf16 and accumulate in fp32 in their
# own order: an output is within this share of the largest |output| of the exact fp32 product.
OUTPUT_TOLERANCE = 2 ** -7
# The group kernels each of this machine's tests runs: torch's, and every tier of nanoserve's
# this host can run (the scalar reference included), each forced in turn.
GROUP_KERNELS = cpu_kernels.host_tiers()
OUR_TIERS = [t for t in GROUP_KERNELS if t != "torch"]


def unpack_int4(layer: GroupLinear) -> torch.Tensor:
    """The codes [N, K] a packed layer holds. torch's layout is read back through its own kernel:
    with scale 1 and zero 8 each weight is its code, and an identity input returns the matrix."""
    k, n = layer.in_features, layer.out_features
    if layer.handle is not None:
        return unpack_codes(layer.codes, n, k)
    unit = torch.stack([torch.ones(k // GROUP_SIZE, n), torch.full((k // GROUP_SIZE, n), 8.0)], -1)
    eye = torch.eye(k, dtype=torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, GROUP_SIZE, unit.bfloat16())
    return out.t().to(torch.uint8)


per_group = cpu_kernels.per_group  # our kernels' [N / 16, G, 16] per-group numbers back as fp32 [N, G]


def kernel_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   group: int = GROUP_SIZE) -> torch.Tensor:
    """What our kernels compute, exactly, in float64: per group of 32, x as two int8 codes,
    ``x ~= fine * (254 * hi + lo)`` (hi rounds x / (max |x| / 127), lo the fp32 remainder / fine),
    integer dot products with the unsigned codes [N, K], then
    ``scale * fine * dot + min * fine * sum(254 * hi + lo)`` per group."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(-1, keepdim=True)
    coarse = torch.where(amax > 1e-30, amax / 127, torch.zeros_like(amax))  # a tinier group counts as zeros
    fine = coarse / 254
    reciprocal = lambda t: torch.where(t > 0, 1 / t, torch.zeros_like(t))  # noqa: E731
    hi = (groups * reciprocal(coarse)).round()
    rest = groups - hi * coarse  # in fp32, the product rounded and then the difference
    lo = (rest * reciprocal(fine)).round()
    x_codes = (254 * hi.double() + lo.double()).view(m, k // group, group)
    dots = torch.einsum("mgk,ngk->mng", x_codes, codes.double().view(codes.shape[0], -1, group))
    fine = fine.double().view(m, 1, -1).repeat_interleave(GROUP_SIZE // group, -1)
    x_sums = fine * x_codes.sum(-1)[:, None, :]
    return (dots * scales.double() * fine + mins.double() * x_sums).sum(-1)


def assert_close_to_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, slack: float = 0.0) -> None:
    want = x.float() @ weight.float().t()
    err = (out.float() - want).abs().max().item()
    assert err <= OUTPUT_TOLERANCE * want.abs().max().item() + slack, (err, want.abs().max().item())


def gemm_excess(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> float:
    """How much torch's own GEMM in ``dtype`` errs on this host beyond a rounding of its output
    (2^-8 of the largest output), on these operands rounded to ``dtype``: nothing on x86, whose
    bf16 GEMM sums in fp32; about as much again on aarch64 torch (2.10: 0.0076 of the largest
    output against 0.0032 on x86). A prompt's dequantised path is that GEMM, so it is its floor."""
    a, b = x.to(dtype), weight.to(dtype)
    exact = a.double() @ b.double().t()
    err = ((a @ b.t()).double() - exact).abs().max().item()
    return max(0.0, err - 2 ** -8 * exact.abs().max().item())


def assert_kernel_product(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        mins: torch.Tensor, weight: torch.Tensor, group: int = GROUP_SIZE,
                        dequantised: bool = False) -> None:
    """The kernel's output is its exact arithmetic up to fp32 sums and the bf16 output, and the
    activations' two int8 codes keep it as close to the product with unrounded activations as
    torch's kernel, which reads x in bf16 (OUTPUT_TOLERANCE). A prompt's ``dequantised`` path
    rounds each weight to the compute dtype besides."""
    exact = kernel_product(x, codes, scales, mins, group)
    err = (out.double() - exact).abs().max().item()
    bf16_gemm = dequantised and out.dtype == torch.bfloat16
    share = 2 ** -7 if bf16_gemm else 2 ** -8
    slack = gemm_excess(x, weight, out.dtype) if bf16_gemm else 0.0
    assert err <= share * exact.abs().max().item() + slack + 1e-6, (err, exact.abs().max().item(), slack)
    assert_close_to_product(out, x, weight, slack)


# 80 rows: past DEQUANT_FROM_ROWS, a prompt's path (the weight dequantised into a dense GEMM).
@pytest.mark.parametrize("kernel", GROUP_KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 11, 32, 80])
def test_int4_linear_equals_dequantised_product(shape, rows, kernel):
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(shape) * shape[1] ** -0.5)
    dtype = cpu_kernels.compute_dtype(kernel)
    layer = GroupLinear(weight, None, dtype, kernel=kernel)
    x = torch.randn(rows, shape[1], dtype=dtype)
    if shape[1] > GROUP_SIZE:
        x[0, :GROUP_SIZE] *= 1e-37  # a group below our kernels' floor (1e-30), read as zeros
    assert torch.equal(unpack_int4(layer), weight.codes)
    if kernel != "torch":  # w = scale * code + min, both in fp16
        assert_kernel_product(layer(x), x, weight.codes, *held_numbers(layer),
                              weight.dequantize(), dequantised=rows >= layer.dense_from_rows)
        return
    # torch's kernel holds scales and zeros in the activations' dtype: that rounding is the format's.
    zeros = (weight.mins + 8 * weight.scales).bfloat16().float()
    rounded = GroupCodes(weight.codes, weight.scales.bfloat16().float(), zeros - 8 * weight.scales.bfloat16().float(), 4)
    assert_close_to_product(layer(x), x, rounded.dequantize())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int8_linear_equals_dequantised_product(shape, rows):
    torch.manual_seed(0)
    codes, scales = quantize_int8(torch.randn(shape))
    layer = Int8Linear(codes, scales, None, torch.bfloat16)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    assert_close_to_product(layer(x), x, codes.float() * scales.bfloat16().float()[:, None])


@pytest.mark.parametrize("kernel", GROUP_KERNELS)
@pytest.mark.parametrize("shape", SHAPES + [(4096, 576)])
@pytest.mark.parametrize("rows", [1, 5, 11, 32, 80])
def test_int8_group_linear_equals_dequantised_product(shape, rows, kernel):
    torch.manual_seed(0)
    codes, scales = quantize_int8_groups(torch.randn(shape) * shape[1] ** -0.5)
    dtype = cpu_kernels.compute_dtype(kernel)
    layer = Int8GroupLinear(codes, scales, None, dtype, kernel=kernel)
    x = torch.randn(rows, shape[1], dtype=dtype)
    if kernel != "torch":  # unsigned codes c + 128, w = scale * (c + 128) - 128 * scale
        assert torch.equal(cpu_kernels.unpack_bytes(layer.codes, *shape), (codes.to(torch.int16) + 128).to(torch.uint8))
        dense = codes.float().view(shape[0], -1, GROUP_SIZE) * scales[..., None]
        assert_kernel_product(layer(x), x, codes.to(torch.int16) + 128, *held_numbers(layer),
                              dense.view(shape), dequantised=rows >= layer.dense_from_rows)
        return
    # The kernel holds each group's scale in bf16 (16d and d round alike): the format's rounding.
    groups = codes.float().view(shape[0], -1, GROUP_SIZE) * scales.bfloat16().float()[..., None]
    assert_close_to_product(layer(x), x, groups.view(shape))


@pytest.mark.parametrize("tier", OUR_TIERS)
def test_packed_layers_keep_their_fp16_scales_when_the_model_is_cast(tier):
    # model.to(dtype) casts float buffers; the scales travel as int16 bits so they stay fp16.
    model = random_model(tiny_config(), seed=0)
    pack_model(model, WeightPlan("int4", int8_head=True, kernel=tier))
    layer = model.layers[0].self_attn.qkv_proj
    scales = layer.scales.clone()
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    before = layer(x)
    model.to(torch.bfloat16)
    assert layer.scales.dtype == torch.int16 and torch.equal(layer.scales, scales) and torch.equal(layer(x), before)


def test_group_kernels_refuse_what_they_cannot_run(monkeypatch):
    weight = quantize_int4(torch.randn(32, 64))
    lacking = next(t for t in cpu_kernels.TIERS if t not in GROUP_KERNELS)
    with pytest.raises(ValueError, match=f"kernel tier '{lacking}' needs"):
        GroupLinear(weight, None, torch.float32, kernel=lacking)
    with pytest.raises(ValueError, match="kernel"):
        WeightPlan("int8", kernel="torch")
    with pytest.raises(ValueError, match="kernel must be one of"):
        GroupLinear(weight, None, torch.float32, kernel="vnni")
    # auto never hands fp32 activations to torch's int4 kernel (a reference loop there)
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert GroupLinear(weight, None, torch.float32).kernel == "scalar"
    assert GroupLinear(weight, None, torch.bfloat16).kernel == "torch"


def test_int8_groups_recover_q8_0_blocks_exactly():
    # Q8_0 as llama.cpp writes it: an fp16 scale per group, codes in -127..127 reaching +-127.
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (64, 8, GROUP_SIZE), dtype=torch.int8)
    codes[:, :, 5] = torch.where(torch.rand(64, 8) < 0.5, 127, -127).to(torch.int8)
    scales = (torch.rand(64, 8) * 0.02).half().float()
    codes_back, scales_back = quantize_int8_groups((codes.float() * scales[..., None]).view(64, -1))
    assert torch.equal(codes_back, codes.view(64, -1)) and torch.equal(scales_back, scales)


def test_int4_round_to_nearest_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    packed = quantize_int4(weight)
    step = packed.scales.repeat_interleave(GROUP_SIZE, 1)
    # plus the fp16 rounding of the group's minimum and of its 15 steps
    fp16 = (packed.mins.abs() + 15 * packed.scales).repeat_interleave(GROUP_SIZE, 1) * 2 ** -11
    assert ((packed.dequantize() - weight).abs() <= step / 2 + fp16).all()


def test_dense_copy_takes_over_from_its_row_count():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    dense = weight.bfloat16()
    layer = GroupLinear(quantize_int4(weight), None, torch.bfloat16, dense=dense, dense_from_rows=8)
    few, many = torch.randn(7, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(many), many @ dense.t())
    assert not torch.equal(layer(few), few @ dense.t())  # the int4 codes, not the copy


def test_linears_the_int4_kernel_cannot_take_stay_dense():
    # intermediate 40: gate/up have N % 16 != 0 and down has K % 32 != 0, so they keep their
    # float weights (cast with the model); the attention projections pack.
    model = random_model(tiny_config(intermediate_size=40), seed=0)
    pack_model(model, WeightPlan("int4"))
    mlp = model.layers[0].mlp
    assert all(type(m) is nn.Linear for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    assert isinstance(model.layers[0].self_attn.qkv_proj, GroupLinear)


def test_linears_the_int8_kernel_cannot_take_stay_dense_and_serve():
    # torch's int8 kernel reads bf16 activations 16 at a time with no tail, so a layer with
    # K % 16 != 0 would read past its rows (NaN logits, or a segfault that took the process).
    # hidden 40: the q/k/v/o, gate/up and the tied head take K = 40; intermediate 100: down.
    config = tiny_config(hidden_size=40, num_heads=5, num_kv_heads=5, head_dim=8, intermediate_size=100,
                         tie_word_embeddings=True)
    model = random_model(config, seed=0)
    pack_model(model, WeightPlan("int8"))
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    assert isinstance(model.embed_tokens, nn.Embedding)
    engine = build_engine(random_model(config, seed=0), weights="int8", max_batch_size=2, max_model_len=64)
    outs = engine.generate([[1, 2, 3, 4, 5], [9]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=1),
                           use_tqdm=False)
    assert [out.error for out in outs] == [None, None] and all(len(out.token_ids) == 6 for out in outs)
    assert all(math.isfinite(lp.logprob) for out in outs for lp in out.logprobs)
    # intermediate 100 alone: only down (K = 100) stays dense; K = 64 layers and the head pack.
    model = random_model(tiny_config(intermediate_size=100), seed=0)
    pack_model(model, WeightPlan("int8"))
    mlp = model.layers[0].mlp
    assert type(mlp.down_proj) is nn.Linear and isinstance(mlp.gate_up_proj, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear)


@pytest.mark.parametrize("plan", [WeightPlan("int4", dense_from_rows=8), WeightPlan("int8", dense_from_rows=8)],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_fused_gate_up_equals_the_separate_packed_linears_exactly(plan, rows):
    # Packing stacks gate and up into one linear; each half of its output is bit for bit what
    # the part packed on its own gives, on the packed codes (few rows) and on the dense copy.
    model = random_model(tiny_config(), seed=0)
    mlp = model.layers[0].mlp
    gate, up = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    pack_model(model, plan)
    assert mlp.gate_proj is None and mlp.up_proj is None
    fused = mlp.gate_up_proj.to(plan.dtype)
    if plan.format == "int4":
        alone = [GroupLinear(quantize_int4(w), None, plan.dtype, w.to(plan.dtype), 8) for w in (gate, up)]
    else:
        alone = [Int8Linear(*quantize_int8(w), None, plan.dtype, w.to(plan.dtype), 8) for w in (gate, up)]
    x = torch.randn(rows, gate.shape[1], dtype=plan.dtype)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in alone], dim=-1))


def test_fused_mlp_equals_the_unfused_mlp_on_the_same_packed_parts():
    model = random_model(tiny_config(), seed=0)
    mlp = model.layers[0].mlp
    gate, up = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    pack_model(model, WeightPlan("int4"))
    x = torch.randn(2, gate.shape[1], dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    expected_gate, expected_up = (GroupLinear(quantize_int4(w), None, torch.bfloat16) for w in (gate, up))
    hidden = F.silu(expected_gate(x)) * expected_up(x)
    assert torch.equal(mlp(x), mlp.down_proj(hidden))


def test_int4_keeps_the_head_dense():
    model = random_model(tiny_config(tie_word_embeddings=True), seed=0)
    pack_model(model, WeightPlan("int4"))
    assert model.lm_head is None and type(model.embed_tokens) is nn.Embedding


def test_int8_tied_head_and_embedding_share_one_int8_matrix():
    model = random_model(tiny_config(tie_word_embeddings=True), seed=0)
    pack_model(model, WeightPlan("int8"))
    assert isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.table is model.lm_head
    assert model.embed_tokens(torch.tensor([3])).shape == (1, 64)


def test_int8_head_with_a_bf16_copy_shares_the_tied_embedding_table_from_its_own_crossover():
    model = random_model(tiny_config(tie_word_embeddings=True), seed=0)
    plan = WeightPlan("int4", dense_from_rows=24, int8_head=True)
    pack_model(model, plan)
    model.to(plan.dtype)
    head, table = model.lm_head, model.embed_tokens.weight
    assert isinstance(head, GroupLinear) and head.dense.data_ptr() == table.data_ptr()
    parts = sum(tensor_bytes(m) for m in [model.embed_tokens, model.layers, model.norm, head])
    assert tensor_bytes(model) == parts - table.nbytes  # the table counted once
    # The head crosses over to the bf16 table sooner than the linears do.
    assert head.dense_from_rows == HEAD_DENSE_FROM_ROWS < plan.dense_from_rows
    few, many = (torch.randn(rows, 64, dtype=plan.dtype) for rows in (HEAD_DENSE_FROM_ROWS - 1, HEAD_DENSE_FROM_ROWS))
    assert torch.equal(head(few), head._packed_mm(few)) and not torch.equal(head(few), few @ table.t())
    assert torch.equal(model.compute_logits(many), many @ table.t())


def test_int8_head_only_applies_to_int4():
    with pytest.raises(ValueError, match="int8 LM head"):
        WeightPlan("int8", int8_head=True)


@pytest.mark.parametrize("plan", [WeightPlan("int4"), WeightPlan("int8"), WeightPlan("int4", int8_head=True),
                                  WeightPlan("int4", int8_head=True, kernel="torch")], ids=lambda p: p.name)
def test_compiled_packed_decode_equals_eager_with_no_recompiles(plan):
    # Inductor fuses and orders the float work around the kernels differently from eager, so
    # logits differ by rounding: logprobs are compared within the compute dtype's tolerance and
    # tokens up to a near tie (assert_greedy_agrees_up_to_near_ties).
    torch._dynamo.reset()
    options = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=96, weights=plan)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[1, 2, 3], list(range(10, 30)), [7] * 5]
    eager = build_engine(random_model(tiny_config(), seed=0), **options).generate(prompts, params, use_tqdm=False)
    compiled_engine = build_engine(random_model(tiny_config(), seed=0), compile=True, row_buckets=(2, 4), width_buckets=(48, 96), **options)
    compiled = compiled_engine.generate(prompts, params, use_tqdm=False)
    compiled_engine.generate(prompts[:2], params, use_tqdm=False)  # every bucket again, warmed up
    tolerance = 0.05 if plan.dtype == torch.bfloat16 else 1e-3
    for got, ref in zip(compiled, eager):
        assert_greedy_agrees_up_to_near_ties(got, ref, tolerance)
    stats = compiled_engine.stats()
    assert stats.weights == plan.name and stats.recompiles_after_warmup == 0
    torch._dynamo.reset()


def test_weights_argument_resolves_to_a_plan_and_refuses_contradictions():
    auto = auto_cpu_plan()
    assert resolve_weights(None, None, "cpu", named_model=True) == (auto, auto.dtype)
    assert resolve_weights(None, None, "cpu", named_model=False) == (None, torch.float32)
    assert resolve_weights("fp32", None, "cpu", named_model=True) == (WeightPlan("fp32"), torch.float32)
    assert resolve_weights("auto", None, "cuda", named_model=True)[0] == WeightPlan("bf16")
    other = "float32" if WeightPlan("int4").dtype == torch.bfloat16 else "bfloat16"  # not int4's compute dtype
    for weights, dtype, device in [("int3", None, "cpu"), ("int4", other, "cpu"), ("int4", None, "cuda")]:
        with pytest.raises(ValueError, match="weights"):
            resolve_weights(weights, dtype, device, named_model=True)


# --- the default GGUF ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_int4(smollm2_path):
    from nanoserve.model.formats.loader import load_model
    return load_model(str(smollm2_path), weights=WeightPlan("int4"))[0]


@pytest.mark.model
@pytest.mark.slow
def test_int4_repack_of_the_default_gguf_is_lossless(smollm2_path, smollm2, smollm2_int4):
    # Every Q4_1 linear: the codes read back from the packed layer are the file's, and with the
    # file's own scale and minimum (exact in fp32) equal the file's dequantisation bit for bit.
    # torch's kernel then holds scale and zero in bf16, a rounding the fidelity gates judge; our
    # kernels hold the block's own fp16 d and m, so their weights are the file's exactly.
    from nanoserve.model.formats.gguf_loader import GGUFCheckpoint
    ckpt = GGUFCheckpoint.open(smollm2_path)
    groups = ckpt.group_codes(ckpt.config())
    fp32 = dict(smollm2[0].named_modules())
    packed = [(name, layer) for name, layer in smollm2_int4.named_modules() if isinstance(layer, GroupLinear)]
    assert len(packed) == 30 * 4  # qkv, o, gate_up, down
    for name, layer in packed:
        source = group_source(name, groups)
        assert torch.equal(unpack_int4(layer), source.codes), name
        parts = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")] if "gate_up" in name else [name]
        weight = torch.cat([fp32[p].weight for p in parts])
        assert torch.equal(source.dequantize(), weight), name
        if layer.handle is not None:
            d, m = (t.repeat_interleave(GROUP_SIZE, 1) for t in held_numbers(layer))
            assert torch.equal(unpack_int4(layer).float() * d + m, weight), name
    assert smollm2_int4.weight_types == {"F32": "dense", "Q4_1": "packed", "Q8_0": "dense"}


@pytest.mark.model
def test_int8_head_holds_the_default_ggufs_q8_0_embedding_exactly(smollm2):
    # The tied embedding / LM head is Q8_0 in the file: group-wise int8 gets its blocks back,
    # so the head's only rounding is the kernel's bf16 scale.
    table = smollm2[0].embed_tokens.weight
    codes, scales = quantize_int8_groups(table)
    groups = codes.float().view(table.shape[0], -1, GROUP_SIZE) * scales[..., None]
    assert torch.equal(groups.view(table.shape), table)


@pytest.mark.model
@pytest.mark.slow
def test_packed_resident_weights_within_1_3x_of_the_gguf_file(smollm2_path, smollm2_int4):
    # int4 linears with the file's Q8_0 head (which is also the embedding table, read from the
    # codes) on every tier of nanoserve's; int4 with a dense head where that head is bf16 (torch's
    # kernel, the fallback without a compiler, keeps a bf16 table beside an int8 head).
    from nanoserve.model.formats.loader import load_model
    size = smollm2_path.stat().st_size
    plans = [] if WeightPlan("int4").tier == "torch" else [WeightPlan("int4", int8_head=True)]
    if smollm2_int4.norm.weight.dtype == torch.bfloat16:
        plans.append(WeightPlan("int4"))
    assert plans
    for plan in plans:
        model = smollm2_int4 if plan == WeightPlan("int4") else load_model(str(smollm2_path), weights=plan)[0]
        resident = tensor_bytes(model)
        print(f"{plan.name} resident {resident / 1e6:.1f} MB = {resident / size:.2f}x the GGUF ({size / 1e6:.1f} MB)")
        assert resident <= 1.3 * size, plan.name


@pytest.mark.parametrize("tier", OUR_TIERS)
def test_a_tied_int8_head_without_a_dense_copy_serves_the_embedding_from_its_codes(tier):
    from nanoserve.model.quant.linear import GroupEmbedding
    model = random_model(tiny_config(tie_word_embeddings=True), seed=0)
    table = model.embed_tokens.weight.detach().clone()
    plan = WeightPlan("int4", int8_head=True, kernel=tier)
    pack_model(model, plan)
    model.to(plan.dtype)
    assert isinstance(model.embed_tokens, GroupEmbedding) and model.embed_tokens.table is model.lm_head
    assert not any(t.is_floating_point() and t.numel() >= table.numel() for t in model.state_dict().values())
    codes, scales = quantize_int8_groups(table)
    tokens = torch.tensor([[0, 5, 255], [17, 17, 3]])
    # fp16 d times the code, exact in fp32 (11 + 8 significant bits)
    want = (codes.float().view(256, -1, GROUP_SIZE) * scales.half().float()[..., None]).view(256, -1)[tokens]
    got = model.embed_tokens(tokens)
    assert got.shape == (2, 3, 64) and got.dtype == plan.dtype and torch.equal(got, want.to(plan.dtype))
    with pytest.raises(RuntimeError, match="rows must lie"):
        model.embed_tokens(torch.tensor([256]))


@pytest.mark.parametrize("kernel", [k for k in GROUP_KERNELS if k != "torch"])
def test_a_prompts_rows_at_8_bit_activations_run_the_kernel_where_the_tier_computes_in_fp32(kernel):
    # Where a layer's activations are 8-bit by a prompt's row count and the dense GEMM would run
    # in fp32, the kernel beats dequantise-and-GEMM (linear_bench's int4_vs_int4_a8): the layer
    # never dequantises. A bf16 tier keeps the bf16 GEMM (16-bit fidelity for prompts).
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(96, 128) * 128 ** -0.5)
    dtype = cpu_kernels.compute_dtype(kernel)
    rows = DEQUANT_FROM_ROWS[kernel] + 16
    layer = GroupLinear(weight, None, dtype, kernel=kernel, a8_from_rows=2)
    x = torch.randn(rows, 128, dtype=dtype)
    if dtype == torch.bfloat16:
        assert layer.dense_from_rows == DEQUANT_FROM_ROWS[kernel]
        return
    assert layer.dense_from_rows is None
    want = torch.ops.nanoserve.group_mm(x, layer.codes, layer.scales, layer.mins, layer.zero_point, layer.handle, 8)
    assert torch.equal(layer(x), want)
    exact = x.float() @ weight.dequantize().float().t()
    assert (want.float() - exact).abs().max() <= 2 ** -6 * exact.abs().max()
    # 16-bit activations at those rows (or 8 only from past them) still dequantise.
    assert GroupLinear(weight, None, dtype, kernel=kernel).dense_from_rows == DEQUANT_FROM_ROWS[kernel]
    late = GroupLinear(weight, None, dtype, kernel=kernel, a8_from_rows=rows)
    assert late.dense_from_rows == DEQUANT_FROM_ROWS[kernel]


def test_a_compiled_bucket_past_the_dequantise_row_count_decodes_as_eager():
    # A row bucket of DEQUANT_FROM_ROWS rows or more traces the dequantise-and-GEMM path (the
    # op's fake shape) into the graph: it decodes as eager does, with no recompile.
    plan = WeightPlan("int4", int8_head=True)
    rows = DEQUANT_FROM_ROWS.get(plan.tier)
    if rows is None:  # torch's kernel: no dequantised path to trace
        rows = 8
    torch._dynamo.reset()
    options = dict(max_batch_size=rows, kv_cache_bytes=4 << 20, block_size=4, max_model_len=32, weights=plan)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompts = [[1 + i % 200, 2 + i % 100, 3] for i in range(rows)]
    eager = build_engine(random_model(tiny_config(), seed=0), **options).generate(prompts, params, use_tqdm=False)
    compiled_engine = build_engine(random_model(tiny_config(), seed=0), compile=True, row_buckets=(rows,),
                                   width_buckets=(32,), **options)
    compiled = compiled_engine.generate(prompts, params, use_tqdm=False)
    tolerance = 0.05 if plan.dtype == torch.bfloat16 else 1e-3
    for got, ref in zip(compiled, eager):
        assert_greedy_agrees_up_to_near_ties(got, ref, tolerance)
    assert compiled_engine.stats().recompiles_after_warmup == 0
    assert compiled_engine.stats().max_decode_rows == rows
    torch._dynamo.reset()


def test_auto_keeps_a_dense_copy_only_as_bf16():
    # The measured crossovers are against a bf16 copy; where the tier computes in fp32 an fp32
    # copy (4x the codes) is never kept, and the plan's name says which copy there is.
    for tier in OUR_TIERS:
        plan = auto_cpu_plan(tier)
        if cpu_kernels.compute_dtype(tier) == torch.float32:
            assert plan.dense_from_rows is None
        elif plan.dense_from_rows is not None:
            assert f"+bf16>={plan.dense_from_rows}" in plan.name or plan.dtype != torch.bfloat16
