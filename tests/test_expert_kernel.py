"""The grouped expert kernel (``nanoserve::experts_mm``): a mixture-of-experts step's every
routed (row, expert) product in one call, on every kernel tier this host runs, for every GGUF
block type the engine packs experts from, with uneven routing; packed experts' decode steps
through it against the dequantised experts; and a compiled decode of packed experts whose
routing changes every step without recompiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from compile.model_files import random_blocks
from nanoserve.model.network.experts import PackedExperts, PackedStep, _packed_step, _per_expert_step, glu
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.gguf_blocks import BlockTensor, StackedBlocks

TIERS = [t for t in cpu_kernels.host_tiers() if t != "torch"]  # ours, the reference included
# Every block type the engine packs experts from: between them every (code bits, scale group,
# scales' kind, zero point) the kernels run from a GGUF.
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.Q3_K, Q.Q2_K]
EXPERTS = 6
# Expert ids [rows, top_k] of EXPERTS experts: one row; every row to expert 1 in slot 0 while
# experts 3 and 5 get none; every row to one expert; random ids, duplicates within a row too.
ROUTINGS = {
    "one-row": [[4, 0, 2]],
    "uneven": [[1, 2 * (r % 3)] for r in range(9)],
    "one-expert": [[5], [5], [5]],
    "duplicates": torch.randint(0, EXPERTS, (13, 4), generator=torch.Generator().manual_seed(0)).tolist(),
}


def stacked_experts(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """EXPERTS random experts of [n, k] in ``qtype``, packed from their blocks as the loader
    packs an expert GGUF's, stacked along a leading dimension."""
    rng = np.random.default_rng(seed)
    packs = [StackedBlocks((BlockTensor(qtype, random_blocks(qtype, n, k, rng), n, k),)).pack()
             for _ in range(EXPERTS)]
    return (*(torch.stack([p[i] for p in packs]) for i in range(3)), packs[0][3])


def _format(qtype: Q) -> tuple[int, int, str, int, bool]:
    """(code bits, scale group, scales' kind, zero point, a code table) of ``qtype``'s packed experts."""
    codes, scales, mins, zero = stacked_experts(qtype, 16, 256, 0)
    if scales.dtype == torch.uint8 and scales.shape[3] == 16:  # exponent bytes
        kind, group = "e8m0", 256 // scales.shape[2]
    elif scales.dtype == torch.uint8:  # super-block records: 32 bytes of super-scales, 16 per scale group
        kind, group = "super", 256 // ((scales.shape[3] - 32) // 16)
    else:
        kind, group = {torch.int16: "fp16", torch.int32: "fp32"}[scales.dtype], 256 // scales.shape[2]
    return 8 * codes[0].numel() // (16 * 256), group, kind, zero, cpu_kernels.is_code_table(mins)


def test_the_block_types_cover_every_format_a_gguf_packs_to():
    assert {_format(q) for q in TYPES} == {
        (4, 32, "fp16", 0, False), (4, 32, "fp16", 8, False), (5, 32, "fp16", 0, False), (5, 32, "fp16", 16, False),
        (8, 32, "fp16", 128, False), (4, 32, "super", 0, False), (5, 32, "super", 0, False),
        (6, 16, "super", 32, False), (4, 16, "super", 0, False), (4, 16, "super", 4, False),
        (4, 32, "fp16", 0, True), (4, 32, "super", 0, True), (4, 32, "e8m0", 0, True)}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("x_bits", [16, 8])
def test_grouped_products_are_each_pair_through_its_expert(tier, qtype, routing, dtype, x_bits):
    """Each pair's output is its expert's group_mm of its row on the same tier, bit for bit
    (the same sums in the same order), and the scalar reference's within tolerance; with a row
    of x per row of the step (gate and up) or per pair (down), and activations of 16 or 8 bits."""
    n, k = 48, 256
    codes, scales, mins, zero = stacked_experts(qtype, n, k, seed=len(routing))
    ids = torch.tensor(ROUTINGS[routing])
    rows, top_k = ids.shape
    generator = torch.Generator().manual_seed(rows)
    handle = cpu_kernels.handle(tier)
    for per_pair in (False, True):
        x = torch.randn(rows * top_k if per_pair else rows, k, generator=generator).to(dtype)
        got = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, handle, x_bits)
        assert got.shape == (rows, top_k, n) and got.dtype == dtype
        for r in range(rows):
            for s in range(top_k):
                e, row = ids[r, s], x[r * top_k + s if per_pair else r]
                alone = torch.ops.nanoserve.group_mm(row[None], codes[e], scales[e], mins[e], zero, handle, x_bits)[0]
                assert torch.equal(got[r, s], alone), f"row {r} slot {s}"
        want = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, cpu_kernels.handle("scalar"), x_bits)
        tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("routing", ["uneven", "duplicates"])
