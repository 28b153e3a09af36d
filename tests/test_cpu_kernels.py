"""nanoserve's CPU kernel tiers: every tier this host can run, forced one at a time, against the
scalar reference (integer group sums and activation codes exactly, products and attention within
the format's tolerance), and the switch that chooses among them."""

from __future__ import annotations

import importlib.util
import shutil
import types
from pathlib import Path

import pytest
import torch
from attention_support import paged_attention_reference
from quant_support import unpack_codes

from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.group_codes import SuperScales
from nanoserve.model.quant.linear import GROUP_SIZE

# Every tier of ours this host runs, the reference included: each is tested here, none skipped.
TIERS = [t for t in cpu_kernels.host_tiers() if t != "torch"]
VECTOR_TIERS = [t for t in TIERS if t != "scalar"]
SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536)]
# The kernels' weight formats: (the codes' storage bits, scale group, the scales' kind, zero
# point). Kinds: fp16 numbers, fp32 numbers, a K-quant's super-block records (fp16 times int8);
# a symmetric format's zero point (Q4_0 8, Q5_0 16, Q8_0 128, Q6_K 32) replaces its minimums.
# Q4_1, Q4_0, Q5_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, then combinations no GGUF type uses.
FP16, FP32, SUPER = "fp16", "fp32", "super"
FORMATS = [(4, 32, FP16, 0), (4, 32, FP16, 8), (5, 32, FP16, 0), (5, 32, FP16, 16), (8, 32, FP16, 128),
           (4, 32, SUPER, 0), (5, 32, SUPER, 0), (6, 16, SUPER, 32), (4, 32, FP32, 0), (6, 16, FP32, 32),
           (8, 32, FP32, 0), (8, 16, FP16, 0), (4, 16, FP32, 0), (5, 16, FP16, 0), (6, 32, FP16, 0),
           (8, 16, SUPER, 0)]
FORMAT_IDS = [f"{b}bit-g{g}-{kind}-z{z}" for b, g, kind, z in FORMATS]


