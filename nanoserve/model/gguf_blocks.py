"""GGUF's block-quantised tensor types as group-wise codes (``GroupCodes``), without rounding.

Each block type's weights are ``scale * code + minimum`` per group along a row, with unsigned
codes; this module reads the codes, scales and minimums out of the blocks (the layouts are
llama.cpp's, as gguf-py's ``gguf.quants`` dequantises them):

| type | block | codes | group | scale, minimum |
| --- | --- | --- | --- | --- |
| Q4_0 | 32 weights, 18 bytes | 4-bit | 32 | fp16 d, -8 d |
| Q4_1 | 32, 20 | 4-bit | 32 | fp16 d, fp16 m |
| Q5_0 | 32, 22 | 5-bit | 32 | d, -16 d |
| Q5_1 | 32, 24 | 5-bit | 32 | d, m |
| Q8_0 | 32, 34 | int8 c as c + 128 | 32 | d, -128 d |
| Q4_K | 256, 144 | 4-bit | 32 | d * sc, -dmin * mn (fp16 times 6-bit integers) |
| Q5_K | 256, 176 | 5-bit | 32 | d * sc, -dmin * mn |
| Q6_K | 256, 210 | 6-bit | 16 | d * sc, -32 d * sc (int8 sc) |

Every scale and minimum is exact in fp32 (an fp16 number times an integer below 2^8), and so is
every weight ``scale * code + minimum`` (at most 23 significant bits): the codes and numbers
here are the file's, and their dequantisation equals gguf's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nanoserve.model import cpu_kernels
from nanoserve.model.group_codes import GroupCodes, SuperScales

Q = GGMLQuantizationType


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 number at byte ``at`` of every block, as fp32 [..., blocks]."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> codes [..., 2n]: the low nibbles, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bits [..., count] of the bytes [..., count / 8]."""
    return np.unpackbits(packed, axis=-1, count=count, bitorder="little")


