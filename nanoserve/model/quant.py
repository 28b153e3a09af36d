"""Packed linear layers: the model's weights executed as group-wise codes, int8 channels or bf16.

A group-wise weight (``GroupCodes``) is ``w = scales * codes + mins`` per group of 32 (or 16)
weights along K, unsigned codes of 4, 5, 6 or 8 bits. Every GGUF block type that runs packed is
that form without rounding anything (``gguf_blocks``): Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``,
Q5_0, Q5_1, Q8_0 (``d * c`` as ``d * (c + 128) - 128 d``), and the K-quants, whose super-block
scales give each group of 32 (Q4_K, Q5_K) or 16 (Q6_K) an exact fp32 scale and minimum. A float
weight is rounded here to int4 groups (``quantize_int4``) or, for an LM head, int8 groups.

nanoserve's kernels (``cpu_kernels``) run every such format where a tier of them runs on the host:
4-bit codes two a byte, 5- and 6-bit codes as a nibble and bit planes, 8-bit codes a byte each;
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
# weight) is shared by every row. Same bench as above.
DEQUANT_FROM_ROWS: dict[str, int] = {"avx512-vnni": 64, "avx-vnni": 64, "avx2": 64, "neon-dot": 64, "neon": 64,
                                     "scalar": 16}
# The group-wise LM head reads a byte per weight (Q8_0) against the body's half, so its dense
# copy takes over sooner where the body has one.
HEAD_DENSE_FROM_ROWS = 16
FP16_TINY = 2.0 ** -24  # the smallest fp16 number: the step of a group that is all one value


@dataclass
class SuperScales:
    """Per-group numbers as a K-quant holds them: ``supers`` [N, K / 256] fp16 numbers (held in
    fp32) times ``multipliers`` [N, K / group] int8, each group's number the product (exact)."""

    supers: torch.Tensor
    multipliers: torch.Tensor

    def values(self) -> torch.Tensor:
        per_super = self.multipliers.shape[1] // self.supers.shape[1]
        return self.supers.repeat_interleave(per_super, 1) * self.multipliers.float()


@dataclass
class GroupCodes:
    """A weight [N, K] as unsigned codes in groups along K: ``w = scales * codes + mins`` per group.

    ``codes`` [N, K] uint8 below ``2 ** bits`` (4, 5, 6 or 8); ``scales`` and ``mins``
    [N, K / group] fp32; ``group`` 32 or 16 weights. A K-quant also gives its scales (and
    minimums) as ``SuperScales``, which the kernels hold in the K-quant's own size.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    group: int = GROUP_SIZE
    scale_factors: SuperScales | None = None
    min_factors: SuperScales | None = None

    def per_weight(self, numbers: torch.Tensor) -> torch.Tensor:
        return numbers.repeat_interleave(self.group, dim=1)

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32: one product and one sum per weight, exact for every GGUF type here."""
        return self.codes.float() * self.per_weight(self.scales) + self.per_weight(self.mins)

    def regroup(self, group: int) -> GroupCodes:
        """The same weight with scale groups of ``group`` (a divisor of this one's): lossless."""
        repeat = self.group // group
        regrouped = [None if f is None else SuperScales(f.supers, f.multipliers.repeat_interleave(repeat, 1))
                     for f in (self.scale_factors, self.min_factors)]
        return GroupCodes(self.codes, self.scales.repeat_interleave(repeat, 1), self.mins.repeat_interleave(repeat, 1),
                          self.bits, group, *regrouped)

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        """Stack weights along N (q, k and v into one fused projection). Parts of different
        formats (a Q4_K file's Q6_K v beside Q4_K q and k) meet in the widest codes and the
        smallest group, which holds each part's codes and numbers as they are (their super-block
        factors only where every part has them)."""
        group = min(p.group for p in parts)
        parts = [p.regroup(group) for p in parts]
        factors = []
        for name in ("scale_factors", "min_factors"):
            found = [getattr(p, name) for p in parts]
            factors.append(None if any(f is None for f in found) else SuperScales(
                torch.cat([f.supers for f in found]), torch.cat([f.multipliers for f in found])))
        return GroupCodes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")),
                          bits=max(p.bits for p in parts), group=group, scale_factors=factors[0],
                          min_factors=factors[1])