def random_codes(n: int, k: int, bits: int, seed: int) -> torch.Tensor:
    """Random codes of ``bits`` bits, packed, checked to unpack to themselves."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=generator, dtype=torch.int32).to(torch.uint8)
    packed = cpu_kernels.pack_groups(codes, torch.ones(n, k // 32), torch.zeros(n, k // 32), bits)[0]
    assert packed.numel() == n * k * bits // 8 and torch.equal(unpack_codes(packed, n, k), codes)
    return packed


def random_scales(n: int, k: int, group: int, kind: str, generator: torch.Generator,
                  sign: float = 1.0) -> torch.Tensor:
    """Scales for a weight [N, K] with scale groups of ``group`` as the kernels hold them: fp16
    bits [N / 16, K / group, 16]; fp32 bits of a K-quant's kind (an fp16 number times a 6-bit
    integer, mostly no fp16 number itself); or super-block records of fp16 super-scales and int8
    multipliers (group_codes.SuperScales)."""
    values = sign * torch.rand(n // 16, k // group, 16, generator=generator)
    if kind == FP16:
        return values.half().view(torch.int16)
    if kind == FP32:
        six = torch.randint(1, 64, values.shape, generator=generator).float()
        return (values.half().float() * six).view(torch.int32)
    factors = SuperScales(sign * torch.rand(n, k // 256, generator=generator).half().float(),
                          torch.randint(-128, 128, (n, k // group), generator=generator).to(torch.int8))
    codes = torch.zeros(n, k, dtype=torch.uint8)
    return cpu_kernels.pack_groups(codes, factors.values(), factors.values(), 8, factors, factors)[1]


def random_weight(n: int, k: int, fmt: tuple, seed: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [N, K] of ``fmt`` (FORMATS) as the kernels take it: (codes, scales, mins), the mins
    empty where the format's zero point stands for them; the codes from ``seed``, the numbers
    from ``generator``."""
    bits, group, kind, zero_point = fmt
    scales = random_scales(n, k, group, kind, generator)
    mins = random_scales(n, k, group, kind, generator, sign=-1.0)[:, :0 if zero_point else None]
    return random_codes(n, k, bits, seed), scales, mins


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("shape", SHAPES)
def test_integer_group_sums_equal_the_scalar_reference_exactly(tier, bits, group, shape):
    n, k = shape
    codes = random_codes(n, k, bits, seed=n + k)
    x = torch.randint(-127, 128, (k,), generator=torch.Generator().manual_seed(k), dtype=torch.int8)
    x[:GROUP_SIZE] = 127  # the extremes, where a saturating int16 sum would show
    x[GROUP_SIZE:2 * GROUP_SIZE] = -127
    want = torch.ops.nanoserve.group_dots(x, codes, n, group, cpu_kernels.handle("scalar"))
    got = torch.ops.nanoserve.group_dots(x, codes, n, group, cpu_kernels.handle(tier))
    assert torch.equal(got, want)
    # and the reference is the plain sum over each group
    unpacked = unpack_codes(codes, n, k).int()
    plain = (unpacked.view(n, -1, group) * x.int().view(1, -1, group)).sum(-1)
    assert torch.equal(want, plain)


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_activation_codes_are_the_same_on_every_tier(tier, dtype):
    x = torch.randn(37, 576).to(dtype)
    x[3, :GROUP_SIZE] = 0  # an all-zero group
    want = torch.ops.nanoserve.quantize_rows(x, cpu_kernels.handle("scalar"))
    got = torch.ops.nanoserve.quantize_rows(x, cpu_kernels.handle(tier))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    codes, fine, _, sums = want
    rebuilt = fine.repeat_interleave(GROUP_SIZE, 1) * (254 * codes[0].float() + codes[1].float())
    assert (rebuilt - x.float()).abs().max() <= x.float().abs().max() / 64516 * 1.01
    assert torch.equal(sums[0], codes[0].int().view(37, -1, 16).sum(-1))  # per half group
    assert torch.equal(sums[1], codes[1].int().view(37, -1, 16).sum(-1))


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_8_bit_activation_codes_are_the_same_on_every_tier_a_step_per_16_in_sixteenths(tier, dtype):
    x = torch.randn(37, 576).to(dtype)
    x[3, :16] = 0  # an all-zero half group
    x[4, :32] = 0  # an all-zero group
    x[5, 40] = 300.0  # one large value: its half at its own step, the other half's at 1/16 of it
    want = torch.ops.nanoserve.quantize_rows(x, cpu_kernels.handle("scalar"), 8)
    got = torch.ops.nanoserve.quantize_rows(x, cpu_kernels.handle(tier), 8)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    codes, steps, sums_times_step, sums = want
    assert steps.shape == (37, 576 // 16) and torch.equal(codes[1], torch.zeros_like(codes[1]))
    assert torch.equal(steps, a8_steps(x))
    assert steps[5, 2] == 300.0 / 127 and steps[5, 3] == 300.0 / 16 / 127
    rounded = torch.round(x.float().view(37, -1, 16) * (1 / steps[..., None])).clamp(-127, 127).nan_to_num()
    assert torch.equal(codes[0].float(), rounded.view(37, -1))
    assert torch.equal(sums[0], codes[0].int().view(37, -1, 16).sum(-1)) and not sums[1].any()
    assert torch.equal(sums_times_step, sums[0].float() * steps)


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 40])
@pytest.mark.parametrize("x_bits", [16, 8])
def test_products_equal_the_scalar_reference_within_tolerance(tier, dtype, fmt, rows, x_bits):
    _, _, kind, zero_point = fmt
    n, k = 96, 512 if kind == SUPER else 576
    generator = torch.Generator().manual_seed(rows)
    codes, scales, mins = random_weight(n, k, fmt, rows, generator)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    want = torch.ops.nanoserve.group_mm(x, codes, scales, mins, zero_point, cpu_kernels.handle("scalar"), x_bits)
    got = torch.ops.nanoserve.group_mm(x, codes, scales, mins, zero_point, cpu_kernels.handle(tier), x_bits)
    assert got.dtype == dtype and got.shape == (rows, n)
    # the same integers and fp32 sums in another order: bf16's last bit, or fp32 rounding
    tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("x_bits", [16, 8])
