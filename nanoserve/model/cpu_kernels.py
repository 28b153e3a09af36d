"""Group-wise int4 and int8 weight products, and decode attention, for AVX-512 VNNI CPUs
(``cpu_kernels.cpp``).

``torch.ops.nanoserve.int4_mm(x, codes, scales, mins)`` and ``int8_mm`` compute ``x @ w.T`` for
bf16 ``x`` [M, K] with ``w[n, k] = scales[n, k // 32] * c[n, k] + mins[n, k // 32]``: each
activation is written per group of 32 as two int8 codes and multiplied with the weight codes
in integers, reading 4 (or 8) bits per weight plus two fp16 numbers per group (held as int16
bits), once for up to eight rows. torch's own int4 kernel converts every weight to float once
per 4 rows, so its cost grows with the rows from the first; on this repository's CPU (the
default model's linears, two threads, compile/results/linear_crossover.csv) this one is
1.0-1.3x faster at one row, 1.3-2.0x at eight and about 2x from 16.
``torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, slots, lens, scale)`` is the decode
read of bf16 K/V: each row's query heads over its first ``lens`` cells, through its slots.

The source is compiled on first use (about 15 s, kept under torch's extension cache,
``TORCH_EXTENSIONS_DIR``). ``available()`` is False where the CPU lacks AVX-512 VNNI or the
build fails; the packed linears then run torch's kernel and decode attention SDPA.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
GROUP_SIZE = 32  # cpu_kernels.cpp's GROUP: the group of every packed format here
SOURCE = Path(__file__).with_suffix(".cpp")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp"]


def _cpu_has_flags() -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in CPU_FLAGS)


@functools.cache
def available() -> bool:
    """Build and register the ops (once per process); False where they cannot run."""
    if not _cpu_has_flags():
        return False
    from torch.utils.cpp_extension import load
    try:
        load("nanoserve_cpu_kernels", [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as error:  # no compiler, or one that lacks these instructions
        log.warning("nanoserve's int4/int8 CPU kernels did not build (%s); using torch's int4 kernel", error)
        return False
    for op in ("int4_mm", "int8_mm"):
        torch.library.register_fake(f"nanoserve::{op}")(_output_like)
    torch.library.register_fake("nanoserve::decode_attention")(_attention_output_like)
    return True


def _output_like(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], 16 * scales.shape[0]))


def _attention_output_like(q: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """[N, G] per-group numbers as the kernel reads them: fp16 [N / 16, G, 16], held as int16 bits
    so that casting the model to another float dtype leaves them as they are."""
    n, groups = values.shape
    return values.view(n // 16, 16, groups).transpose(1, 2).half().contiguous().view(torch.int16)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 as the kernel's nibble layout (cpu_kernels.cpp), N / 16 * K / 2 bytes."""
    n, k = q.shape
    blocks = q.view(n // 16, 16, k // GROUP_SIZE, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    return (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).to(torch.uint8).contiguous().view(-1)


def unpack_nibbles(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_nibbles: [N, K] uint8 codes."""
    lanes = codes.view(n // 16, k // GROUP_SIZE, 4, 16, 4)
    both = torch.stack([lanes & 15, lanes >> 4], dim=3)  # [blocks, G, 4, 2, 16, 4]
    return both.permute(0, 4, 1, 2, 3, 5).reshape(n, k)


def pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..255 as the kernel's byte layout, N * K bytes."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def unpack_bytes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return codes.view(n // 16, k // GROUP_SIZE, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w = (q - 8) * scales + zeros`` (q [N, K], scales/zeros [N, K / 32]) as (codes, scales, mins)."""
    return pack_nibbles(q), _per_block(scales), _per_block(zeros - 8 * scales)


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w = codes * scales`` (codes [N, K] int8, scales [N, K / 32]) as unsigned codes + 128,
    scales and mins ``-128 * scales``."""
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    return pack_bytes(unsigned), _per_block(scales), _per_block(-128 * scales)
