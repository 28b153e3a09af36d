"""gguf_pack.cpp's vectorised path: its decoders read the same codes as the scalar ones, byte
for byte, for every block type, and packing stacked parts in one pass lays out the same bytes as
packing their unpacked codes (pack_groups; the table types: their nibbles, numbers and table),
at widths that are no multiple of a super-block where the type allows it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from compile.model_files import random_blocks
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.gguf_blocks import (
    CODE_BITS,
    IQ4_VALUES,
    MXFP4_VALUES,
    PACKED_TYPES,
    BlockTensor,
    StackedBlocks,
)

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_kernels._ops_loaded(), reason="nanoserve's CPU ops did not build on this host")
TYPES = sorted(PACKED_TYPES, key=lambda q: q.value)
# The types packed as the file's nibbles with a code table in place of the mins.
TABLED = {Q.IQ4_NL: IQ4_VALUES, Q.IQ4_XS: IQ4_VALUES, Q.MXFP4: MXFP4_VALUES}
# Each type's codes as read (before any widening to the storage bits): Q3_K's are 3 bits (q + 4 h),
# the table types' the file's 4-bit nibbles.
READ_BITS = {**CODE_BITS, Q.Q3_K: 3, **dict.fromkeys(TABLED, 4)}


def _widths(qtype: Q) -> tuple[int, ...]:
    """Row widths to try: one block, a few blocks that are no multiple of 256 (blocks of 32),
    several super-blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    return (32, 96, 160, 1024) if block == 32 else (256, 768)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_vectorised_decoders_read_the_scalar_decoders_codes(qtype):
    rng = np.random.default_rng(int(qtype))
    for cols in _widths(qtype):
        rows = 67  # any count: the decoders go row by row
        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        data = np.frombuffer(rng.bytes(rows * cols // block_weights * block_bytes), dtype=np.uint8).reshape(rows, -1)
        fast = cpu_kernels.gguf_codes(data, int(qtype), rows, cols)
        scalar = cpu_kernels.gguf_codes(data, int(qtype), rows, cols, scalar=True)
        assert fast.shape == (rows, cols) and torch.equal(fast, scalar), cols
    # Random bytes reach every code value of the type (at the widest width tried).
    assert set(scalar.unique().tolist()) == set(range(2 ** READ_BITS[qtype]))


def test_the_decoders_refuse_a_row_of_no_whole_number_of_blocks():
    with pytest.raises(RuntimeError, match="no whole number of blocks"):
        cpu_kernels.gguf_codes(np.zeros(144, dtype=np.uint8), int(Q.Q4_K), 1, 128)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_stacked_parts_pack_in_one_pass_as_their_unpacked_codes(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    for cols in _widths(qtype)[1:]:
        parts = tuple(BlockTensor(qtype, random_blocks(qtype, rows, cols, rng), rows, cols,
                                  rng.permutation(rows) if ordered else None)
                      for rows, ordered in ((32, True), (16, False), (48, True)))
        stacked = StackedBlocks(parts)
        want = stacked.group_codes()
        got = stacked.pack()
        if qtype in TABLED:  # the nibbles as they are read, the numbers as they are, the table
            nibbles = torch.cat([cpu_kernels.gguf_codes(p.data if p.row_order is None else p.data[p.row_order],
                                                        int(qtype), p.rows, cols) for p in parts])
            assert torch.equal(got[0], cpu_kernels.pack_nibbles(nibbles)), cols
            assert torch.equal(cpu_kernels.per_group(got[1]), want.scales), cols
            assert torch.equal(got[2], torch.from_numpy(TABLED[qtype]).to(torch.int8)) and got[3] == 0
            continue
        packed = cpu_kernels.pack_groups(want.codes, want.scales, want.mins, want.bits, want.scale_factors,
                                         want.min_factors)
        for name, a, b in zip(("codes", "scales", "mins"), packed[:3], got[:3]):
            assert a.dtype == b.dtype and torch.equal(a, b), (cols, name)
        assert packed[3] == got[3]


def test_pack_refuses_parts_without_a_row_count_and_order_each():
    blocks = torch.zeros(16 * 18, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="one row count and one row order per part"):
        torch.ops.nanoserve.pack_gguf([blocks, blocks], int(Q.Q4_0), [16], 32, [torch.empty(0, dtype=torch.int64)])
