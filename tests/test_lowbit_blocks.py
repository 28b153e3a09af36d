"""The low-bit GGUF block types people download (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4) run packed:
each is held exactly (gguf_blocks' docstring), unpacked in a wider format and packed from the
file's bytes in the kernels' formats (the table types as the file's nibbles with their code
table, in about the file's bytes), so the codes read from random but valid blocks dequantise to
gguf's own values bit for bit, the packed products on every kernel tier this host runs equal
gguf's dequantisation times the input within the int8-activation tolerance, the pack from the
file's bytes equals the unpacked path (the table types: the file's nibbles and numbers), and a
tiny llama GGUF whose linears are in these types loads, generates, and gives the fp32
dequantised model's logits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from engine_oracle_helpers import dequantised_logits_bound
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from quant_support import held_numbers, unpack_codes

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.llama import dense_forward, unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant import cpu_kernels, gguf_blocks
from nanoserve.model.quant.gguf_blocks import LOW_BIT, WIDENED_BITS, BlockTensor, StackedBlocks, group_codes
from nanoserve.model.quant.group_codes import as_torch_int4
from nanoserve.model.quant.linear import ConcatLinear, GroupLinear
from nanoserve.model.quant.weight_plan import WeightPlan
from nanoserve.summary import describe_engine

TYPES = sorted(LOW_BIT, key=lambda q: q.value)
KERNELS = cpu_kernels.host_tiers()  # every tier of ours this host runs, the reference, and torch's
OUR_TIERS = [t for t in KERNELS if t != "torch"]
# As test_quant_types: the kernels' output against the exact fp32 product, within this share of
# the largest |output| (int8 activation codes, bf16 activations and output where the tier computes bf16).
OUTPUT_TOLERANCE = 2 ** -7
# What each type is held as unpacked (GroupCodes): (code bits, scale group, zero point; 0:
# minimums held).
HELD = {Q.Q2_K: (2, 16, 0), Q.Q3_K: (3, 16, 4), Q.IQ4_NL: (8, 32, 128), Q.IQ4_XS: (8, 32, 128), Q.MXFP4: (5, 32, 16)}
# The table types packed from their blocks: the file's nibbles through these values.
TABLES = {Q.IQ4_NL: gguf_blocks.IQ4_VALUES, Q.IQ4_XS: gguf_blocks.IQ4_VALUES, Q.MXFP4: gguf_blocks.MXFP4_VALUES}
# Bits a weight held by the kernels (codes and numbers), and in the file (gguf_blocks' docstring).
BITS_HELD = {Q.Q2_K: (5.125, 2.625), Q.Q3_K: (4.5625, 3.4375), Q.IQ4_NL: (4.5, 4.5), Q.IQ4_XS: (4.3125, 4.25),
             Q.MXFP4: (4.25, 4.25)}


def valid_blocks(qtype: Q, rows: int, cols: int, seed: int, exponents: tuple[int, int] = (118, 131)) -> np.ndarray:
    """Random but valid blocks [rows, row bytes]: random bytes for the codes and small scales,
    finite fp16 d (and dmin) that make a weight about 1 / sqrt(cols) (a layer's size), MXFP4's
    exponent bytes drawn from ``exponents`` (its weights are 2^(e - 128) times -12..12)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    count = rows * (cols // block_weights)
    blocks = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)

    def fp16(at: int, typical: float) -> None:  # a number whose weights are typically `typical` times it
        d = (rng.standard_normal(count) / (np.sqrt(cols) * typical)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(count, 2)

    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(*exponents, count)
    elif qtype == Q.IQ4_NL:
        fp16(0, 64)  # the table's values, -127..113
    elif qtype == Q.IQ4_XS:
        fp16(0, 64 * 16)  # 6-bit scales - 32, times the table's values
    elif qtype == Q.Q3_K:
        fp16(108, 16 * 2)  # 6-bit scales - 32, times codes - 4
    else:  # Q2_K: d times 4-bit scales times 2-bit codes, minus dmin times 4-bit minimums
        fp16(80, 8 * 1.5)
        fp16(82, 8)
    return blocks.reshape(rows, -1)


def gguf_weight(data: np.ndarray, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).astype(np.float32))


def test_the_loader_accepts_the_low_bit_types():
    from nanoserve.model.formats.gguf_loader import SUPPORTED_TENSOR_TYPES
    assert {t.name for t in TYPES} == {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
    assert set(TYPES) <= SUPPORTED_TENSOR_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_codes_dequantise_to_ggufs_values_bit_for_bit(qtype):
    rows, cols = 48, 512
    data = valid_blocks(qtype, rows, cols, seed=qtype.value)
    source = group_codes(data, qtype, rows, cols)
    bits, group, zero_point = HELD[qtype]
    assert (source.bits, source.group) == (bits, group)
    assert source.codes.dtype == torch.uint8 and int(source.codes.max()) < 2 ** bits
    if zero_point:  # a symmetric format: every minimum is -zero_point times its scale
        assert torch.equal(source.mins, -zero_point * source.scales)
    assert torch.equal(source.dequantize(), gguf_weight(data, qtype, rows, cols))
    # the row order a llama file's q and k rows are read in leaves every row's values as they are
    order = np.random.default_rng(0).permutation(rows)
    permuted = BlockTensor(qtype, data, rows, cols, order).group_codes()
    assert torch.equal(permuted.dequantize(), gguf_weight(data, qtype, rows, cols)[torch.from_numpy(order)])


def test_the_codes_are_the_files():
    """Beside the values: IQ4_NL's code is the table's value of the file's nibble plus 128, MXFP4's
    its E2M1 value plus 16, Q3_K's the 2 low bits plus 4 times the high bit."""
    table = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
    e2m1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
    for qtype, at, values, zero in ((Q.IQ4_NL, 2, table, 128), (Q.MXFP4, 1, e2m1, 16)):
        data = valid_blocks(qtype, 16, 64, seed=1)
        packed = data.reshape(16, 2, -1)[..., at:at + 16]
        nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(16, 64)
        assert np.array_equal(group_codes(data, qtype, 16, 64).codes.numpy(), values[nibbles] + zero)
    data = valid_blocks(Q.Q3_K, 16, 256, seed=2)
    codes = group_codes(data, Q.Q3_K, 16, 256).codes.numpy().astype(np.int64)
    high = np.unpackbits(data[:, 0:32], axis=-1, bitorder="little").reshape(16, 32, 8).transpose(0, 2, 1)
    assert np.array_equal(codes >> 2, high.reshape(16, 256))


def test_mxfp4_is_exact_over_the_exponents_gguf_keeps_finite():
    """Every exponent up to 251 (2^-128, an fp32 subnormal, to 2^123): bit for bit gguf's values,
    unpacked and packed (the exponent bytes themselves, their scales computed by the kernels)."""
    rows, cols = 32, 256
    data = valid_blocks(Q.MXFP4, rows, cols, seed=5, exponents=(0, 252))
    source = group_codes(data, Q.MXFP4, rows, cols)
    reference = gguf_weight(data, Q.MXFP4, rows, cols)
    assert torch.equal(source.dequantize(), reference)
    if OUR_TIERS:
        codes, scales, table, zero = StackedBlocks((BlockTensor(Q.MXFP4, data, rows, cols),)).pack()
        assert scales.dtype == torch.uint8 and zero == 0  # the file's exponent bytes
        assert torch.equal(cpu_kernels.per_group(scales), source.scales)
        for tier in OUR_TIERS:
            dense = torch.ops.nanoserve.dequantize(codes, scales, table, zero, rows, cols, torch.float32,
                                                   cpu_kernels.handle(tier))
            assert torch.equal(dense, reference), tier


def torch_format_weight(source) -> torch.Tensor:
    """The weight torch's int4 kernel computes with: its scales and zeros in bf16 (its format)."""
    q, scales, zeros = as_torch_int4(source)
    expand = lambda t: t.bfloat16().float().repeat_interleave(32, 1)  # noqa: E731
    halves = (q.float() - 8) * expand(scales) + expand(zeros)
    k = source.codes.shape[1]
    return halves if halves.shape[1] == k else halves[:, :k] + halves[:, k:]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 80])  # 80: a prompt's rows, through the dequantised weight