def _legacy(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, ...]:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: (codes [..., 32], scale [...], minimum [...], bits)."""
    d = _fp16(blocks, 0)
    if qtype == Q.Q8_0:
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 8
    asymmetric = qtype in (Q.Q4_1, Q.Q5_1)
    at = 4 if asymmetric else 2
    five = qtype in (Q.Q5_0, Q.Q5_1)
    high = _bits(blocks[..., at:at + 4], 32) if five else 0
    codes = _nibbles(blocks[..., at + (4 if five else 0):]) | (high << 4)
    bits = 5 if five else 4
    minimum = _fp16(blocks, 2) if asymmetric else -float(1 << (bits - 1)) * d
    return codes.astype(np.uint8), d, minimum, bits


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums per super-block:
    groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); groups 4-7 with their
    low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the top of bytes 0-3 / 4-7."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant(blocks: np.ndarray, qtype: Q) -> tuple:
    """Q4_K, Q5_K, Q6_K: (codes [..., 256], scales [..., groups], minimums [..., groups], bits,
    the scales' and the minimums' factors: (super [...], multipliers [..., groups]) or None)."""
    lead = blocks.shape[:-1]
    if qtype == Q.Q6_K:
        # 128 bytes of low nibbles (two halves of 64: weights 0-63 low, 64-127 high nibbles),
        # 64 of 2-bit high parts (two halves of 32 bytes, 4 weights 32 apart per byte), 16 int8 scales.
        low = blocks[..., 0:128].reshape(*lead, 2, 64)
        low = np.stack([low & 0x0F, low >> 4], axis=-2).reshape(*lead, 256)
        high = blocks[..., 128:192].reshape(*lead, 2, 32)
        high = np.stack([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2).reshape(*lead, 256)
        d, sc = _fp16(blocks, 208), blocks[..., 192:208].view(np.int8)
        scales = d[..., None] * sc.astype(np.float32)
        return (low | (high << 4)).astype(np.uint8), scales, -32 * scales, 6, (d, sc), None
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, mn = _k_scales(blocks[..., 4:16])
    at = 16 if qtype == Q.Q4_K else 48
    # 4 chunks of 32 bytes: chunk c holds group 2c in its low nibbles and group 2c + 1 in its high ones.
    quads = blocks[..., at:at + 128].reshape(*lead, 4, 32)
    codes = np.stack([quads & 0x0F, quads >> 4], axis=-2).reshape(*lead, 256)
    if qtype == Q.Q5_K:  # 32 bytes of fifth bits: bit g of byte i is weight i of group g
        fifth = blocks[..., 16:48]
        codes = codes | (np.stack([(fifth >> g) & 1 for g in range(8)], axis=-2).reshape(*lead, 256) << 4)
    factors = (d, sc.astype(np.int8)), (-dmin, mn.astype(np.int8))
    return codes.astype(np.uint8), d[..., None] * sc, -(dmin[..., None] * mn), 5 if qtype == Q.Q5_K else 4, *factors


LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The block types nanoserve runs from their blocks.
PACKED_TYPES = frozenset(LEGACY + K_QUANTS)


def group_codes(data: np.ndarray, qtype: Q, rows: int, cols: int) -> GroupCodes:
    """A [rows, cols] tensor of block type ``qtype`` (its raw bytes) as GroupCodes."""
    if qtype not in PACKED_TYPES:
        raise ValueError(f"{qtype.name} does not run from its blocks (those that do: "
                         f"{', '.join(t.name for t in PACKED_TYPES)})")
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // block_weights, block_bytes)
    codes, scales, mins, bits, *factors = (_legacy if qtype in LEGACY else _k_quant)(blocks, qtype)
    group = 16 if qtype == Q.Q6_K else 32
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))  # noqa: E731
    supers = [None if f is None else SuperScales(as_rows(f[0].astype(np.float32)), as_rows(f[1])) for f in factors]
    return GroupCodes(as_rows(codes), as_rows(scales.astype(np.float32)), as_rows(mins.astype(np.float32)),
                      bits=bits, group=group, scale_factors=supers[0] if supers else None,
                      min_factors=supers[1] if supers else None)


# The zero point of each type that stores none of its minimums (``w = d * (c - zero point)``).
ZERO_POINTS = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128, Q.Q6_K: 32}


@dataclass(frozen=True)
class BlockTensor:
    """A block-quantised tensor [rows, cols] as the file holds it: its type and raw blocks (a view
    of the file's memory map, never copied), and the file row each of its rows reads
    (``row_order``; None: in order)."""

    qtype: Q
    data: np.ndarray
    rows: int
    cols: int
    row_order: np.ndarray | None = None

    @property
    def bits(self) -> int:
        return {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8}.get(self.qtype, 4)

    @property
    def group(self) -> int:
        return 16 if self.qtype == Q.Q6_K else 32

    def group_codes(self) -> GroupCodes:
        """The tensor as unpacked GroupCodes (one byte a code, fp32 numbers)."""
        weight = group_codes(self.data, self.qtype, self.rows, self.cols)
        if self.row_order is None:
            return weight
        order = torch.from_numpy(self.row_order)
        factors = [None if f is None else SuperScales(f.supers[order], f.multipliers[order])
                   for f in (weight.scale_factors, weight.min_factors)]
        return GroupCodes(weight.codes[order], weight.scales[order], weight.mins[order], weight.bits, weight.group,
                          *factors)


@dataclass(frozen=True)
class StackedBlocks:
    """Block tensors of one type stacked along their rows (a fused projection's parts), packed
    from the file's bytes straight into the kernels' layout (``pack``)."""

    parts: tuple[BlockTensor, ...]

    def __post_init__(self) -> None:
        if len({(p.qtype, p.cols) for p in self.parts}) != 1:
            raise ValueError("stacked block tensors must share their type and column count")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.parts[0].cols

    @property
    def bits(self) -> int:
        return self.parts[0].bits

    @property
    def group(self) -> int:
        return self.parts[0].group

    def group_codes(self) -> GroupCodes:
        return GroupCodes.cat([p.group_codes() for p in self.parts])

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(codes, scales, mins, zero point) as ``cpu_kernels.pack_groups`` lays them out, made
        by ``cpu_kernels.pack_gguf`` part by part (blocks of 16 rows are independent, so the
        parts' packings stack)."""
        packed = [cpu_kernels.pack_gguf(p.data, int(p.qtype), p.rows, p.cols, p.row_order) for p in self.parts]
        codes, scales, mins = (torch.cat([p[i] for p in packed]) for i in range(3))
        return codes, scales, mins, ZERO_POINTS.get(self.parts[0].qtype, 0)


@dataclass(frozen=True)
class ExpertBlocks:
    """A block-quantised expert tensor [experts, rows, cols]: each expert its own BlockTensor
    (a view of the file's bytes), packed expert by expert."""

    experts: tuple[BlockTensor, ...]

    @property
    def qtype(self) -> Q:
        return self.experts[0].qtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.experts), self.experts[0].rows, self.experts[0].cols
