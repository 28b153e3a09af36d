"""Every GGUF block type runs packed from its own blocks: a tensor quantised by gguf's own
quantiser (or, for the K-quants gguf cannot quantise to, written block by block) runs through
its packed kernel on every tier this host has, and equals gguf's dequantisation times the
input within the format's tolerance; the codes and numbers read back are the file's. A tiny
llama GGUF mixing the types loads, says how each type runs, and gives the fp32 dequantised
model's logits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from engine_oracle_helpers import dequantised_logits_bound
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from quant_support import held_numbers, unpack_codes

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.llama import dense_forward, unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.gguf_blocks import K_QUANTS, LEGACY, LOW_BIT, PACKED_TYPES, group_codes
from nanoserve.model.quant.group_codes import as_torch_int4
from nanoserve.model.quant.linear import ConcatLinear, GroupLinear
from nanoserve.model.quant.weight_plan import WeightPlan

# The types gguf's quantiser writes and the K-quants of 4 to 6 bits; the low-bit ones (LOW_BIT:
# Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4) are test_lowbit_blocks.py's.
TYPES = sorted(LEGACY + K_QUANTS, key=lambda q: q.value)
KERNELS = cpu_kernels.host_tiers()  # every tier of ours this host runs, the reference, and torch's
# The kernels' output against the exact fp32 product: bf16 activations and output, fp32 sums in
# their own order, within this share of the largest |output|.
OUTPUT_TOLERANCE = 2 ** -7


def random_k_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks of a K-quant: random codes and 6-bit (Q6_K: 8-bit) scales, and fp16
    super-block scales d (and dmin) that make the weights about 1 / sqrt(cols), a layer's size
    (a code times its group's scale is about 256 d, Q6_K's about 1024 d)."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)
    size = (1024 if qtype == Q.Q6_K else 256) * np.sqrt(cols)
    supers = (rng.standard_normal((rows, cols // block_weights, 2)) / size).astype(np.float16)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = supers[..., :1].view(np.uint8)
    else:
        blocks[..., 0:4] = supers.view(np.uint8).reshape(rows, cols // block_weights, 4)
    return blocks.reshape(rows, -1)


def file_tensor(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """A tensor's bytes as a GGUF holds them: gguf's own quantiser where it has one."""
    if qtype in K_QUANTS:
        return random_k_blocks(qtype, rows, cols, seed)
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
    return quantize(weight, qtype)


def torch_format_weight(source) -> torch.Tensor:
    """The weight torch's int4 kernel computes with: its scales and zeros in bf16 (its format)."""
    q, scales, zeros = as_torch_int4(source)
    expand = lambda t: t.bfloat16().float().repeat_interleave(32, 1)  # noqa: E731
    halves = (q.float() - 8) * expand(scales) + expand(zeros)
    k = source.codes.shape[1]
    return halves if halves.shape[1] == k else halves[:, :k] + halves[:, k:]


def test_every_type_gguf_names_is_accounted_for():
    assert {t.name for t in LEGACY} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
    assert {t.name for t in K_QUANTS} == {"Q4_K", "Q5_K", "Q6_K"}
    assert {t.name for t in LOW_BIT} == {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
    assert PACKED_TYPES == frozenset(LEGACY + K_QUANTS + LOW_BIT)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_codes_and_numbers_read_from_the_blocks_are_the_files(qtype):
    rows, cols = 48, 512
    data = file_tensor(qtype, rows, cols, seed=qtype.value)
    source = group_codes(data, qtype, rows, cols)
    reference = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).astype(np.float32))
    # scale * code + minimum is gguf's dequantisation bit for bit, with every code in range: a
    # weight and its (nonzero) scale and minimum determine its code, so these are the file's codes.
    assert int(source.codes.max()) < 2 ** source.bits
    assert torch.equal(source.dequantize(), reference)
    assert source.group == (16 if qtype == Q.Q6_K else 32) and source.bits == {
        Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8}[qtype]
    if qtype == Q.Q8_0:  # the int8 codes are the file's bytes after the fp16 scale
        stored = data.reshape(rows, -1, 34)[..., 2:].view(np.int8).reshape(rows, cols)
        assert torch.equal(source.codes.int() - 128, torch.from_numpy(stored.astype(np.int32)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 80])  # 80: a prompt's rows, through the dequantised weight
def test_each_type_runs_packed_as_ggufs_dequantisation_times_the_input(kernel, qtype, rows):
    n, k = 48, 512
    data = file_tensor(qtype, n, k, seed=qtype.value)
    source = group_codes(data, qtype, n, k)
    reference = torch.from_numpy(dequantize(data, qtype).reshape(n, k).astype(np.float32))
    dtype = cpu_kernels.compute_dtype(kernel)
    if kernel == "torch" and source.group != 32:
        with pytest.raises(ValueError, match="groups of 32 only"):
            GroupLinear(source, None, dtype, kernel=kernel)
        return
    layer = GroupLinear(source, None, dtype, kernel=kernel)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = reference if kernel != "torch" else torch_format_weight(source)
    want = x.float() @ weight.t()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert (got.float() - want).abs().max() <= OUTPUT_TOLERANCE * want.abs().max()
    if kernel == "torch":
        return
    # Read back, the layer holds the file's codes, scales and minimums, in a precision that
    # represents them exactly (fp16 where all are fp16 numbers, else fp32), and dequantises to
    # gguf's values bit for bit.
    assert layer.codes.numel() * 8 == n * k * {4: 4, 5: 5, 6: 6, 8: 8}[source.bits]  # bits a code held
    assert torch.equal(unpack_codes(layer.codes, n, k), source.codes)
    assert all(torch.equal(a, b) for a, b in zip(held_numbers(layer), (source.scales, source.mins)))
    # fp16 numbers as the legacy blocks hold them; a K-quant's super-block records (fp16 times int8)
    assert layer.scales.dtype == (torch.int16 if qtype in LEGACY else torch.uint8)
    # the symmetric types keep a zero point instead of minimums
    assert layer.zero_point == {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128, Q.Q6_K: 32}.get(qtype, 0)
    assert (layer.mins.numel() == 0) == (layer.zero_point > 0)
    dense = torch.ops.nanoserve.dequantize(layer.codes, layer.scales, layer.mins, layer.zero_point, n, k, torch.float32,
                                           layer.handle)
    assert torch.equal(dense, reference)