def test_a_product_of_no_rows_is_empty(tier, x_bits):
    """A step can multiply no rows (a prefill chunk that no row's prompt ends in asks for no
    logits): every format gives [0, N] and reads no activation."""
    n, k = 96, 512
    generator = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        codes, scales, mins = random_weight(n, k, fmt, 1, generator)
        got = torch.ops.nanoserve.group_mm(torch.empty(0, k), codes, scales, mins, fmt[3], cpu_kernels.handle(tier),
                                           x_bits)
        assert got.shape == (0, n), fmt


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_products_split_over_threads_equal_one_threads_bit_for_bit(tier, rows, threads):
    """Threads split a product by its blocks of 16 outputs, each output summed by one thread in
    one order, and a thread that runs out of blocks takes some of another's: any team size (an
    uneven one, more threads than cores, more than blocks) and whichever thread ends up with a
    block give one thread's bits, each block computed once."""
    k = 512
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator)
    for n, fmt in [(208, (4, 32, FP16, 8)), (208, (4, 32, SUPER, 0)), (208, (6, 16, SUPER, 32)),
                   (16, (4, 32, FP16, 8)), (48, (4, 32, SUPER, 0)), (1024, (4, 32, FP16, 8))]:
        codes, scales, mins = random_weight(n, k, fmt, rows, generator)
        weight = (codes, scales, mins, fmt[3], cpu_kernels.handle(tier), 8)
        threads(1)
        alone = torch.ops.nanoserve.group_mm(x, *weight)
        for team in (2, 3, 8):
            threads(team)
            for _ in range(5):  # where the splits fall between threads changes run to run
                assert torch.equal(torch.ops.nanoserve.group_mm(x, *weight), alone), (n, fmt, team)


@pytest.mark.parametrize("tier", VECTOR_TIERS)
@pytest.mark.parametrize("x_bits", [16, 8])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(tier, x_bits):
    """Each row is summed in one order whatever rows share its call: a tier multiplies rows in
    blocks of up to its ROWS (8 for avx2's group-16 formats at 8 bits, 4 for its others), a step
    of up to 4 rows with each block's scales decoded as it goes (few_rows_block) and a larger one
    from scales decoded ahead, so 21 rows at once and 1 to 4 at a time take different blocks and
    must give the same bits (a request's tokens do not change with the batch it decodes in)."""
    n, k, rows = 96, 512, 21
    generator = torch.Generator().manual_seed(x_bits)
    x = torch.randn(rows, k, generator=generator)
    for fmt in FORMATS:
        weight = (*random_weight(n, k, fmt, fmt[0], generator), fmt[3], cpu_kernels.handle(tier), x_bits)
        together = torch.ops.nanoserve.group_mm(x, *weight)
        for chunk in (1, 2, 3, 4):
            apart = torch.cat([torch.ops.nanoserve.group_mm(x[i:i + chunk], *weight) for i in range(0, rows, chunk)])
            assert torch.equal(together, apart), (fmt, chunk)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantised_weight_is_scale_times_code_plus_minimum(tier, dtype, fmt):
    _, group, kind, zero_point = fmt
    n, k = 48, 256 if kind == SUPER else 96
    codes, scales, mins = random_weight(n, k, fmt, 7, torch.Generator().manual_seed(7))
    got = torch.ops.nanoserve.dequantize(codes, scales, mins, zero_point, n, k, dtype, cpu_kernels.handle(tier))
    per_output = lambda t: cpu_kernels.per_group(t).repeat_interleave(group, 1)  # noqa: E731
    unpacked = unpack_codes(codes, n, k).float()
    minimums = -zero_point * per_output(scales) if zero_point else per_output(mins)
    want = per_output(scales) * unpacked + minimums  # fp32, as the kernels compute it
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    rows = torch.tensor([[5, 0], [47, 5]])
    picked = torch.ops.nanoserve.dequantize_rows(codes, scales, mins, zero_point, rows, n, k, dtype,
                                                 cpu_kernels.handle(tier))
    assert torch.equal(picked, want.to(dtype)[rows])