def test_each_type_runs_packed_as_ggufs_dequantisation_times_the_input(kernel, qtype, rows):
    n, k = 48, 512
    data = valid_blocks(qtype, n, k, seed=qtype.value)
    reference = gguf_weight(data, qtype, n, k)
    weight = StackedBlocks((BlockTensor(qtype, data, n, k),))  # as the loader hands a GGUF's blocks over
    dtype = cpu_kernels.compute_dtype(kernel)
    if kernel == "torch" and weight.group != 32:
        with pytest.raises(ValueError, match="groups of 32 only"):
            GroupLinear(weight, None, dtype, kernel=kernel)
        return
    layer = GroupLinear(weight, None, dtype, kernel=kernel)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.float() @ (reference if kernel != "torch" else torch_format_weight(weight.group_codes())).t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert (got.float() - want).abs().max() <= OUTPUT_TOLERANCE * want.abs().max()
    if kernel == "torch":
        return
    # Read back, the layer holds the file's codes and numbers and dequantises to gguf's values.
    source = weight.group_codes()
    held_codes = unpack_codes(layer.codes, n, k)
    if qtype in TABLES:  # the file's nibbles, 4 bits each, standing for their table's values
        assert layer.zero_point == 0 and torch.equal(layer.mins, torch.from_numpy(TABLES[qtype]).to(torch.int8))
        assert layer.codes.numel() * 2 == n * k and int(held_codes.max()) < 16
        assert torch.equal(layer.mins[held_codes.long()].int() + HELD[qtype][2], source.codes.int())
        assert torch.equal(held_numbers(layer)[0], source.scales) and not held_numbers(layer)[1].any()
    else:
        bits, group, zero_point = HELD[qtype]
        assert layer.zero_point == zero_point and (layer.mins.numel() == 0) == (zero_point > 0)
        assert layer.codes.numel() * 8 == n * k * cpu_kernels.storage_bits(bits)
        assert torch.equal(held_codes, source.codes)
        assert all(torch.equal(a, b) for a, b in zip(held_numbers(layer), (source.scales, source.mins)))
    held_bytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.mins))
    if qtype in TABLES:  # the file's bytes, give or take IQ4_XS's records (1/68 more) and the table
        assert held_bytes <= data.nbytes * 1.015 + 16
        held_bytes -= 16
    held = held_bytes * 8 / (n * k)
    assert (held, 8 * data.nbytes / (n * k)) == BITS_HELD[qtype] == WIDENED_BITS[qtype.name]
    dense = torch.ops.nanoserve.dequantize(layer.codes, layer.scales, layer.mins, layer.zero_point, n, k,
                                           torch.float32, layer.handle)
    assert torch.equal(dense, reference)


