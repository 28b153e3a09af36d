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

The low-bit types people download are the same form. Unpacked (``group_codes``: torch's kernel,
and a stack of parts of different types) each is held exactly in one of those formats, its codes
widened where the file's are not ``scale * code + minimum``; packed from the file's bytes for
nanoserve's kernels (``StackedBlocks.pack``), the table types keep the file's nibbles, each a
4-bit code standing for its table's value (``w = scale * table[c]``, no minimum; the kernels look
the nibble up in a register table before the int8 dot):

| type | block | codes unpacked | codes packed | group | scale, minimum | bits a weight packed (file) |
| --- | --- | --- | --- | --- | --- | --- |
| Q2_K | 256, 84 | 2-bit q, held in 4 | the same | 16 | d * sc, -dmin * m (fp16 times 4-bit integers) | 5.13 (2.63) |
| Q3_K | 256, 110 | 3-bit q + 4 h, held in 4 | the same | 16 | d * (sc - 32), -4 d * (sc - 32) | 4.56 (3.44) |
| IQ4_NL | 32, 18 | 8-bit ``table[q] + 128`` | nibble q, IQ4 table | 32 | fp16 d | 4.5 (4.5) |
| IQ4_XS | 256, 136 | 8-bit ``table[q] + 128`` | nibble q, IQ4 table | 32 | d * (ls - 32) | 4.31 (4.25) |
| MXFP4 | 32, 17 | 5-bit ``e2m1[q] + 16`` | nibble q, E2M1 table | 32 | 2^(e - 128), the exponent byte e | 4.25 (4.25) |

(bits packed: the codes' storage, 4 bits, plus the numbers: fp16 per group, MXFP4's exponent
byte per group, or a K-quant's super-block records of an fp16 number and an int8 multiplier per
group, 16 rows at a time.) IQ4_NL's and IQ4_XS's codes index a 16-entry non-linear table
(-127 .. 113) that is no affine function of the nibble, so unpacked the entry itself is held, as
Q8_0's int8 code is (8 bits); MXFP4's E2M1 nibbles index {0, 1, 2, 3, 4, 6, 8, 12} and their
negatives (gguf's doubled values, the half in the scale 2^(e - 128)), 25 values: 5-bit codes
unpacked. Exactness, as gguf computes in fp32: Q2_K's ``d * sc * q - dmin * m`` is one rounding
in both; every other product is exact (IQ4_XS's scale has at most 16 significant bits, its value
8; Q3_K's 16 and 3; MXFP4's scale is a power of two), so scale * code and the minimum are exact
and their sum is the exact weight. MXFP4 only: exponents above 251 (weights of 2^124 and more)
overflow ``scale * value`` where gguf still has a finite weight; no real tensor is near them. Q2_K
and Q3_K would need 2- and 3-bit storage to reach their file's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.group_codes import GroupCodes, SuperScales

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


# IQ4_NL's and IQ4_XS's non-linear values of a nibble, and MXFP4's (E2M1 doubled: 2^(e - 128) is
# half the E8M0 scale 2^(e - 127)), as gguf's kvalues.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's scale 2^(e - 128) of each exponent byte, as fp32 (gguf's e8m0_to_fp32_half: the
    two smallest are fp32 subnormals)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def _tabled(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, ...]:
    """IQ4_NL and MXFP4 (blocks of 32, nibbles in Q4_0's order): (codes, scale, minimum, bits),
    the codes the table's value plus its zero point."""
    if qtype == Q.IQ4_NL:
        d = _fp16(blocks, 0)
        return (IQ4_VALUES[_nibbles(blocks[..., 2:18])] + 128).astype(np.uint8), d, -128 * d, 8
    d = e8m0_half(blocks[..., 0])
    with np.errstate(over="ignore"):  # exponents above 251 (module docstring)
        minimum = -16 * d
    return (MXFP4_VALUES[_nibbles(blocks[..., 1:17])] + 16).astype(np.uint8), d, minimum, 5