def a8_steps(x: torch.Tensor) -> torch.Tensor:
    """x_bits 8's step per half group of 16 [rows, K / 16]: n / 16 of its group's max |x| / 127,
    n = ceil(16 max |x| over the half / max over the group) (common.h's half_scales), in fp32 as
    the kernels compute it."""
    halves = x.float().view(x.shape[0], -1, 2, 16).abs().amax(-1)
    group = halves.amax(-1, keepdim=True)
    n = torch.where(group > 0, torch.ceil(16 * halves / group), torch.full_like(halves, 16.0))
    return (group * n / 16 / 127).view(x.shape[0], -1)


def a8_rounding(x: torch.Tensor) -> torch.Tensor:
    """x rounded to x_bits 8's int8 codes (a8_steps), as x times the step's reciprocal."""
    step = a8_steps(x)[..., None]
    halves = x.float().view(x.shape[0], -1, 16)
    return (torch.round(halves * (1 / step)).clamp(-127, 127) * step).nan_to_num().view_as(x)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_8_bit_activations_are_the_rounding_of_x_in_sixteenths_times_the_weight(tier, fmt):
    """x_bits 8 is w x_q exactly (up to fp32 sums), minimums included: the minimum meets the same
    rounded activations, so the errors of d c and m cancel; 16 bits stays far closer to w x."""
    zero_point = fmt[3]
    n, k, rows = 48, 512, 5
    generator = torch.Generator().manual_seed(3)
    codes, scales, mins = random_weight(n, k, fmt, 3, generator)
    x = torch.randn(rows, k, generator=generator)
    handle = cpu_kernels.handle(tier)
    weight = torch.ops.nanoserve.dequantize(codes, scales, mins, zero_point, n, k, torch.float32, handle)
    exact, rounded = x @ weight.T, a8_rounding(x) @ weight.T
    a8 = torch.ops.nanoserve.group_mm(x, codes, scales, mins, zero_point, handle, 8)
    a16 = torch.ops.nanoserve.group_mm(x, codes, scales, mins, zero_point, handle, 16)
    top = exact.abs().max()
    assert (a8 - rounded).abs().max() <= 1e-4 * top
    assert (a16 - exact).abs().max() * 20 < (a8 - exact).abs().max()


@pytest.mark.parametrize("tier", TIERS)
def test_8_bit_activations_of_odd_group_counts_and_silent_groups_keep_their_sixteenths(tier):
    """Rows x groups not a multiple of a vector's four groups (a tier's vectorised sixteenths
    leave a tail), a group of zeros (no step: n 16) and a half far below its group's other half:
    still w x_q."""
    fmt = (4, 32, FP16, 8)
    n, k, rows = 32, 96, 3
    generator = torch.Generator().manual_seed(5)
    codes, scales, mins = random_weight(n, k, fmt, 3, generator)
    x = torch.randn(rows, k, generator=generator)
    x[1, 32:64] = 0.0
    x[2, 64:80] *= 1e-3
    handle = cpu_kernels.handle(tier)
    weight = torch.ops.nanoserve.dequantize(codes, scales, mins, fmt[3], n, k, torch.float32, handle)
    rounded = a8_rounding(x) @ weight.T
    a8 = torch.ops.nanoserve.group_mm(x, codes, scales, mins, fmt[3], handle, 8)
    assert (a8 - rounded).abs().max() <= 1e-4 * (x @ weight.T).abs().max()


