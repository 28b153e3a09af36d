"""Packed linear layers: the model's weights executed as group-wise codes, int8 channels or bf16.

A group-wise weight (``GroupCodes``) is ``w = scales * codes + mins`` per group of 32 (or 16)
weights along K, unsigned codes of 4, 5, 6 or 8 bits. Every GGUF block type that runs packed is
that form without rounding anything (``gguf_blocks``): Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``,
Q5_0, Q5_1, Q8_0 (``d * c`` as ``d * (c + 128) - 128 d``), and the K-quants, whose super-block
scales give each group of 32 (Q4_K, Q5_K) or 16 (Q6_K) an exact fp32 scale and minimum. The
table types packed from their blocks keep the file's nibbles as 4-bit codes with a code table
(``w = scale * table[c]``, the table held in the mins' place: ``cpu_kernels.is_code_table``):
IQ4_NL with fp16 d, IQ4_XS with its super-block records, MXFP4 with its exponent bytes (2^(e -
128)), 4.5, 4.31 and 4.25 bits a weight against the file's 4.5, 4.25 and 4.25; unpacked
(``GroupCodes``, torch's kernel) they are widened codes ``table[q] + 128`` and ``e2m1[q] + 16``.
Q3_K is held as 4-bit codes ``q + 4 h`` at group 16 with zero point 4, Q2_K as 4-bit codes at
group 16 with its scales and minimums as records (4.56 and 5.13 bits against the file's 3.44 and
2.63; ``gguf_blocks``' docstring). A float weight is rounded here to int4 groups
(``quantize_int4``) or, for an LM head, int8 groups.

nanoserve's kernels (``cpu_kernels``) run every such format where a tier of them runs on the host:
4-bit codes two a byte, 5- and 6-bit codes as a nibble and a bit plane or 2-bit crumbs, 8-bit codes a byte each;
scales and minimums in fp16 where they all are fp16 numbers, a K-quant's as its fp16
super-block scales times int8 multipliers (``SuperScales``), fp32 otherwise; no minimums in a
symmetric format (a zero point instead): every GGUF type in its file's own size. Each activation
as two int8 codes; each block of weights read once for all rows. With them the activations are bf16 where the CPU computes bf16 natively and
fp32 elsewhere (``cpu_kernels.compute_dtype``).

``kernel="torch"`` runs group-32 formats through torch's CPU int4 kernel instead:
``_weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes ``x @ w.T`` with
``w[n, k] = (q[n, k] - 8) * scale[k // 32, n] + zero[k // 32, n]``, q in 0..15, scales and zeros
in the activations' dtype (it needs N % 16 == 0 and K % 32 == 0). Codes wider than 4 bits split
into two nibbles, ``c = 16 * hi + lo``: ``[hi | lo]`` as one [N, 2K] int4 weight (scales 16s and
s) times ``[x | x]`` is ``x @ w.T``. torch has no group-16 format: such a layer stays dense there.
The per-channel int8 format is torch's ``_weight_int8pack_mm(x, w_int8 [N, K], scales [N])``
(with bf16 activations it needs K % 16 == 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.network.experts import activation_bits
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.cpu_kernels import GROUP_SIZE
from nanoserve.model.quant.gguf_blocks import StackedBlocks
from nanoserve.model.quant.group_codes import GroupCodes, as_torch_int4, int8_groups

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
# Who runs the group-wise products: a kernel tier of cpu_kernels, "torch" (its int4 kernel), or
# "auto" (cpu_kernels.resolve_tier: $NANOSERVE_CPU_KERNELS, else the host's best tier).
GROUP_KERNELS = cpu_kernels.CHOICES
# From how many rows a bf16 copy of the linears is at least as fast as the group-wise kernels,
# per tier (where the CPU computes bf16 natively; build.auto_cpu_plan keeps none in fp32), on the
# default model's linears with two threads and the weights streamed from memory
# (``python -m compile.linear_bench``; the README quotes the CSVs). None: no dense copy, where
# one would not pay for its memory at a decode batch or the tier was not measured; such tiers
# multiply prompts through the dequantised weight (DEQUANT_FROM_ROWS).
DENSE_FROM_ROWS: dict[str, int | None] = {"avx512-vnni": 24, "avx-vnni": None, "avx2": None, "neon-dot": None,
                                          "neon": None, "scalar": None, "torch": 10}
# From how many rows a group-wise layer without a dense copy dequantises its weight into the
# compute dtype and multiplies it in a dense GEMM: at a prompt's hundreds of rows the GEMM's
# arithmetic rate wins over the integer kernels, and the dequantisation (one pass over the
# weight) is shared by every row. Same bench as above, with 16-bit activations; where the tier
# computes in fp32 and the activations are 8-bit at these rows, never (dequant_from_rows).
DEQUANT_FROM_ROWS: dict[str, int] = {"avx512-vnni": 64, "avx-vnni": 64, "avx2": 64, "neon-dot": 64, "neon": 64,
                                     "scalar": 16}
# From how many rows auto's products round activations to 8 bits (kernels/common.h: a step per
# 16 values) rather than 16, per tier: where a step's arithmetic, not its read of the weights,
# sets its time, 8 bits multiply each weight code once instead of twice (a 1B pass of Q4_0
# products at 32 rows: 212 -> 133 ms on Zen 4's avx512-vnni); fewer rows keep 16 bits, faithful
# well beyond llama.cpp, where the step is bound by the read. 8-bit logits stay at least as close
# to fp32 as llama.cpp's (`compilebench.py fidelity --chunk-rows 16`, the README's table). On
# avx2 (no VNNI) 16-bit products are arithmetic-bound from 2 rows: the same pass at 2 rows takes
# 42.1 ms with 16 bits, 25.5 with 8 (8 rows: 225 against 86), and even at one row 8 bits is
# faster (21.7 -> 18.7 ms, near the read floor) and, with the rest of the forward in fp32, as
# faithful as at a batch's rows (`--tier avx2 --chunk-rows 1`): so avx2 takes 8 bits at every
# row count, and a row's logits there do not depend on its batch. avx-vnni (256-bit vpdpbusd, fp32
# around it) likewise: on Sapphire Rapids with the tier forced, the 1B Q4_0 pass takes 37.7 ms at
# one row with 16 bits and 31.8 with 8, 64.3 against 38.6 at 4 rows, 130 against 77 at 8
# (`scripts/step_products.py --rows 1,2,4,8,16`). The NEON tiers were not measured and take
# avx512-vnni's. None: 16 bits at every row count (torch's kernel has no other; the scalar tier is
# a reference).
A8_FROM_ROWS: dict[str, int | None] = {"avx512-vnni": 16, "avx-vnni": 1, "avx2": 1, "neon-dot": 16, "neon": 16,
                                       "scalar": None, "torch": None}


def dequant_from_rows(tier: str, a8_from_rows: int | None) -> int | None:
    """From how many rows a group-wise layer on ``tier`` that holds no dense copy multiplies
    through its dequantised weight (None: never). Never where the tier computes in fp32 (no
    native bf16: AVX2, NEON, AVX-512 without BF16) and the activations are 8-bit by then
    (``a8_from_rows``): there the kernel at 8 bits beats dequantise-and-fp32-GEMM at every
    prompt size measured (64-512 rows of the default model's gate/up and down, 1.3-4.8x on
    avx2: `python compilebench.py linear --tier avx2 --rows 64 128 512`, ``int4_vs_int4_a8``)
    and, with fp32 around it, keeps a prompt's logits well within the fidelity gate. A bf16
    tier keeps the bf16 GEMM for prompts: 8-bit activations on top of bf16 rounding sit at
    llama.cpp's top-1 with no margin (the README's fidelity table)."""
    rows = DEQUANT_FROM_ROWS[tier]
    fp32 = cpu_kernels.compute_dtype(tier) == torch.float32
    return None if fp32 and a8_from_rows is not None and a8_from_rows <= rows else rows


# The group-wise LM head reads a byte per weight (Q8_0) against the body's half, so its dense
# copy takes over sooner where the body has one.
HEAD_DENSE_FROM_ROWS = 16
def int4_kernel_accepts(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % GROUP_SIZE == 0


def int8_kernel_accepts(in_features: int) -> bool:
    """torch's per-channel int8 kernel reads bf16 activations 16 at a time with aligned loads and
    no tail: with any other K it reads past each row (garbage, or a segfault)."""
    return in_features % 16 == 0


def resolve_group_kernel(kernel: str, dtype: torch.dtype) -> str:
    """The kernel tier (cpu_kernels) or "torch" that runs a group-wise layer with activations in
    ``dtype``. torch's int4 kernel runs a scalar reference loop with fp32 activations, so
    "auto" never picks it for them; asking for it is allowed (a test of its layout does)."""
    if kernel not in GROUP_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(GROUP_KERNELS)}, got {kernel!r}")
    tier = cpu_kernels.resolve_tier(kernel)
    if tier == "torch" and kernel == "auto" and dtype == torch.float32 and cpu_kernels.host_can_run("scalar"):
        return "scalar"
    return tier


class _PackedLinear(nn.Module):
    """A weight-only packed linear: ``x @ w.T (+ bias)`` through ``_packed_mm``; from
    ``dense_from_rows`` rows on (a static shape under compile, so the choice is made at trace
    time) through a dense GEMM over ``_dense_weight``: the held dense copy (in the compute dtype)."""

    def __init__(self, bias: torch.Tensor | None, dense: torch.Tensor | None, dense_from_rows: int | None) -> None:
        super().__init__()
        self.register_buffer("bias", bias)
        self.register_buffer("dense", dense)
        self.dense_from_rows = dense_from_rows

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_from_rows is not None and x.shape[0] >= self.dense_from_rows:
            return F.linear(x, self._dense_weight(x.dtype), self.bias)
        out = self._packed_mm(x)
        return out if self.bias is None else out + self.bias


class GroupLinear(_PackedLinear):
    """A group-wise weight (``GroupCodes``) run by ``kernel`` (resolve_group_kernel): nanoserve's
    tiers hold ``codes``, ``scales`` and ``mins`` (cpu_kernels' layout) and call the tier by its
    handle; torch's int4 kernel (group 32 only) holds ``packed`` and ``scales_and_zeros``.
    ``a8_from_rows``: from how many rows of input our tiers' products round the activations to 8
    bits instead of 16 (None: never; kernels/common.h)."""

    def __init__(self, weight: GroupCodes | StackedBlocks, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: torch.Tensor | None = None, dense_from_rows: int | None = None, kernel: str = "auto",
                 a8_from_rows: int | None = None) -> None:
        super().__init__(bias, dense, dense_from_rows)
        self.a8_from_rows = a8_from_rows
        self.kernel = resolve_group_kernel(kernel, dtype)
        self.handle = cpu_kernels.handle(self.kernel)
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        if self.handle is not None:
            if isinstance(weight, StackedBlocks):  # a GGUF's blocks, packed from the file's bytes
                *packed, self.zero_point = weight.pack()
            else:
                *packed, self.zero_point = cpu_kernels.pack_groups(weight.codes, weight.scales, weight.mins,
                                                                   weight.bits, weight.scale_factors,
                                                                   weight.min_factors)
            for name, tensor in zip(("codes", "scales", "mins"), packed):
                self.register_buffer(name, tensor)
            if dense is None:  # no copy held: the weight is dequantised for a call of many rows
                self.dense_from_rows = dequant_from_rows(self.kernel, a8_from_rows)
            return
        if weight.group != GROUP_SIZE:
            raise ValueError(f"torch's int4 kernel runs groups of {GROUP_SIZE} only, not {weight.group}")
        if isinstance(weight, StackedBlocks):
            weight = weight.group_codes()
        q, scales, zeros = as_torch_int4(weight)
        self.doubled_input = q.shape[1] != self.in_features  # [hi | lo] codes read [x | x]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        sz = torch.stack([scales.t(), zeros.t()], dim=-1)  # [K' / 32, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(dtype).contiguous())

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        return torch.ops.nanoserve.dequantize(self.codes, self.scales, self.mins, self.zero_point, self.out_features,
                                              self.in_features, dtype, self.handle)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.handle is not None:
            return torch.ops.nanoserve.group_mm(x, self.codes, self.scales, self.mins, self.zero_point, self.handle,
                                                activation_bits(x.shape[0], self.a8_from_rows))
        x = torch.cat([x, x], dim=-1) if self.doubled_input else x
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as an embedding table (our kernels' codes only)."""
        return torch.ops.nanoserve.dequantize_rows(self.codes, self.scales, self.mins, self.zero_point, token_ids,
                                                   self.out_features, self.in_features, self.compute_dtype, self.handle)


class ConcatLinear(nn.Module):
    """Linears over the same input whose outputs stack along the last dimension: a fused
    projection whose parts a file holds in different formats (a Q4_K_M file's Q6_K v beside Q4_K
    q and k), each part run in its own format rather than all in the widest."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class Int8GroupLinear(GroupLinear):
    """A group-32 int8 weight from ``quantize_int8_groups``' codes and scales."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: torch.Tensor | None = None, dense_from_rows: int | None = None, kernel: str = "auto") -> None:
        super().__init__(int8_groups(codes, scales), bias, dtype, dense, dense_from_rows, kernel)


class GroupEmbedding(nn.Module):
    """The token embedding read from a tied group-wise LM head's codes: no float copy of the
    table (a quantised embedding is the file's own blocks either way)."""

    def __init__(self, table: GroupLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embed(token_ids)


class Int8Linear(_PackedLinear):
    """The int8 per-channel kernel. ``embed`` reads the same codes as an embedding table, so a
    tied LM head and the token embedding share one int8 matrix."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, dense: torch.Tensor | None = None, dense_from_rows: int | None = None) -> None:
        super().__init__(bias, dense, dense_from_rows)
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.to(dtype))

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.codes[token_ids].to(self.scales.dtype) * self.scales[token_ids, None]


class Int8Embedding(nn.Module):
    """The token embedding read from an Int8Linear's codes (no float copy of the table)."""

    def __init__(self, table: Int8Linear) -> None:
        super().__init__()
        self.table = table

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embed(token_ids)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of every distinct parameter and persistent buffer the module holds (a tensor shared
    by two modules, such as a tied LM head and embedding, counts once)."""
    tensors = [*module.parameters(), *module.buffers()]
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    sizes = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if id(t) in persistent}
    return sum(sizes.values())
