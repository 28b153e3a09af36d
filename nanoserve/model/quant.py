"""Packed linear layers: the model's weights executed as int4 groups, int8 channels or bf16.

torch's CPU weight-only kernels define the formats:

- int4: ``_weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes
  ``x @ w.T`` with ``w[n, k] = (q[n, k] - 8) * scale[k // 32, n] + zero[k // 32, n]``, q in 0..15,
  ``scales_and_zeros`` [K / 32, N, 2] in the activations' dtype. It needs N % 16 == 0 and
  K % 32 == 0; with fp32 activations it runs a reference loop ~25x slower than with bf16.
- int8: ``_weight_int8pack_mm(x, w_int8 [N, K], scales [N])``, scales in the activations' dtype.
  With bf16 activations it needs K % 16 == 0.

GGUF's Q4_0 (``w = d * (q - 8)``) and Q4_1 (``w = d * q + m = d * (q - 8) + (m + 8d)``) blocks are
that int4 format with group size 32, so they are repacked without requantising; any other weight
is rounded to nearest into it. A layer whose shape the kernel does not accept stays bf16.

A group-32 int8 weight (GGUF's Q8_0: ``w = d * c``, c in -127..127) runs through the same int4
kernel: ``c + 128 = 16 * hi + lo`` splits each code into two nibbles, and
``w = (hi - 8) * 16d + (lo - 8) * d + 8d``, so ``[hi | lo]`` as one [N, 2K] int4 weight times
``[x | x]`` is ``x @ w.T``, summed in one fp32 accumulator and rounded once.

Both group formats run instead through nanoserve's own kernels where a tier of them runs on the
host (``cpu_kernels``: the same codes, each group's scale and minimum in fp16, each activation as
two int8 codes), which read each block of weights once for all rows; ``kernel="torch"`` keeps
torch's. With them the activations are bf16 where the CPU computes bf16 natively and fp32
elsewhere (``cpu_kernels.compute_dtype``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model import cpu_kernels
from nanoserve.model.cpu_kernels import GROUP_SIZE

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
# Who runs the group-wise products: a kernel tier of cpu_kernels, "torch" (its int4 kernel), or
# "auto" (cpu_kernels.resolve_tier: $NANOSERVE_CPU_KERNELS, else the host's best tier).
GROUP_KERNELS = cpu_kernels.CHOICES
# From how many rows a bf16 copy of the linears is at least as fast as the group-wise kernels,
# per tier (where the CPU computes bf16 natively; build.auto_cpu_plan keeps none in fp32), on the default model's linears with two threads and the
# weights streamed from memory (``python -m compile.linear_bench``; the README quotes the CSVs).
# None: no dense copy, where one would not pay for its memory at a decode batch (on avx2 an fp32
# copy, 4x the int4 bytes, first wins at about 48 rows) or the tier was not measured; such
# tiers multiply prompts through the dequantised weight (DEQUANT_FROM_ROWS).
DENSE_FROM_ROWS: dict[str, int | None] = {"avx512-vnni": 24, "avx-vnni": None, "avx2": None, "neon-dot": None,
                                          "neon": None, "scalar": None, "torch": 10}
# From how many rows a group-wise layer without a dense copy dequantises its weight into the
# compute dtype and multiplies it in a dense GEMM: at a prompt's hundreds of rows the GEMM's
# arithmetic rate wins over the integer kernels, and the dequantisation (one pass over the
# weight) is shared by every row. Same bench as above.
DEQUANT_FROM_ROWS: dict[str, int] = {"avx512-vnni": 64, "avx-vnni": 64, "avx2": 64, "neon-dot": 64, "neon": 64,
                                     "scalar": 16}
# The group-wise int8 LM head (49152 x 576) reads a byte per weight against the body's half, so
# its dense copy takes over sooner where the body has one.
HEAD_DENSE_FROM_ROWS = 16


@dataclass
class GroupwiseInt4:
    """A weight [N, K] as 4-bit codes in groups of 32 along K: ``w = (q - 8) * scales + zeros``.

    ``q`` [N, K] uint8 in 0..15; ``scales`` and ``zeros`` [N, K / 32] fp32.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        groups = self.q.shape[1] // GROUP_SIZE
        codes = self.q.float().view(self.q.shape[0], groups, GROUP_SIZE) - 8
        return (codes * self.scales[..., None] + self.zeros[..., None]).view(self.q.shape)

    @staticmethod
    def cat(parts: list[GroupwiseInt4]) -> GroupwiseInt4:
        """Stack weights along N (q, k and v into one fused projection)."""
        return GroupwiseInt4(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scales", "zeros")))


def quantize_int4(weight: torch.Tensor) -> GroupwiseInt4:
    """Round-to-nearest asymmetric int4 per group of 32 (min and max of each group kept exactly)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return GroupwiseInt4(q.to(torch.uint8).view(n, k), scales, low + 8 * scales)


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of 32 along K, Q8_0's rule: (codes [N, K] int8, scales [N, K / 32]
    fp32), ``w = codes * scale``, scale = max |w| / 127. A weight dequantised from Q8_0 blocks
    (fp16 d times an int8 code whose group reaches +-127, as llama.cpp writes them) gets its
    blocks back exactly: max |w| / 127 is d, and every w / d is its code."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = (groups.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.view(n, k), scales


def int8_groups_as_nibbles(codes: torch.Tensor, scales: torch.Tensor) -> GroupwiseInt4:
    """A group-32 int8 weight [N, K] as the int4 weight [N, 2K] ``[hi | lo]`` (module docstring):
    hi has scale 16d and zero 0, lo scale d and zero 8d, so hi's and lo's products sum to ``x @ w.T``."""
    unsigned = codes.to(torch.int16) + 128
    q = torch.cat([unsigned >> 4, unsigned & 15], dim=1).to(torch.uint8)
    return GroupwiseInt4(q, torch.cat([16 * scales, scales], dim=1),
                         torch.cat([torch.zeros_like(scales), 8 * scales], dim=1))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (codes [N, K] int8, scales [N] fp32), w = codes * scale."""
    w = weight.float()
    scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def int4_kernel_accepts(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % GROUP_SIZE == 0


def int8_kernel_accepts(in_features: int) -> bool:
    """torch's per-channel int8 kernel reads bf16 activations 16 at a time with aligned loads and
    no tail: with any other K it reads past each row (garbage, or a segfault)."""
    return in_features % 16 == 0


def resolve_group_kernel(kernel: str, dtype: torch.dtype) -> str:
    """The kernel tier (cpu_kernels) or "torch" that runs a group-wise layer with activations in
    ``dtype``. torch's int4 kernel runs a reference loop ~25x slower with fp32 activations, so
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


class _GroupLinear(_PackedLinear):
    """A group-32 weight run by ``kernel`` (resolve_group_kernel): nanoserve's tiers hold
    ``codes``, ``scales`` and ``mins`` (cpu_kernels' layout) and call the tier by its handle,
    torch's int4 kernel holds ``packed`` and ``scales_and_zeros``."""

    def __init__(self, bias: torch.Tensor | None, dtype: torch.dtype, dense: torch.Tensor | None,
                 dense_from_rows: int | None, kernel: str) -> None:
        super().__init__(bias, dense, dense_from_rows)
        self.kernel = resolve_group_kernel(kernel, dtype)
        self.handle = cpu_kernels.handle(self.kernel)
        if dense is None and self.handle is not None:
            # No copy held: from DEQUANT_FROM_ROWS rows the weight is dequantised for the call.
            self.dense_from_rows = DEQUANT_FROM_ROWS[self.kernel]

    NIBBLES = True  # the codes' width in cpu_kernels' layout

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        return torch.ops.nanoserve.dequantize(self.codes, self.scales, self.mins, self.out_features, self.in_features,
                                              self.NIBBLES, dtype, self.handle)

    def _hold_codes(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        for name, tensor in (("codes", codes), ("scales", scales), ("mins", mins)):
            self.register_buffer(name, tensor)

    def _hold_torch_int4(self, weight: GroupwiseInt4, dtype: torch.dtype) -> None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        sz = torch.stack([weight.scales.t(), weight.zeros.t()], dim=-1)  # [K / 32, N, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz.to(dtype).contiguous())

    def _torch_int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)


class Int4Linear(_GroupLinear):
    """An int4 group-32 weight."""

    def __init__(self, weight: GroupwiseInt4, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: torch.Tensor | None = None, dense_from_rows: int | None = None, kernel: str = "auto") -> None:
        super().__init__(bias, dtype, dense, dense_from_rows, kernel)
        self.out_features, self.in_features = weight.q.shape
        if self.handle is not None:
            self._hold_codes(*cpu_kernels.pack_int4(weight.q, weight.scales, weight.zeros))
        else:
            self._hold_torch_int4(weight, dtype)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.handle is not None:
            return torch.ops.nanoserve.int4_mm(x, self.codes, self.scales, self.mins, self.handle)
        return self._torch_int4_mm(x)


class Int8GroupLinear(_GroupLinear):
    """A group-32 int8 weight [N, K] (``quantize_int8_groups``). torch's int4 kernel runs it as
    its two nibble halves along K, ``[hi | lo]`` [N, 2K], over the input twice, ``[x | x]``;
    either way one byte per weight plus two numbers per group, at one row 2.5-3.3x faster than
    a bf16 GEMV of the same matrix on this repository's CPU (the LM head, 49152 x 576)."""

    NIBBLES = False

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: torch.Tensor | None = None, dense_from_rows: int | None = None, kernel: str = "auto") -> None:
        super().__init__(bias, dtype, dense, dense_from_rows, kernel)
        self.out_features, self.in_features = codes.shape
        self.compute_dtype = dtype
        if self.handle is not None:
            self._hold_codes(*cpu_kernels.pack_int8(codes, scales))
        else:
            self._hold_torch_int4(int8_groups_as_nibbles(codes, scales), dtype)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.handle is not None:
            return torch.ops.nanoserve.int8_mm(x, self.codes, self.scales, self.mins, self.handle)
        return self._torch_int4_mm(torch.cat([x, x], dim=-1))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as an embedding table (our kernels' codes only)."""
        return torch.ops.nanoserve.dequantize_rows(self.codes, self.scales, self.mins, token_ids, self.out_features,
                                                   self.in_features, False, self.compute_dtype, self.handle)


class GroupEmbedding(nn.Module):
    """The token embedding read from a tied group-wise int8 LM head's codes: no float copy of
    the table (a Q8_0 embedding is the file's own blocks either way)."""

    def __init__(self, table: Int8GroupLinear) -> None:
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


@dataclass(frozen=True)
class WeightPlan:
    """How the weights are held. ``format`` is one of WEIGHT_FORMATS; with ``dense_from_rows``
    set, packed linears also keep a dense copy (in the compute dtype) used for inputs of at least
    that many rows. ``int8_head`` (int4 only) runs the LM head as group-32 int8
    (``Int8GroupLinear``: the default GGUF's own Q8_0 blocks) instead of dense; a tied embedding
    stays a dense table, except where nanoserve's kernels run the head without a dense copy
    (then ``GroupEmbedding`` reads it from the head's codes). With a dense copy the head takes it from
    ``min(dense_from_rows, HEAD_DENSE_FROM_ROWS)`` rows. ``kernel`` (GROUP_KERNELS, int4 only)
    says who runs the group-wise layers."""

    format: str
    dense_from_rows: int | None = None
    int8_head: bool = False
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)} or 'auto', got {self.format!r}")
        if self.dense_from_rows is not None and self.format not in ("int8", "int4"):
            raise ValueError(f"a dense copy for large row counts only applies to int8/int4, not {self.format}")
        if self.int8_head and self.format != "int4":
            raise ValueError(f"a group-wise int8 LM head only applies to int4, not {self.format}")
        if self.kernel not in GROUP_KERNELS or (self.kernel != "auto" and self.format != "int4"):
            raise ValueError(f"kernel {self.kernel!r}: one of {', '.join(GROUP_KERNELS)}, and only with int4")

    @property
    def tier(self) -> str | None:
        """The kernel tier that runs the group-wise layers (int4 only), resolved on this host."""
        return cpu_kernels.resolve_tier(self.kernel) if self.format == "int4" else None

    @property
    def name(self) -> str:
        """"int4", or "int4+int8head+bf16>=10" with a group-wise int8 head and a bf16 copy from 10
        rows ("+torch" or "+avx2" at the end when the kernel is chosen)."""
        head = "+int8head" if self.int8_head else ""
        short = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        dense = "" if self.dense_from_rows is None else f"+{short}>={self.dense_from_rows}"
        return self.format + head + dense + ("" if self.kernel == "auto" else f"+{self.kernel}")

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and the K/V cache's) dtype: fp32 and bf16 as named; the packed
        formats compute in bf16 where the CPU does so natively and in fp32 elsewhere
        (cpu_kernels.compute_dtype of the tier that runs them)."""
        if self.format in ("fp32", "bf16"):
            return torch.float32 if self.format == "fp32" else torch.bfloat16
        return cpu_kernels.compute_dtype(self.tier or cpu_kernels.resolve_tier())


def pack_model(model: nn.Module, plan: WeightPlan, int4_sources: Mapping[str, GroupwiseInt4] | None = None) -> None:
    """Replace the model's linear layers (and a tied LM head) with packed ones, in place.

    The model holds float weights (fp32 keeps the rounding to the packed format exact); cast it
    to ``plan.dtype`` afterwards (packed codes are integers and stay as they are). ``int4_sources`` maps HF weight
    names to int4 groups taken as they are (a GGUF's Q4 blocks); other weights are quantised
    here. With int8 the LM head runs int8 per channel too (a tied head shares its codes with
    the token embedding); with int4 it stays dense in ``plan.dtype``.
    """
    if plan.format not in ("int8", "int4"):
        return
    if any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules()):
        raise ValueError("the model's weights are packed already; load it again to choose another format")
    sources = int4_sources or {}
    _fuse_gate_up(model, plan)
    for name, linear in list(model.named_modules()):
        if isinstance(linear, nn.Linear) and name != "lm_head":
            _replace(model, name, _packed_linear(linear, plan, int4_source(name, sources)))
    if plan.format == "int4":
        # The LM head stays bf16 unless asked for group-wise int8 (per-channel int8 fails the
        # fidelity gates, README).
        if plan.int8_head:
            _pack_int8_group_head(model, plan)
        return
    tied = model.lm_head is None
    head = model.embed_tokens if tied else model.lm_head
    if not int8_kernel_accepts(head.weight.shape[1]):
        return  # the kernel's shape rules do not hold: the head (and a tied embedding) stay dense
    model.lm_head = _int8_linear(head.weight, None if tied else head.bias, plan)
    if tied:  # one int8 matrix serves as the embedding and the head
        model.embed_tokens = Int8Embedding(model.lm_head)


def _pack_int8_group_head(model: nn.Module, plan: WeightPlan) -> None:
    tied = model.lm_head is None
    head = model.embed_tokens if tied else model.lm_head
    if not int4_kernel_accepts(*head.weight.shape):
        return  # the kernel's shape rules do not hold: the head stays dense
    dense = None
    if tied and plan.dense_from_rows is not None:
        # The embedding table, cast now, is the head's dense copy too: the later cast of the
        # model leaves a tensor already in its dtype as it is, so the two stay one tensor.
        model.embed_tokens.to(plan.dtype)
        dense = model.embed_tokens.weight.detach()
    elif plan.dense_from_rows is not None:
        dense = _dense_copy(head.weight, plan)
    codes, scales = quantize_int8_groups(head.weight)
    dense_from_rows = None if dense is None else min(plan.dense_from_rows, HEAD_DENSE_FROM_ROWS)
    model.lm_head = Int8GroupLinear(codes, scales, None if tied else head.bias, plan.dtype, dense, dense_from_rows,
                                    plan.kernel)
    if tied and dense is None and model.lm_head.handle is not None:
        model.embed_tokens = GroupEmbedding(model.lm_head)  # the head's codes serve as the table


# A fused linear of this model and the HF tensors it stacks along the output dimension, in order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def int4_source(module_name: str, sources: Mapping[str, GroupwiseInt4]) -> GroupwiseInt4 | None:
    """The int4 groups for one of the model's linears from HF-named ``sources``, or None.
    A fused linear (FUSED_PARTS) is its HF tensors stacked along the output dimension."""
    hf = "model." + module_name + ".weight"
    fused = next((f for f in FUSED_PARTS if f".{f}." in hf), None)
    parts = [hf.replace(fused, part) for part in FUSED_PARTS[fused]] if fused else [hf]
    if all(p in sources for p in parts):
        return GroupwiseInt4.cat([sources[p] for p in parts])
    return None


def _fuse_gate_up(model: nn.Module, plan: WeightPlan) -> None:
    """Give every MLP one [2 * intermediate, hidden] linear for gate and up, to be packed next:
    one kernel call per layer instead of two. Lossless: int4 groups and int8 scales run along
    K within an output row, so stacking rows changes no code or scale. An MLP whose parts the
    kernel would not pack each on their own keeps them apart (and dense)."""
    for mlp in model.modules():
        if not hasattr(mlp, "fuse_gate_up") or mlp.gate_up_proj is not None:
            continue
        gate, up = mlp.gate_proj, mlp.up_proj
        linears = isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
        if not linears or gate.bias is not None or up.bias is not None:
            continue
        if plan.format == "int4" and not all(int4_kernel_accepts(*m.weight.shape) for m in (gate, up)):
            continue
        fused = nn.Linear(gate.in_features, gate.out_features + up.out_features, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        mlp.fuse_gate_up(fused)


def _packed_linear(linear: nn.Linear, plan: WeightPlan, source: GroupwiseInt4 | None) -> nn.Module:
    n, k = linear.weight.shape
    if plan.format == "int8":
        # A layer the kernel cannot take stays bf16.
        return _int8_linear(linear.weight, linear.bias, plan) if int8_kernel_accepts(k) else linear
    if not int4_kernel_accepts(n, k):
        return linear  # the kernel's shape rules do not hold: this layer stays bf16
    weight = source if source is not None else quantize_int4(linear.weight)
    return Int4Linear(weight, linear.bias, plan.dtype, _dense_copy(linear.weight, plan), plan.dense_from_rows,
                      plan.kernel)


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, plan: WeightPlan) -> Int8Linear:
    codes, scales = quantize_int8(weight)
    return Int8Linear(codes, scales, bias, plan.dtype, _dense_copy(weight, plan), plan.dense_from_rows)


def _dense_copy(weight: torch.Tensor, plan: WeightPlan) -> torch.Tensor | None:
    return None if plan.dense_from_rows is None else weight.detach().to(plan.dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)