def test_activation_bits_other_than_8_or_16_are_refused():
    codes = random_codes(16, 32, 4, seed=0)
    scales = random_scales(16, 32, 32, FP16, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="x_bits must be 8 or 16, got 12"):
        torch.ops.nanoserve.group_mm(torch.randn(1, 32), codes, scales, scales[:, :0], 8,
                                     cpu_kernels.handle(TIERS[0]), 12)


@pytest.mark.parametrize("tier", TIERS)
def test_the_dot_peak_counts_its_multiply_adds_and_has_a_rate(tier):
    handle = cpu_kernels.handle(tier)
    once = torch.ops.nanoserve.dot_peak(5, handle)
    assert once > 0 and torch.ops.nanoserve.dot_peak(10, handle) == 2 * once
    assert cpu_kernels.dot_peak_rate(tier, seconds=0.03) > 1e8  # any tier does 0.1 G multiply-adds a second
    with pytest.raises(ValueError, match="does not run here"):
        cpu_kernels.dot_peak_rate("torch")


def test_packed_weights_of_no_known_format_are_refused():
    handle = cpu_kernels.handle("scalar")
    codes = random_codes(32, 64, 4, seed=0)
    x = torch.randn(2, 64)
    scales = torch.zeros(2, 2, 16, dtype=torch.int16)
    torch.ops.nanoserve.group_mm(x, codes, scales, scales, 0, handle)  # the shapes that fit
    torch.ops.nanoserve.group_mm(x, codes, scales, scales[:, :0], 8, handle)
    with pytest.raises(RuntimeError, match="scales must be"):  # a group of 64
        torch.ops.nanoserve.group_mm(x, codes, scales[:, :1], scales[:, :1], 0, handle)
    with pytest.raises(RuntimeError, match="scales must be"):  # fp64 bits
        torch.ops.nanoserve.group_mm(x, codes, scales.long(), scales.long(), 0, handle)
    with pytest.raises(RuntimeError, match="mins must match"):
        torch.ops.nanoserve.group_mm(x, codes, scales, scales.int()[:, :, :16], 0, handle)
    with pytest.raises(RuntimeError, match="stores no minimums"):
        torch.ops.nanoserve.group_mm(x, codes, scales, scales, 8, handle)
    with pytest.raises(RuntimeError, match="zero point must lie"):
        torch.ops.nanoserve.group_mm(x, codes, scales, scales[:, :0], 300, handle)
    with pytest.raises(RuntimeError, match="codes must be"):  # 3 bits a weight
        torch.ops.nanoserve.group_mm(x, torch.zeros(32 * 64 * 3 // 8, dtype=torch.uint8), scales, scales, 0, handle)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 16)])
@pytest.mark.parametrize("width", [1, 13, 300])
def test_decode_attention_equals_the_reference_read(tier, dtype, num_heads, num_kv_heads, head_dim, width):
    torch.manual_seed(width)
    n, slots = 4, 700
    k_cache = torch.randn(slots, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(n, num_heads, head_dim).to(dtype)
    table = torch.randint(1, slots, (n + 1, width + 7))  # slot 0 is nobody's
    lengths = torch.tensor([width, 1, max(1, width // 2), max(1, width - 3)])
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table[:n, :width], lengths)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for mapping in (table[:n, :width], table[:n, :width].clone()):  # a window view and a copy
        got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, mapping, lengths, head_dim ** -0.5,
                                                   cpu_kernels.handle(tier))
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    # Past each row's length the cells are never read: pointing them at a NaN slot changes nothing.
    for row, length in enumerate(lengths.tolist()):
        table[row, length:] = 0
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table[:n, :width], lengths, head_dim ** -0.5,
                                               cpu_kernels.handle(tier))
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("queries", [2, 5])
def test_decode_attention_of_a_verify_row_is_each_query_alone_bit_for_bit(tier, dtype, queries):
    """A verify step's queries share their row's slots ([rows, W] for rows * queries queries),
    each with its own length (padding queries: 0): the same bits as one query a row."""
    torch.manual_seed(queries)
    rows, slots, width, head_dim = 3, 400, 60, 32
    k_cache = torch.randn(slots, 2, head_dim).to(dtype)
    v_cache = torch.randn(slots, 2, head_dim).to(dtype)
    q = torch.randn(rows * queries, 6, head_dim).to(dtype)
    table = torch.randint(1, slots, (rows, width))
    starts = [50, 1, 20]
    lengths = torch.tensor([start + j + 1 if j < queries - r else 0
                            for r, start in enumerate(starts) for j in range(queries)])
    handle = cpu_kernels.handle(tier)
    got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5, handle)
    alone = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table.repeat_interleave(queries, 0), lengths,
                                                 head_dim ** -0.5, handle)
    real = lengths > 0
    assert torch.equal(got[real], alone[real])
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(),
                                     table.repeat_interleave(queries, 0), lengths)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[real].double(), want[real], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [1, 5, 16, 400])