def test_grouped_products_split_over_threads_equal_one_threads_bit_for_bit(tier, routing, threads):
    """Threads split the (expert, 16 outputs) tasks by cost, and one that runs out takes some of
    another's, each pair's output summed by one thread: any team size (an uneven one, more
    threads than cores) and whichever thread ends up with a task give one thread's bits."""
    codes, scales, mins, zero = stacked_experts(Q.Q4_K, 80, 256, seed=1)
    ids = torch.tensor(ROUTINGS[routing])
    x = torch.randn(ids.shape[0], 256, generator=torch.Generator().manual_seed(2))
    threads(1)
    alone = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, cpu_kernels.handle(tier))
    for team in (2, 3, 8):
        threads(team)
        for _ in range(5):  # where the splits fall between threads changes run to run
            got = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, cpu_kernels.handle(tier))
            assert torch.equal(got, alone), team


@pytest.mark.parametrize("tier", TIERS)
def test_skipped_pairs_are_zeros_and_leave_the_others_as_they_were(tier):
    codes, scales, mins, zero = stacked_experts(Q.Q5_K, 32, 256, 3)
    handle = cpu_kernels.handle(tier)
    x, ids = torch.randn(4, 256), torch.tensor([[0, 1], [1, 2], [3, 1], [1, 1]])
    everything = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, handle)
    skipped = ids == 1
    got = torch.ops.nanoserve.experts_mm(x, ids.masked_fill(skipped, -1), codes, scales, mins, zero, handle)
    assert torch.equal(got[~skipped], everything[~skipped]) and not got[skipped].any()
    none = torch.ops.nanoserve.experts_mm(x, torch.full_like(ids, -1), codes, scales, mins, zero, handle)
    assert not none.any()


def test_grouped_products_refuse_what_they_cannot_read():
    handle = cpu_kernels.handle("scalar")
    codes, scales, mins, zero = stacked_experts(Q.Q4_K, 16, 256, 0)
    x, ids = torch.randn(2, 256), torch.tensor([[0, 5], [1, 2]])
    torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, handle)  # what fits
    for bad in (6, -2):
        with pytest.raises(RuntimeError, match="expert ids must lie"):
            torch.ops.nanoserve.experts_mm(x, torch.tensor([[0, bad], [1, 2]]), codes, scales, mins, zero, handle)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.nanoserve.experts_mm(torch.randn(3, 256), ids, codes, scales, mins, zero, handle)
    with pytest.raises(RuntimeError, match="ids must be"):
        torch.ops.nanoserve.experts_mm(x, ids.int(), codes, scales, mins, zero, handle)
    with pytest.raises(RuntimeError, match="stacked"):
        torch.ops.nanoserve.experts_mm(x, ids, codes[0], scales, mins, zero, handle)