@pytest.mark.skipif(not OUR_TIERS, reason="nanoserve's CPU ops did not build on this host")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packing_from_the_files_bytes_equals_packing_the_unpacked_codes(qtype):
    """The table types: the file's nibbles packed as 4-bit codes, its numbers as they are
    (IQ4_NL's fp16 d, IQ4_XS's super-block records, MXFP4's exponent bytes) and the table."""
    rows, cols = 48, 512
    data = valid_blocks(qtype, rows, cols, seed=7)
    order = np.random.default_rng(3).permutation(rows)
    tensor = BlockTensor(qtype, data, rows, cols, order)
    codes = tensor.group_codes()
    got = StackedBlocks((tensor,)).pack()
    if qtype in TABLES:
        nibbles = cpu_kernels.gguf_codes(data[order], int(qtype), rows, cols, scalar=True)
        assert torch.equal(got[0], cpu_kernels.pack_nibbles(nibbles))
        assert torch.equal(cpu_kernels.per_group(got[1]), codes.scales)
        if qtype == Q.IQ4_XS:  # records as pack_groups writes a K-quant's
            assert torch.equal(got[1], cpu_kernels.pack_groups(codes.codes, codes.scales, codes.mins, codes.bits,
                                                               codes.scale_factors, codes.min_factors)[1])
        assert torch.equal(got[2], torch.from_numpy(TABLES[qtype]).to(torch.int8)) and got[3] == 0
        return
    want = cpu_kernels.pack_groups(codes.codes, codes.scales, codes.mins, codes.bits, codes.scale_factors,
                                   codes.min_factors)
    for name, a, b in zip(("codes", "scales", "mins"), want[:3], got[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert want[3] == got[3]


# --- a tiny llama GGUF whose linears are in the low-bit types ---------------------------------

# hidden 256 and intermediate 512: super-block rows are 256 wide. Layer 0's projections are each
# one type; layer 1's q/k/v and gate/up mix types (each part in its own format: ConcatLinear).
CONFIG = tiny_config(vocab_size=272, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     head_dim=64, tie_word_embeddings=True)
LOW_BIT_FILE = {
    "blk.0.attn_q.weight": Q.IQ4_NL, "blk.0.attn_k.weight": Q.IQ4_NL, "blk.0.attn_v.weight": Q.IQ4_NL,
    "blk.0.attn_output.weight": Q.Q3_K, "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q2_K,
    "blk.0.ffn_down.weight": Q.MXFP4,
    "blk.1.attn_q.weight": Q.Q3_K, "blk.1.attn_k.weight": Q.MXFP4, "blk.1.attn_v.weight": Q.IQ4_XS,
    "blk.1.attn_output.weight": Q.IQ4_XS, "blk.1.ffn_gate.weight": Q.MXFP4, "blk.1.ffn_up.weight": Q.IQ4_NL,
    "blk.1.ffn_down.weight": Q.Q2_K, "token_embd.weight": Q.IQ4_XS,  # the tied head and the embedding
}


@pytest.fixture(scope="module")
def low_bit_gguf(tmp_path_factory):
    """The GGUF writer stores random bytes where gguf cannot quantise (all but MXFP4): every
    low-bit tensor gets valid blocks of a layer's size in place."""
    from conftest import write_gguf
    path = tmp_path_factory.mktemp("lowbit") / "lowbit.gguf"
    write_gguf(path, CONFIG, unfuse_hf_weights(random_model(CONFIG, seed=0)), tensor_types=LOW_BIT_FILE)
    reader = gguf.GGUFReader(str(path), "r+")
    for t in reader.tensors:
        if t.tensor_type in LOW_BIT:
            rows, cols = (int(d) for d in reversed(t.shape))
            t.data[...] = valid_blocks(t.tensor_type, rows, cols, seed=len(t.name),
                                       exponents=(119, 124)).reshape(t.data.shape)
    reader.data.flush()
    return path


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_low_bit_gguf_runs_packed_with_the_fp32_dequantised_logits(low_bit_gguf, kernel):
    reference, _ = load_model(str(low_bit_gguf), weights=WeightPlan("fp32"))
    plan = WeightPlan("int4", int8_head=True, kernel=kernel)
    model, _ = load_model(str(low_bit_gguf), weights=plan)
    packed = {name for name, m in model.named_modules()
              if isinstance(m, (GroupLinear, ConcatLinear)) and ".parts." not in name}
    if kernel == "torch":  # no group-16 format there: Q2_K and Q3_K layers stay dense
        assert model.weight_types["Q2_K"] == model.weight_types["Q3_K"] == "dense"
        assert model.weight_types["IQ4_NL"] == "packed"
        # IQ4_XS and MXFP4 share layer 1's q/k/v projection with Q3_K, and run packed elsewhere
        assert model.weight_types["IQ4_XS"] == model.weight_types["MXFP4"] == "dense+packed"
    else:
        assert all(model.weight_types[t.name] == "packed" for t in TYPES)
        assert len(packed) == 2 * 4 + 1  # every linear and the tied head
    assert model.weight_types["F32"] == "dense"  # the norms
    ids = torch.tensor([[3, 17, 250, 99, 5, 8, 200, 41]])
    with torch.no_grad():
        want = dense_forward(reference, ids)[0].float()
        got = dense_forward(model, ids)[0].float()
        bound = dequantised_logits_bound(low_bit_gguf, plan, want, ids)
    assert (got - want).abs().max() <= bound


def test_a_low_bit_gguf_generates_and_its_stats_say_how_each_type_runs(low_bit_gguf):
    engine = build_engine(str(low_bit_gguf), max_batch_size=2, max_model_len=32, kv_cache_bytes=1 << 20)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.error is None and len(out.token_ids) == 4
    types = engine.stats().weight_types
    assert set(types) == {t.name for t in TYPES} | {"F32"}
    group_16 = "dense" if cpu_kernels.resolve_tier() == "torch" else "packed"
    assert types["IQ4_NL"] == types["IQ4_XS"] == types["MXFP4"] == "packed"
    assert types["Q2_K"] == types["Q3_K"] == group_16
    # the startup summary names each type, and what a widened one holds against its file
    line = next(x for x in describe_engine(engine, "lowbit", 0.0) if x.startswith("tensor types: "))
    if group_16 == "packed":  # nanoserve's kernels: the table types in the file's own bits
        assert "F32 dense" in line and "IQ4_NL packed (4.50 bits a weight held, the file's 4.50)" in line
        assert "MXFP4 packed (4.25 bits a weight held, the file's 4.25)" in line
        assert "IQ4_XS packed (4.31 bits a weight held, the file's 4.25)" in line


# --- hostile files: the low-bit types' sizes are gguf's (GGML_QUANT_SIZES), checked as every type's --


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_that_is_no_whole_number_of_blocks_is_refused(tmp_path, low_bit_gguf, qtype):
    from model_fuzz import patch_tensor_info

    path = tmp_path / "rows.gguf"
    path.write_bytes(low_bit_gguf.read_bytes())
    index = next(i for i, t in enumerate(gguf.GGUFReader(str(path)).tensors) if t.tensor_type == qtype)
    patch_tensor_info(path, index, "dim", GGML_QUANT_SIZES[qtype][0] // 2)
    with pytest.raises(ModelLoadError, match=f"rows.gguf: .*not a multiple of {qtype.name} block size"):
        load_model(str(path))


def test_a_low_bit_file_cut_short_is_refused(tmp_path, low_bit_gguf):
    data = low_bit_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(ModelLoadError, match="cut.gguf: .*truncated"):
        load_model(str(cut))