def test_decode_attention_with_a_window_reads_only_each_rows_last_cells(tier, dtype, window):
    """A sliding-window layer's read: the reference's windowed read, and the cells before the
    window are never touched (NaN there changes nothing)."""
    torch.manual_seed(window)
    n, slots, width, head_dim = 4, 300, 40, 32
    k_cache = torch.randn(slots, 2, head_dim).to(dtype)
    v_cache = torch.randn(slots, 2, head_dim).to(dtype)
    q = torch.randn(n, 6, head_dim).to(dtype)
    table = torch.randint(1, slots, (n, width))
    lengths = torch.tensor([40, 1, 17, 6])
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lengths, window=window)
    for row, length in enumerate(lengths.tolist()):
        table[row, :max(length - window, 0)] = 0
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5,
                                               cpu_kernels.handle(tier), window)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_kv_heads", [1, 3, 2, 8])
@pytest.mark.parametrize("threads", [2, 3])
def test_decode_attention_of_long_rows_read_in_parts_equals_the_reference(tier, dtype, num_kv_heads, threads):
    """Rows of 512 cells or more are read in parts by several threads, every K/V head of a part at
    once, and merged (with gpt-oss's sinks, and a sliding window); shorter rows whole, their K/V
    heads split over the threads: the reference read within the usual tolerance, and a row's bits
    those it has alone."""
    torch.manual_seed(num_kv_heads)
    heads, head_dim, slots = 2 * num_kv_heads, 64, 16000
    k_cache = torch.randn(slots, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(6, heads, head_dim).to(dtype)
    table = torch.randperm(slots)[:6 * 2600].view(6, 2600)
    # parts of at most 1024 cells (4 on 2 threads), a part a thread, two parts on 3 threads (none
    # under 256 cells), one part, a few cells
    lengths = torch.tensor([2600, 1025, 1024, 600, 511, 3])
    sinks = torch.randn(heads) * 4
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    handle = cpu_kernels.handle(tier)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window, sink in ((0, None), (0, sinks), (1500, None)):
            want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lengths,
                                              window=window or None, sinks=sink)
            got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5,
                                                       handle, window, sink)
            torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
            for row in range(6):
                alone = torch.ops.nanoserve.decode_attention(q[row:row + 1], k_cache, v_cache, table[row:row + 1],
                                                             lengths[row:row + 1], head_dim ** -0.5, handle, window,
                                                             sink)
                assert torch.equal(alone, got[row:row + 1])
    finally:
        torch.set_num_threads(before)