def _dense_step(experts: PackedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row through its experts one by one, from the dequantised weights in fp32."""
    e_ = experts
    hidden, width = x.shape[1], e_.intermediate

    def dense(prefix: str, e: int, n: int, k: int) -> torch.Tensor:
        parts = (getattr(e_, f"{prefix}_{part}")[e] for part in ("codes", "scales", "mins"))
        return torch.ops.nanoserve.dequantize(*parts, getattr(e_, f"{prefix}_zero"), n, k, torch.float32, e_.handle)

    out = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[r, s])
            gate_up = F.linear(x[r].float(), dense("gate_up", e, 2 * width, hidden))
            if e_.gate_up_bias is not None:
                gate_up = gate_up + e_.gate_up_bias[e].float()
            gate, up = gate_up.chunk(2)
            y = F.linear(glu(e_.activation, gate, up, e_.limit, e_.alpha), dense("down", e, hidden, width))
            if e_.down_bias is not None:
                y = y + e_.down_bias[e].float()
            out[r] += weights[r, s].float() * y
    return out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("qtype,activation", [(Q.Q4_K, "silu"), (Q.MXFP4, "swiglu_oai"), (Q.Q6_K, "silu")],
                         ids=["q4k-silu", "mxfp4-swiglu-oai-biased", "q6k-silu"])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_experts_decode_step_equals_the_dequantised_experts(tier, qtype, activation, rows):
    """A decode-sized step (the grouped kernel: gate and up, the activation, down, the weighted
    sum) against each row through its experts from their dequantised fp32 weights, biases and
    gpt-oss's clamped SwiGLU included, within the int8 activations' tolerance."""
    hidden, width, top_k = 256, 256, 3
    gate_up, down = stacked_experts(qtype, 2 * width, hidden, 1), stacked_experts(qtype, hidden, width, 2)
    generator = torch.Generator().manual_seed(rows)
    biased = activation == "swiglu_oai"
    biases = (0.1 * torch.randn(EXPERTS, 2 * width, generator=generator),
              0.1 * torch.randn(EXPERTS, hidden, generator=generator)) if biased else (None, None)
    dtype = cpu_kernels.compute_dtype(tier)
    experts = PackedExperts(gate_up, down, width, cpu_kernels.handle(tier), 64, activation, *biases,
                            limit=7.0 if biased else 0.0, alpha=1.702 if biased else 1.0).to(dtype)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(rows)])
    ids[:, 0] = 2  # every row shares one expert
    weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
    got = experts(x, ids, weights)
    want = _dense_step(experts, x, ids, weights)
    assert got.shape == x.shape and got.dtype == dtype
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()


@pytest.mark.parametrize("tier", TIERS)
def test_packed_experts_without_a_dequantise_row_count_run_a_prompts_busy_experts_in_the_kernel(tier):
    """dequant_from_rows None (a tier computing in fp32 with 8-bit activations by a prompt's
    rows): an expert with a prompt's rows stays in the grouped kernel, as with a row count no
    step reaches, where 16 rows dequantise it."""
    hidden, width, top_k, rows = 256, 256, 2, 40
    gate_up, down = stacked_experts(Q.Q4_K, 2 * width, hidden, 6), stacked_experts(Q.Q4_K, hidden, width, 7)
    dtype = cpu_kernels.compute_dtype(tier)
    made = {limit: PackedExperts(gate_up, down, width, cpu_kernels.handle(tier), limit, "silu").to(dtype)
            for limit in (None, 10 ** 6, 16)}
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(rows)])
    ids[:, 0] = 3  # expert 3 in every row: past 16
    weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
    outputs = {limit: experts(x, ids, weights) for limit, experts in made.items()}
    assert torch.equal(outputs[None], outputs[10 ** 6])
    assert not torch.equal(outputs[None], outputs[16])
    assert (outputs[None].float() - outputs[16].float()).abs().max() <= 0.03 * outputs[16].float().abs().max()


@pytest.mark.parametrize("tier", TIERS)
def test_packed_experts_take_8_bit_activations_from_a8_from_rows(tier):
    """A step of fewer rows than ``a8_from_rows`` runs the 16-bit products, one of that many the
    8-bit ones: each equal to the experts built with that precision at every row count."""
    hidden, width, top_k, from_rows = 256, 256, 2, 3
    gate_up, down = stacked_experts(Q.Q4_K, 2 * width, hidden, 6), stacked_experts(Q.Q4_K, hidden, width, 7)
    dtype = cpu_kernels.compute_dtype(tier)
    made = {a8: PackedExperts(gate_up, down, width, cpu_kernels.handle(tier), 64, "silu", a8_from_rows=a8).to(dtype)
            for a8 in (from_rows, None, 1)}
    generator = torch.Generator().manual_seed(0)
    for rows, same_as in ((from_rows - 1, None), (from_rows, 1)):
        x = torch.randn(rows, hidden, generator=generator).to(dtype)
        ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
        outputs = {a8: experts(x, ids, weights) for a8, experts in made.items()}
        assert torch.equal(outputs[from_rows], outputs[same_as])
        assert not torch.equal(outputs[None], outputs[1])


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_the_packed_step_equals_the_expert_by_expert_step(tier, rows):
    """The grouped step against the one it replaced (each expert's products called one by one):
    at decode sizes all through the grouped kernel; at a prompt's (``dequant_from_rows`` rows
    or more) the experts with that many pairs dequantised, the rest grouped."""
    hidden, width, top_k, dequant_from_rows = 256, 256, 3, 16
    dtype = cpu_kernels.compute_dtype(tier)
    experts = PackedStep(stacked_experts(Q.Q4_K, 2 * width, hidden, 4), stacked_experts(Q.Q6_K, hidden, width, 5),
                         width, cpu_kernels.handle(tier), "silu", None, None, 0.0, 1.0)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(rows)])
    ids[:, 0] = 4  # expert 4 in every row: past dequant_from_rows in a prompt
    others = ids[:, 1:]
    others[others == 4] = 0
    weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    if rows >= dequant_from_rows:  # both kinds of expert in the step
        assert (counts >= dequant_from_rows).any() and ((counts > 0) & (counts < dequant_from_rows)).any()
    got = _packed_step(x, ids, weights, experts, dequant_from_rows)
    want = _per_expert_step(x, ids, weights, experts, dequant_from_rows)
    assert got.dtype == dtype and (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max()


def test_compiled_decode_of_packed_experts_never_recompiles_as_routing_changes(tmp_path, monkeypatch):
    """A compiled engine over an expert GGUF packed for the kernels: its decode steps go through
    the grouped kernel with a new routing nearly every step, and nothing recompiles (the op's
    fake gives static shapes whatever the routing)."""
    from compile.model_files import Shape, write_model
    from nanoserve.engine import SamplingParams, build_engine
    from nanoserve.model.network import experts as experts_module

    shape = Shape(256, 2, 4, 2, 512, tied=False, arch="qwen3moe", head_dim=64, experts=8, experts_used=2,
                  expert_ffn=256)
    path = write_model(tmp_path / "moe.gguf", shape, "Q4_K_M")
    routings = []
    grouped = experts_module._grouped_outputs

    def recorded(x, ids, *args):
        routings.append(tuple(ids.flatten().tolist()))
        return grouped(x, ids, *args)

    monkeypatch.setattr(experts_module, "_grouped_outputs", recorded)
    engine = build_engine(str(path), compile=True, compile_backend="inductor", warmup="eager", max_batch_size=4,
                          max_model_len=64, kv_cache_bytes=1 << 22, row_buckets=(1, 4), width_buckets=(32, 64))
    assert all(isinstance(layer.mlp.experts, PackedExperts) for layer in engine.model.layers)
    routings.clear()
    out = engine.generate([[1, 2, 3], [5, 6, 7, 8, 9], [11] * 4], SamplingParams(temperature=0.0, max_tokens=24,
                                                                                   ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [24] * 3
    stats = engine.stats()
    assert stats.recompiles_after_warmup == 0 and stats.eager_steps == 0
    assert len(set(routings)) > 24  # two layers a step, the routing new in most of them


@pytest.mark.skipif(not TIERS, reason="nanoserve's CPU ops did not build on this host")
@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS], ids=lambda q: q.name)
def test_table_type_experts_pack_in_the_files_bytes_and_run_as_their_dequantisation(qtype):
    """A table type's experts packed as the loader packs an expert GGUF's (every expert's gate
    and up in one pass): the file's nibbles and numbers, so the held bytes are the file's (IQ4_XS's
    records 1/68 more) plus one 16-byte table an expert, and the grouped products equal the
    dequantised experts' within the int8 activations' tolerance."""
    from gguf.quants import dequantize

    from nanoserve.model.quant.weight_plan import _pack_expert_blocks

    n, k = 64, 256
    rng = np.random.default_rng(int(qtype))
    parts = [tuple(BlockTensor(qtype, random_blocks(qtype, n, k, rng), n, k) for _ in range(2)) for _ in range(EXPERTS)]
    codes, scales, mins, zero = _pack_expert_blocks(parts)
    file_bytes = sum(p.data.nbytes for expert in parts for p in expert)
    assert cpu_kernels.is_code_table(mins) and mins.shape == (EXPERTS, 16) and zero == 0
    held = sum(t.numel() * t.element_size() for t in (codes, scales))
    assert file_bytes <= held <= file_bytes * 1.015
    files = [torch.from_numpy(np.concatenate([dequantize(p.data, qtype) for p in expert]).reshape(2 * n, k))
             for expert in parts]  # gguf's dequantisation of each expert's gate and up
    x, ids = torch.randn(3, k, generator=torch.Generator().manual_seed(0)), torch.tensor([[0, 5], [2, 2], [4, 1]])
    for tier in TIERS:
        handle = cpu_kernels.handle(tier)
        got = torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero, handle)
        for r in range(ids.shape[0]):
            for s in range(ids.shape[1]):
                e = int(ids[r, s])
                dense = torch.ops.nanoserve.dequantize(codes[e], scales[e], mins[e], zero, 2 * n, k, torch.float32,
                                                       handle)
                assert torch.equal(dense, files[e])
                want = dense @ x[r]
                assert (got[r, s] - want).abs().max() <= 1e-4 * want.abs().max(), (tier, r, s)
