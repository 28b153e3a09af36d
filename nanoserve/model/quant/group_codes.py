"""Group-wise weight codes: a weight [N, K] as ``w = scales * codes + mins`` per group of 32 (or
16) weights along K, unsigned codes of 4, 5, 6 or 8 bits, and the rules that make them from float
weights (int4 groups, int8 groups as Q8_0 rounds them, int8 per channel).

Every GGUF block type that runs packed is this form without rounding anything (``gguf_blocks``):
Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, Q5_0, Q5_1, Q8_0 (``d * c`` as ``d * (c + 128) - 128 d``),
and the K-quants, whose super-block scales give each group of 32 (Q4_K, Q5_K) or 16 (Q6_K, Q3_K,
Q2_K) an exact fp32 scale and minimum (``SuperScales``). Q2_K's and Q3_K's codes have 2 and 3
bits (held in 4); IQ4_NL's, IQ4_XS's and MXFP4's table values are held here as codes, the value
plus a zero point (8 and 5 bits; packed from the file's blocks they keep the file's nibbles and
their code table instead, ``gguf_blocks``). ``as_torch_int4`` writes a group-32 weight in
torch's int4 kernel's layout (see ``quant.linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.quant.cpu_kernels import GROUP_SIZE

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

    ``codes`` [N, K] uint8 below ``2 ** bits`` (2 to 8; held in 4, 5, 6 or 8); ``scales`` and ``mins``
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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

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