def test_decode_attention_honours_the_scale_and_refuses_bad_shapes():
    handle = cpu_kernels.handle(TIERS[0])
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(50, 2, 16).bfloat16(), torch.randn(50, 2, 16).bfloat16()
    q, mapping, lengths = torch.randn(2, 4, 16).bfloat16(), torch.randint(0, 50, (2, 9)), torch.tensor([9, 4])
    want = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), mapping, lengths, scale=0.3)
    got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, mapping, lengths, 0.3, handle)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="head sizes"):
        torch.ops.nanoserve.decode_attention(torch.randn(2, 3, 16).bfloat16(), k_cache, v_cache, mapping, lengths, 0.3,
                                             handle)
    with pytest.raises(RuntimeError, match="q's dtype"):
        torch.ops.nanoserve.decode_attention(q.float(), k_cache, v_cache, mapping, lengths, 0.3, handle)
    with pytest.raises(RuntimeError, match="no kernel tier"):
        torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, mapping, lengths, 0.3, 10_000)


def test_the_switch_forces_a_tier_the_host_has_and_refuses_the_rest(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    best = cpu_kernels.resolve_tier()
    assert best == next((t for t in cpu_kernels.PREFERENCE if t in TIERS), "torch")
    for tier in cpu_kernels.host_tiers():
        monkeypatch.setenv(cpu_kernels.ENV, tier)
        assert cpu_kernels.resolve_tier() == tier == cpu_kernels.resolve_tier("auto")
    # The other architecture's tiers (and on x86 every tier above the host's) are refused by name.
    lacking = [t for t in cpu_kernels.TIERS if t not in cpu_kernels.host_tiers()]
    assert lacking  # no host runs both the x86 and the ARM tiers
    for tier in lacking:
        monkeypatch.setenv(cpu_kernels.ENV, tier)
        with pytest.raises(ValueError, match=f"kernel tier '{tier}' needs"):
            cpu_kernels.resolve_tier()
    monkeypatch.setenv(cpu_kernels.ENV, "avx9000")
    with pytest.raises(ValueError, match="choose one of"):
        cpu_kernels.resolve_tier()


def test_compute_dtype_follows_the_cpu():
    features = cpu_kernels.host_features()
    for tier in VECTOR_TIERS:
        native = {"avx512-vnni": {"avx512bf16", "amx-bf16"}, "neon-dot": {"bf16"}}.get(tier, set())
        assert cpu_kernels.compute_dtype(tier) == (torch.bfloat16 if native & features else torch.float32)
    assert cpu_kernels.compute_dtype("scalar") == torch.float32


def test_the_reference_tier_always_builds_where_there_is_a_compiler():
    assert "scalar" in TIERS
    assert torch.ops.nanoserve.tier_name(cpu_kernels.handle("scalar")) == "scalar"


def test_a_tier_library_is_keyed_by_its_sources_contents_wherever_they_lie(tmp_path):
    """scripts/kernel_ab.py builds another revision's kernels from a copy of them: the same
    sources in another folder are the same library, and a changed source is another."""
    scalar = cpu_kernels.TIERS["scalar"]
    copy = tmp_path / "kernels"
    shutil.copytree(cpu_kernels.KERNELS, copy)
    assert cpu_kernels._build(scalar, copy) == cpu_kernels._build(scalar)
    (copy / scalar.source).write_text((copy / scalar.source).read_text() + "\n// another revision\n")
    changed = cpu_kernels._build(scalar, copy)
    assert changed != cpu_kernels._build(scalar) and changed.exists()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_with_sinks_equals_the_reference_read(tier, dtype, window):
    """gpt-oss's attention sinks (one logit per query head in each softmax, no value): the
    reference's read with them, windowed or not, and sinks far below every score change nothing."""
    torch.manual_seed(3)
    n, slots, width, head_dim = 4, 300, 40, 32
    k_cache = torch.randn(slots, 2, head_dim).to(dtype)
    v_cache = torch.randn(slots, 2, head_dim).to(dtype)
    q = (2 * torch.randn(n, 6, head_dim)).to(dtype)
    table = torch.randint(1, slots, (n, width))
    lengths = torch.tensor([40, 1, 17, 6])
    sinks = 3 * torch.randn(6)
    handle = cpu_kernels.handle(tier)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lengths, window=window,
                                     sinks=sinks.double())
    got = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5, handle,
                                               window or 0, sinks.to(dtype))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    plain = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5, handle,
                                                 window or 0)
    drowned = torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, table, lengths, head_dim ** -0.5, handle,
                                                   window or 0, torch.full((6,), -1e4))
    torch.testing.assert_close(drowned, plain, rtol=0, atol=0)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_ab_times_a_models_decode_attention_step_at_each_context_and_row_count():
    """scripts/kernel_ab.py --contexts: one step's reads of the model's shape, an arm against itself
    here (the same bits), a line per context and row count."""
    kernel_ab = _script("kernel_ab")
    config = types.SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    handle = cpu_kernels.handle("scalar")
    rows = kernel_ab.attention_rows(config, torch.bfloat16, {"base": handle, "new": handle}, [1, 3], [20, 40],
                                    rounds=2, host={"cpu": "any"})
    assert [(r["rows"], r["what"].split(" (")[0]) for r in rows] == [
        (1, "attention, context 20"), (3, "attention, context 20"), (1, "attention, context 40"),
        (3, "attention, context 40")]
    assert all(r["same_bits"] == "yes" and r["new_over_base"] > 0 and r["cpu"] == "any" for r in rows)