# --- a tiny llama GGUF of mixed types -------------------------------------------------------

# hidden 256 and intermediate 512: K-quant rows are 256 wide. Every type appears on a linear;
# a layer's q, k and v (fused into one projection) mix three formats.
CONFIG = tiny_config(vocab_size=272, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     head_dim=64, tie_word_embeddings=True)
MIXED = {
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q5_0, "blk.0.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q5_0,
    "blk.1.attn_output.weight": Q.Q4_K, "blk.1.ffn_gate.weight": Q.Q5_K, "blk.1.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_down.weight": Q.Q4_K, "token_embd.weight": Q.Q6_K,  # the tied head and the embedding
}


def plant_valid_k_blocks(path) -> None:
    """The GGUF writer plants random bytes for the K-quants (gguf cannot quantise to them):
    give those blocks sane super-block scales in place, so the weights are of a layer's size."""
    reader = gguf.GGUFReader(str(path), "r+")
    for t in reader.tensors:
        if t.tensor_type in K_QUANTS:
            rows, cols = (int(d) for d in reversed(t.shape))
            t.data[...] = random_k_blocks(t.tensor_type, rows, cols, seed=len(t.name)).reshape(t.data.shape)
    reader.data.flush()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    from conftest import write_gguf
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_gguf(path, CONFIG, unfuse_hf_weights(random_model(CONFIG, seed=0)), tensor_types=MIXED)
    plant_valid_k_blocks(path)
    return path


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_gguf_of_mixed_types_runs_packed_with_the_fp32_dequantised_logits(mixed_gguf, kernel):
    reference, _ = load_model(str(mixed_gguf), weights=WeightPlan("fp32"))
    plan = WeightPlan("int4", int8_head=True, kernel=kernel)
    model, _ = load_model(str(mixed_gguf), weights=plan)
    # A projection whose parts differ in type runs them each in its own format (ConcatLinear).
    packed = {name for name, m in model.named_modules()
              if isinstance(m, (GroupLinear, ConcatLinear)) and ".parts." not in name}
    if kernel == "torch":  # no group-16 format there: the layers holding Q6_K stay dense
        assert model.weight_types["Q6_K"] == "dense" and "layers.0.self_attn.qkv_proj" not in packed
        # Q4_K and Q5_K share layer 0's q/k/v projection with Q6_K, and run packed elsewhere
        assert model.weight_types["Q4_K"] == model.weight_types["Q5_K"] == "dense+packed"
        assert {model.weight_types[t.name] for t in LEGACY} == {"packed"}
    else:
        assert all(model.weight_types[t.name] == "packed" for t in TYPES)
        assert len(packed) == 2 * 4 + 1  # every linear and the tied head
    assert model.weight_types["F32"] == "dense"  # the norms
    ids = torch.tensor([[3, 17, 250, 99, 5, 8, 200, 41]])
    with torch.no_grad():
        want = dense_forward(reference, ids)[0].float()
        got = dense_forward(model, ids)[0].float()
        bound = dequantised_logits_bound(mixed_gguf, plan, want, ids)
    assert (got - want).abs().max() <= bound


def test_engine_stats_say_how_each_tensor_type_runs(mixed_gguf):
    engine = build_engine(str(mixed_gguf), max_batch_size=2, max_model_len=32, kv_cache_bytes=1 << 20)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.error is None and len(out.token_ids) == 3
    types = engine.stats().weight_types
    assert set(types) == {t.name for t in TYPES} | {"F32"}
    # torch's kernel has no group-16 format: Q4_K shares layer 0's q/k/v projection with Q6_K there
    q4_k = "dense+packed" if cpu_kernels.resolve_tier() == "torch" else "packed"
    assert types["F32"] == "dense" and types["Q4_K"] == q4_k and types["Q5_0"] == "packed"
    dense = build_engine(str(mixed_gguf), weights="fp32", max_batch_size=2, max_model_len=32,
                         kv_cache_bytes=1 << 20)
    assert set(dense.stats().weight_types.values()) == {"dense"}


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.TQ2_0], ids=lambda q: q.name)
def test_a_type_that_does_not_run_packed_is_refused_by_name(tmp_path, qtype):
    from conftest import write_gguf
    path = write_gguf(tmp_path / "other.gguf", CONFIG, unfuse_hf_weights(random_model(CONFIG, seed=0)),
                      tensor_types={"blk.1.ffn_down.weight": qtype})
    with pytest.raises(ModelLoadError, match=f"tensor blk.1.ffn_down.weight has unsupported quantisation type "
                                             f"{qtype.name}"):
        load_model(str(path))