def quantize_int4(weight: torch.Tensor) -> GroupCodes:
    """Round-to-nearest asymmetric int4 per group of 32: each group's minimum and step (max - min)
    / 15 rounded to fp16 (so the kernels hold them in fp16 as they are), then each code."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).half().float().clamp(min=FP16_TINY)
    low = low.half().float()
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return GroupCodes(q.to(torch.uint8).view(n, k), scales, low, bits=4)


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of 32 along K, Q8_0's rule: (codes [N, K] int8, scales [N, K / 32]
    fp32 holding fp16 numbers), ``w = codes * scale``, scale = max |w| / 127 rounded to fp16. A
    weight dequantised from Q8_0 blocks (fp16 d times an int8 code whose group reaches +-127, as
    llama.cpp writes them) gets its blocks back exactly: max |w| / 127 is d, and every w / d is
    its code."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = (groups.abs().amax(-1) / 127).half().float().clamp(min=FP16_TINY)
    codes = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.view(n, k), scales


def int8_groups(codes: torch.Tensor, scales: torch.Tensor) -> GroupCodes:
    """A group-32 int8 weight ``codes * scales`` as unsigned codes: ``scales * (codes + 128) - 128 scales``."""
    return GroupCodes((codes.to(torch.int16) + 128).to(torch.uint8), scales, -128 * scales, bits=8)


def as_torch_int4(weight: GroupCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group-32 weight as torch's int4 format (module docstring): (q [N, K'] in 0..15, scales,
    zeros [N, K' / 32]), K' = K for 4-bit codes, 2K (``[hi | lo]``) for wider ones."""
    if weight.bits <= 4:
        return weight.codes, weight.scales, weight.mins + 8 * weight.scales
    # s * (16 hi + lo) + m = (hi - 8) * 16s + (lo - 8) * s + (136 s + m)
    q = torch.cat([weight.codes >> 4, weight.codes & 15], dim=1)
    return (q, torch.cat([16 * weight.scales, weight.scales], dim=1),
            torch.cat([torch.zeros_like(weight.scales), 136 * weight.scales + weight.mins], dim=1))


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
    handle; torch's int4 kernel (group 32 only) holds ``packed`` and ``scales_and_zeros``."""

    def __init__(self, weight: GroupCodes, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: torch.Tensor | None = None, dense_from_rows: int | None = None, kernel: str = "auto") -> None:
        super().__init__(bias, dense, dense_from_rows)
        self.kernel = resolve_group_kernel(kernel, dtype)
        self.handle = cpu_kernels.handle(self.kernel)
        self.out_features, self.in_features = weight.codes.shape
        self.compute_dtype = dtype
        if self.handle is not None:
            *packed, self.zero_point = cpu_kernels.pack_groups(weight.codes, weight.scales, weight.mins, weight.bits,
                                                               weight.scale_factors, weight.min_factors)
            for name, tensor in zip(("codes", "scales", "mins"), packed):
                self.register_buffer(name, tensor)
            if dense is None:  # no copy held: from DEQUANT_FROM_ROWS rows the weight is dequantised for the call
                self.dense_from_rows = DEQUANT_FROM_ROWS[self.kernel]
            return
        if weight.group != GROUP_SIZE:
            raise ValueError(f"torch's int4 kernel runs groups of {GROUP_SIZE} only, not {weight.group}")
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
            return torch.ops.nanoserve.group_mm(x, self.codes, self.scales, self.mins, self.zero_point, self.handle)
        x = torch.cat([x, x], dim=-1) if self.doubled_input else x
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as an embedding table (our kernels' codes only)."""
        return torch.ops.nanoserve.dequantize_rows(self.codes, self.scales, self.mins, self.zero_point, token_ids,
                                                   self.out_features, self.in_features, self.compute_dtype, self.handle)

    def held_numbers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and minimums our kernels read, fp32 [N, K / group] each (a symmetric
        format's minimums from its zero point)."""
        scales = cpu_kernels.per_group(self.scales)
        return scales, -self.zero_point * scales if self.zero_point else cpu_kernels.per_group(self.mins)


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


@dataclass(frozen=True)
class WeightPlan:
    """How the weights are held. ``format`` is one of WEIGHT_FORMATS: "int4" runs each linear
    group-wise, from a GGUF's own blocks where it has them (any type in gguf_blocks) and rounded
    to int4 groups where the weight is float. With ``dense_from_rows`` set, packed linears also
    keep a dense copy (in the compute dtype) used for inputs of at least that many rows.
    ``int8_head`` (int4 only) runs the LM head group-wise too (from the file's blocks, such as
    the default GGUF's Q8_0, else rounded to int8 groups) instead of dense; a tied embedding
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


def pack_model(model: nn.Module, plan: WeightPlan, sources: Mapping[str, GroupCodes] | None = None,
               tensor_types: Mapping[str, str] | None = None) -> None:
    """Replace the model's linear layers (and a tied LM head) with packed ones, in place.

    The model holds float weights (fp32 keeps the rounding to the packed format exact); cast it
    to ``plan.dtype`` afterwards (packed codes are integers and stay as they are). ``sources``
    maps HF weight names to group-wise weights taken as they are (a GGUF's blocks); other weights
    are quantised here. With int8 the LM head runs int8 per channel too (a tied head shares its
    codes with the token embedding); with int4 it stays dense in ``plan.dtype`` unless
    ``plan.int8_head``. ``model.weight_types`` then says how each tensor type runs
    (``weight_types``); ``tensor_types`` maps HF names to their types (a GGUF's), by default
    each weight's dtype.
    """
    if plan.format not in ("int8", "int4"):
        return
    if any(isinstance(m, (GroupLinear, Int8Linear)) for m in model.modules()):
        raise ValueError("the model's weights are packed already; load it again to choose another format")
    sources = sources or {}
    types = dict(tensor_types or _dtype_names(model))
    modes: dict[str, str] = {}
    _fuse_gate_up(model, plan)
    for name, linear in list(model.named_modules()):
        if isinstance(linear, nn.Linear) and name != "lm_head":
            packed, mode = _packed_linear(linear, plan, group_source(name, sources))
            _replace(model, name, packed)
            modes.update(dict.fromkeys(hf_parts(name), mode))
    tied = model.lm_head is None
    head_names = ["model.embed_tokens.weight"] if tied else ["lm_head.weight"]
    if plan.format == "int4":
        # The LM head stays dense unless asked for a group-wise one (per-channel int8 fails the
        # fidelity gates, README).
        if plan.int8_head:
            modes.update(dict.fromkeys(head_names, _pack_group_head(model, plan, sources)))
    elif int8_kernel_accepts((model.embed_tokens if tied else model.lm_head).weight.shape[1]):
        head = model.embed_tokens if tied else model.lm_head
        model.lm_head = _int8_linear(head.weight, None if tied else head.bias, plan)
        if tied:  # one int8 matrix serves as the embedding and the head
            model.embed_tokens = Int8Embedding(model.lm_head)
        modes.update(dict.fromkeys(head_names, "int8"))
    model.weight_types = weight_types(types, modes)


def weight_types(tensor_types: Mapping[str, str], modes: Mapping[str, str]) -> dict[str, str]:
    """How each tensor type runs, from each tensor's type and mode ("packed": from its own blocks;
    "int4" or "int8": rounded here to that format; "dense": in the compute dtype, the default):
    {type: mode}, modes joined by "+" where a type's tensors differ (a Q8_0 embedding table held
    dense beside Q8_0 linears run packed)."""
    by_type: dict[str, set[str]] = {}
    for name, kind in tensor_types.items():
        by_type.setdefault(kind, set()).add(modes.get(name, "dense"))
    return {kind: "+".join(sorted(found)) for kind, found in sorted(by_type.items())}


def _dtype_names(model: nn.Module) -> dict[str, str]:
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    return {name: names.get(t.dtype, str(t.dtype)) for name, t in _hf_weights(model).items()}


def _hf_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's float weights by HF name (fused linears by their parts' names)."""
    out = {}
    for name, tensor in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        for part in hf_parts(module):
            out[part.removesuffix(".weight") + "." + leaf] = tensor
    return out


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _pack_group_head(model: nn.Module, plan: WeightPlan, sources: Mapping[str, GroupCodes]) -> str:
    """The LM head group-wise (its source's blocks, else int8 groups); returns its mode."""
    tied = model.lm_head is None
    head = model.embed_tokens if tied else model.lm_head
    source = sources.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if not int4_kernel_accepts(*head.weight.shape) or (
            source is not None and source.group != GROUP_SIZE and plan.tier == "torch"):
        return "dense"  # the kernel's shape rules do not hold, or torch has no such format
    dense = None
    if tied and plan.dense_from_rows is not None:
        # The embedding table, cast now, is the head's dense copy too: the later cast of the
        # model leaves a tensor already in its dtype as it is, so the two stay one tensor.
        model.embed_tokens.to(plan.dtype)
        dense = model.embed_tokens.weight.detach()
    elif plan.dense_from_rows is not None:
        dense = _dense_copy(head.weight, plan)
    weight = source if source is not None else int8_groups(*quantize_int8_groups(head.weight))
    dense_from_rows = None if dense is None else min(plan.dense_from_rows, HEAD_DENSE_FROM_ROWS)
    model.lm_head = GroupLinear(weight, None if tied else head.bias, plan.dtype, dense, dense_from_rows, plan.kernel)
    if tied and dense is None and model.lm_head.handle is not None:
        model.embed_tokens = GroupEmbedding(model.lm_head)  # the head's codes serve as the table
    return "packed" if source is not None else "int8"


# A fused linear of this model and the HF tensors it stacks along the output dimension, in order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_parts(module_name: str) -> list[str]:
    """The HF weight names one of the model's linears holds: a fused linear (FUSED_PARTS) its
    parts', stacked along the output dimension."""
    hf = _hf_name(module_name + ".weight")
    fused = next((f for f in FUSED_PARTS if f".{f}." in hf), None)
    return [hf.replace(fused, part) for part in FUSED_PARTS[fused]] if fused else [hf]


def group_source(module_name: str, sources: Mapping[str, GroupCodes]) -> GroupCodes | None:
    """The group-wise weight of one of the model's linears from HF-named ``sources``, or None."""
    parts = hf_parts(module_name)
    if all(p in sources for p in parts):
        return GroupCodes.cat([sources[p] for p in parts])
    return None


def _fuse_gate_up(model: nn.Module, plan: WeightPlan) -> None:
    """Give every MLP one [2 * intermediate, hidden] linear for gate and up, to be packed next:
    one kernel call per layer instead of two. Lossless: groups and int8 scales run along K
    within an output row, so stacking rows changes no code or scale. An MLP whose parts the
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


def _packed_linear(linear: nn.Linear, plan: WeightPlan, source: GroupCodes | None) -> tuple[nn.Module, str]:
    """The packed layer for ``linear`` and its mode (weight_types); a layer the kernel cannot
    take stays as it is, dense."""
    n, k = linear.weight.shape
    if plan.format == "int8":
        return (_int8_linear(linear.weight, linear.bias, plan), "int8") if int8_kernel_accepts(k) else (linear, "dense")
    if not int4_kernel_accepts(n, k) or (source is not None and source.group != GROUP_SIZE and plan.tier == "torch"):
        return linear, "dense"
    weight = source if source is not None else quantize_int4(linear.weight)
    layer = GroupLinear(weight, linear.bias, plan.dtype, _dense_copy(linear.weight, plan), plan.dense_from_rows,
                        plan.kernel)
    return layer, "packed" if source is not None else "int4"


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, plan: WeightPlan) -> Int8Linear:
    codes, scales = quantize_int8(weight)
    return Int8Linear(codes, scales, bias, plan.dtype, _dense_copy(weight, plan), plan.dense_from_rows)


def _dense_copy(weight: torch.Tensor, plan: WeightPlan) -> torch.Tensor | None:
    return None if plan.dense_from_rows is None else weight.detach().to(plan.dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)