def test_kernel_ab_set_gives_one_kernel_constant_a_value_in_a_copy(tmp_path):
    """scripts/kernel_ab.py --set NAME=VALUE: the new arm's sources differ from the tree's in that
    constant's definition alone; a name no constexpr defines is refused, not silently ignored."""
    kernel_ab = _script("kernel_ab")
    copy = kernel_ab.with_constants(cpu_kernels.KERNELS, ["PREFETCH_L2_BYTES=24576"], tmp_path / "new")
    before = (cpu_kernels.KERNELS / "vector.cpp").read_text().splitlines()
    after = (copy / "vector.cpp").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and changed == [
        (line, "constexpr int64_t PREFETCH_L2_BYTES = 24576;") for line in before
        if line.startswith("constexpr int64_t PREFETCH_L2_BYTES =")]
    with pytest.raises(SystemExit, match="NO_SUCH_CONSTANT"):
        kernel_ab.with_constants(cpu_kernels.KERNELS, ["NO_SUCH_CONSTANT=1"], tmp_path / "other")


def test_step_products_times_each_weight_inside_whole_passes():
    """scripts/step_products.py --in-pass: a line per distinct weight (shape and bytes) with its
    calls a pass, and a pass line whose calls are all of them; shares of a pass below one."""
    from nanoserve.model.quant.group_codes import GroupCodes
    from nanoserve.model.quant.linear import GroupLinear

    step_products = _script("step_products")
    torch.manual_seed(0)

    def linear(n: int, k: int) -> GroupLinear:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales, mins = torch.rand(n, k // 32) + 0.1, torch.rand(n, k // 32)
        return GroupLinear(GroupCodes(codes, scales, mins, 4), None, torch.float32, kernel="scalar")

    linears = [linear(32, 64), linear(16, 64), linear(32, 64)]
    rows = step_products.calls_in_pass(linears, torch.float32, [1, 2], 16, passes=2)
    assert [(r["rows"], r["shape"], r["calls"]) for r in rows] == [
        (1, "64 x 32", 2), (1, "64 x 16", 1), (1, "pass", 3), (2, "64 x 32", 2), (2, "64 x 16", 1), (2, "pass", 3)]
    assert all(r["us_per_call"] > 0 and r["over_floor"] > 0 and 0 < r["share_of_pass"] <= 1 for r in rows)