def _low_k(blocks: np.ndarray, qtype: Q) -> tuple:
    """Q2_K, Q3_K and IQ4_XS, as _k_quant returns the K-quants."""
    lead = blocks.shape[:-1]
    if qtype == Q.IQ4_XS:
        # fp16 d, 16 bits of high scale parts (2 a group), 4 bytes of low ones (a nibble a group,
        # low nibble first), then per group of 32 its 16 bytes of nibbles (Q4_0's order)
        d = _fp16(blocks, 0)
        high = blocks[..., 2:4].copy().view(np.uint16)[..., 0, None] >> (2 * np.arange(8, dtype=np.uint16))
        low = _nibbles(blocks[..., 4:8])[..., [0, 4, 1, 5, 2, 6, 3, 7]]
        ls = (low | ((high & 3).astype(np.uint8) << 4)).astype(np.int16) - 32
        codes = IQ4_VALUES[_nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))].reshape(*lead, 256) + 128
        scales = d[..., None] * ls.astype(np.float32)
        return codes.astype(np.uint8), scales, -128 * scales, 8, (d, ls.astype(np.int8)), None
    # 2-bit parts: 64 bytes, two halves of 32 bytes, each byte 4 weights 32 apart (Q6_K's order)
    at = 16 if qtype == Q.Q2_K else 32
    quads = blocks[..., at:at + 64].reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    codes = (quads & 3).reshape(*lead, 256)
    if qtype == Q.Q2_K:  # 16 bytes: scale | minimum << 4 per group of 16, then fp16 d and dmin
        d, dmin, packed = _fp16(blocks, 80), _fp16(blocks, 82), blocks[..., 0:16]
        sc, mn = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
        factors = (d, sc.astype(np.int8)), (-dmin, mn.astype(np.int8))
        return codes.astype(np.uint8), d[..., None] * sc, -(dmin[..., None] * mn), 2, *factors
    # Q3_K: 32 bytes of high bits (bit g of byte i: weight 32 g + i), the 2-bit parts, 12 bytes
    # of 6-bit scales (low nibbles of bytes 0-7, then their high nibbles; 2 bits each from bytes
    # 8-11, by shift then byte), fp16 d. gguf's value is q - 4 where the high bit is clear: the
    # code q + 4 h with zero point 4.
    codes = codes | (_bits(blocks[..., 0:32], 256).reshape(*lead, 32, 8).swapaxes(-1, -2).reshape(*lead, 256) << 2)
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)
    high = np.stack([(packed[..., 8:12] >> (2 * i)) & 3 for i in range(4)], axis=-2).reshape(*lead, 16)
    sc = (low | (high << 4)).astype(np.int16) - 32
    d = _fp16(blocks, 108)
    scales = d[..., None] * sc.astype(np.float32)
    return codes.astype(np.uint8), scales, -4 * scales, 3, (d, sc.astype(np.int8)), None


LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The low-bit types: a table's values (IQ4_NL, MXFP4 in blocks of 32; IQ4_XS in super-blocks) or
# 2- and 3-bit K-quants (held in the 4-bit format).
TABLED = (Q.IQ4_NL, Q.MXFP4)
LOW_K = (Q.Q2_K, Q.Q3_K, Q.IQ4_XS)
LOW_BIT = TABLED + LOW_K
# The block types nanoserve runs from their blocks.
PACKED_TYPES = frozenset(LEGACY + K_QUANTS + LOW_BIT)
# Each type's codes (their bits; held in 4, 5, 6 or 8: cpu_kernels.storage_bits) and scale group.
CODE_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6,
             Q.Q2_K: 2, Q.Q3_K: 3, Q.IQ4_NL: 8, Q.IQ4_XS: 8, Q.MXFP4: 5}
GROUPS = {Q.Q6_K: 16, Q.Q2_K: 16, Q.Q3_K: 16}  # 32 otherwise
# The low-bit types' bits a weight held by nanoserve's kernels packed from the file's blocks
# (codes and numbers) and in the file, by name (the module docstring): the startup summary says them.
WIDENED_BITS = {"Q2_K": (5.125, 2.625), "Q3_K": (4.5625, 3.4375), "IQ4_NL": (4.5, 4.5), "IQ4_XS": (4.3125, 4.25),
                "MXFP4": (4.25, 4.25)}
_READERS = {**dict.fromkeys(LEGACY, _legacy), **dict.fromkeys(TABLED, _tabled), **dict.fromkeys(K_QUANTS, _k_quant),
            **dict.fromkeys(LOW_K, _low_k)}


def group_codes(data: np.ndarray, qtype: Q, rows: int, cols: int) -> GroupCodes:
    """A [rows, cols] tensor of block type ``qtype`` (its raw bytes) as GroupCodes."""
    if qtype not in PACKED_TYPES:
        raise ValueError(f"{qtype.name} does not run from its blocks (those that do: "
                         f"{', '.join(t.name for t in PACKED_TYPES)})")
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // block_weights, block_bytes)
    codes, scales, mins, bits, *factors = _READERS[qtype](blocks, qtype)
    group = GROUPS.get(qtype, 32)
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))  # noqa: E731
    supers = [None if f is None else SuperScales(as_rows(f[0].astype(np.float32)), as_rows(f[1])) for f in factors]
    return GroupCodes(as_rows(codes), as_rows(scales.astype(np.float32)), as_rows(mins.astype(np.float32)),
                      bits=bits, group=group, scale_factors=supers[0] if supers else None,
                      min_factors=supers[1] if supers else None)


# The zero point of each type that stores none of its minimums (``w = d * (c - zero point)``), as
# packed from its blocks (the table types hold a code table instead: zero point 0).
ZERO_POINTS = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128, Q.Q6_K: 32, Q.Q3_K: 4}


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
        return CODE_BITS[self.qtype]

    @property
    def group(self) -> int:
        return GROUPS.get(self.qtype, 32)

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
        """(codes, scales, mins, zero point) as ``cpu_kernels.pack_groups`` lays them out (a
        table type: its nibbles, and its code table as the mins, ``cpu_kernels.pack_gguf``), made
        by ``cpu_kernels.pack_gguf_parts`` in one pass over the parts into the stacked tensors
        (blocks of 16 rows are independent, so the parts' packings stack)."""
        first = self.parts[0]
        codes, scales, mins = cpu_kernels.pack_gguf_parts([(p.data, p.rows, p.row_order) for p in self.parts],
                                                          int(first.qtype), first.cols)
        return codes, scales, mins, ZERO_POINTS.get(first.qtype, 0)


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
