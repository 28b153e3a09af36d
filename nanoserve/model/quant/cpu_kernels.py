"""nanoserve's CPU kernels: group-wise weight products and the decode attention read, in one
tier per instruction set, chosen at run time.

``torch.ops.nanoserve.group_mm(x, codes, scales, mins, zero_point, tier, x_bits=16)`` computes ``x @ w.T``
for bf16 or fp32 ``x`` [M, K] with ``w[n, k] = scales[n, k // g] * c[n, k] + mins[n, k // g]``
(a symmetric format stores no mins: ``mins = -zero_point * scales``), unsigned codes
c stored in 4 bits (two a byte), 5 or 6 (a nibble and a bit plane, or crumbs of 2 bits) or 8 (a byte each),
scale groups of g = 32 or 16 weights along K,
scales and minimums in fp16 or fp32 (held as int16 or int32 bits): the format follows from the
tensors' sizes and dtypes (``pack_groups``). A GGUF's table types (``pack_gguf``) pass 16 int8
values in the mins' place, ``w = scale * table[c]`` for 4-bit codes c, and MXFP4's scales as
exponent bytes (uint8, 2^(e - 128)). Each activation is written per group of 32 as two
int8 codes (``x_bits`` 16) and multiplied with the weight codes in integers, or with ``x_bits``
8 as one code, a step per 16 in sixteenths of its group of 32's max |x| / 127 (llama.cpp's
q8_0 activations have one per 32): each weight code multiplied once, not twice; each block of
16 outputs is read from memory once for all rows.
``torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, slots, lens, scale, tier, window=0, sinks=None,
k_scales=None, v_scales=None)`` is the decode read of K/V: each row's query heads over its first
``lens`` cells, through its slots (a sliding-window layer's ``window``: over the last ``window`` of
them); K and V cells each in q's dtype, or q8_0 (int8 codes and fp16 ``*_scales``, one per 32).
``torch.ops.nanoserve.experts_mm(x, ids, codes, scales, mins, zero_point, tier, x_bits=16)`` is a
mixture-of-experts step's every routed product in one call: experts stacked along a leading
dimension, ``ids`` [rows, top_k], out [rows, top_k, N] with ``out[r, s]`` expert ``ids[r, s]``
times ``x[r]`` (or ``x[r * top_k + s]``, a row per pair); each expert's block of codes is read
once for all of its rows.

The tiers (``kernels/``, one source tree): ``avx512-vnni`` (vpdpbusd on 512 bits), ``avx-vnni``
(vpdpbusd on 256 bits), ``avx2`` (vpmaddubsw + vpmaddwd), ``neon-dot`` (sdot), ``neon``
(smull + sadalp) and ``scalar`` (plain C++, the reference every tier is tested against), plus
``torch``: torch's int4 kernel and SDPA, no library of ours. Each tier is a shared library built
with its own explicit instruction flags (never ``-march=native``: the build cache is keyed by
source and flags, not by the CPU), the first time it is used (about a minute a tier with g++ on 2
cores, kept under torch's extension directory), and loaded only where the CPU has those
instructions, as cpuid / hwcaps report them. ``NANOSERVE_CPU_KERNELS=auto|<tier>`` forces a tier
the host can run; ``auto`` takes the best vector tier, and ``torch`` where none builds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)
GROUP_SIZE = 32  # kernels/common.h's GROUP: the activations' group; a weight's scale group is 32 or 16
HERE = Path(__file__).parent
KERNELS = HERE / "kernels"
ENV = "NANOSERVE_CPU_KERNELS"
# The torch ops library's sources (pyproject's package data ships each of them).
OPS_SOURCES = (HERE / "cpu_ops.cpp", HERE / "gguf_pack.cpp", HERE.parent.parent / "worker" / "sample_rows.cpp")


@dataclass(frozen=True)
class Tier:
    """One kernel tier: its source, the defines and flags it is built with, the CPU features it
    needs (cpu_features' names) and the architecture it belongs to."""

    name: str
    arch: str  # "x86_64", "aarch64" or "any"
    source: str
    flags: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


_X86 = ("-mf16c", "-mfma")
TIERS = {t.name: t for t in (
    Tier("avx512-vnni", "x86_64", "vector.cpp",
         ("-DNANOSERVE_TIER_AVX512_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", *_X86),
         ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c", "fma")),
    Tier("avx-vnni", "x86_64", "vector.cpp", ("-DNANOSERVE_TIER_AVX_VNNI", "-mavx2", "-mavxvnni", *_X86),
         ("avx2", "avxvnni", "f16c", "fma")),
    Tier("avx2", "x86_64", "vector.cpp", ("-DNANOSERVE_TIER_AVX2", "-mavx2", *_X86), ("avx2", "f16c", "fma")),
    Tier("neon-dot", "aarch64", "vector.cpp", ("-DNANOSERVE_TIER_NEON_DOT", "-march=armv8.2-a+dotprod"),
         ("neon", "dotprod")),
    Tier("neon", "aarch64", "vector.cpp", ("-DNANOSERVE_TIER_NEON", "-march=armv8-a"), ("neon",)),
    Tier("scalar", "any", "reference.cpp"),
)}
# Best first: what ``auto`` tries. ``scalar`` is the reference, run only when asked for: where no
# vector tier runs, torch's kernel is faster.
PREFERENCE = ("avx512-vnni", "avx-vnni", "avx2", "neon-dot", "neon")
CHOICES = ("auto", *TIERS, "torch")
# Tiers whose CPUs compute bf16 natively when they have the feature: there activations and K/V
# are bf16; everywhere else (and under a tier forced below the host's) fp32.
_BF16_FEATURES = {"avx512-vnni": ("avx512bf16", "amx-bf16"), "neon-dot": ("bf16",)}


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.cache
def _ops_loaded() -> bool:
    """Build and register the torch ops (OPS_SOURCES, no instruction flags) once per process:
    cpu_ops.cpp, the GGUF packer and the sampler's op (worker/sample_rows.cpp)."""
    from torch.utils.cpp_extension import load
    sources = list(OPS_SOURCES)
    # torch's build cache is a folder per name, rebuilt when another process builds other
    # sources under it: the sources' and the shared header's hash in the name keep two source
    # trees (or versions) from rebuilding each other's library, and the machine in it keeps an
    # x86 and an ARM Python sharing a home (a container, an emulator) from loading each other's.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, KERNELS / "common.h"])).hexdigest()[:12]
    # -fopenmp: at::parallel_for is inline and splits the work over torch's OpenMP threads only
    # where the caller is built with OpenMP (without it, one thread). A compiler without OpenMP
    # (Apple's clang) still gets the kernels, on one thread, and says so.
    for openmp in (["-fopenmp"], []):
        try:
            load(f"nanoserve_cpu_ops_{_machine()}_{digest}", [str(p) for p in sources], extra_include_paths=[str(HERE)],
                 extra_cflags=["-O2", *openmp], extra_ldflags=["-ldl", *openmp], is_python_module=False)
            break
        except Exception as error:  # no compiler, or one without OpenMP
            if not openmp:
                log.warning("nanoserve's CPU kernels did not build (%s); using torch's kernels", error)
                return False
            log.warning("nanoserve's CPU kernels did not build with OpenMP (%s); trying one thread", error)
    torch.library.register_fake("nanoserve::group_mm")(_output_like)
    torch.library.register_fake("nanoserve::experts_mm")(_experts_output_like)
    torch.library.register_fake("nanoserve::decode_attention")(_attention_output_like)
    torch.library.register_fake("nanoserve::dequantize")(_dequantized_like)
    torch.library.register_fake("nanoserve::dequantize_rows")(_rows_like)
    return True


def ops_available() -> bool:
    """Whether nanoserve's torch ops library built and registered here (built on first use)."""
    return _ops_loaded()


@functools.cache
def host_features() -> frozenset[str]:
    """The CPU's instruction-set features as the kernel tiers name them (empty without a compiler)."""
    if not _ops_loaded():
        return frozenset()
    return frozenset(f for f in torch.ops.nanoserve.cpu_features().split(",") if f)


def host_can_run(tier: str) -> bool:
    if tier == "torch":
        return True
    spec = TIERS[tier]
    if spec.arch not in ("any", _machine()):
        return False
    return _ops_loaded() and all(f in host_features() for f in spec.needs)


def host_tiers() -> list[str]:
    """Every tier this host can run, best first, the reference and torch's last."""
    return [t for t in (*PREFERENCE, "scalar", "torch") if host_can_run(t)]


def resolve_tier(choice: str | None = None) -> str:
    """The tier to run: ``choice``, else (None or "auto") $NANOSERVE_CPU_KERNELS, else the best
    vector tier that builds here, else "torch". A tier the host cannot run is refused with a
    ValueError."""
    if choice in (None, "auto"):
        choice = os.environ.get(ENV) or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "auto":
        for tier in PREFERENCE:
            if host_can_run(tier) and handle(tier) is not None:
                return tier
        return "torch"
    if not host_can_run(choice):
        raise ValueError(f"kernel tier {choice!r} needs {', '.join(TIERS[choice].needs) or 'a C++ compiler'} on "
                         f"{TIERS[choice].arch}; this {_machine()} CPU runs: {', '.join(host_tiers())}")
    if choice != "torch" and handle(choice) is None:
        raise ValueError(f"kernel tier {choice!r} did not build here (see the log)")
    return choice


def compute_dtype(tier: str) -> torch.dtype:
    """The activations' and K/V's dtype with packed weights under ``tier``: bf16 where the CPU
    computes it natively (AVX-512 BF16 or AMX; ARM's BF16), fp32 elsewhere. torch's int4 kernel
    runs a reference loop with fp32 activations, so ``torch`` keeps bf16."""
    if tier == "torch":
        return torch.bfloat16
    return torch.bfloat16 if any(f in host_features() for f in _BF16_FEATURES.get(tier, ())) else torch.float32


@functools.cache
def handle(tier: str) -> int | None:
    """The loaded tier's handle for the ops' ``tier`` argument (built on first use), or None
    where it cannot build."""
    if tier == "torch" or not host_can_run(tier):
        return None
    try:
        path = _build(TIERS[tier])
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("nanoserve's %s kernels did not build (%s)", tier, error)
        return None
    index = torch.ops.nanoserve.load_tier(str(path))
    log.info("nanoserve CPU kernels: %s (%s)", tier, path.name)
    return index


def dot_peak_rate(tier: str, seconds: float = 0.3) -> float:
    """The tier's int8 multiply-adds a second on every intra-op thread at once (``dot_peak``: its
    code dots on registers, no memory): what a product's arithmetic cannot beat on this host.
    The median of three timed runs, each about ``seconds / 3`` long."""
    index = handle(tier)
    if index is None:
        raise ValueError(f"kernel tier {tier!r} does not run here")
    rounds = 1 << 12
    while True:  # grow a run until it takes long enough to time
        started = time.perf_counter()
        torch.ops.nanoserve.dot_peak(rounds, index)
        if time.perf_counter() - started >= seconds / 30:
            break
        rounds *= 2
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        done = torch.ops.nanoserve.dot_peak(rounds * 10, index)
        rates.append(done / (time.perf_counter() - started))
    return sorted(rates)[1]


def _build(tier: Tier, kernels: Path = KERNELS) -> Path:
    """The tier's shared library, compiled once per source and flags into torch's extension
    directory (written under a temporary name and renamed, so a concurrent build never reads half
    a file). ``kernels``: the source tree (another revision's, for scripts/kernel_ab.py)."""
    from torch.utils.cpp_extension import get_default_build_root
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", *tier.flags]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (version, compiler, *flags):
        digest.update(part.encode())
    for file in sorted(kernels.glob("*")):
        digest.update(file.name.encode() + file.read_bytes())
    out = Path(get_default_build_root()) / "nanoserve_tiers" / f"{tier.name}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / out.name
            subprocess.run([compiler, *flags, str(kernels / tier.source), "-o", str(built)], check=True,
                           capture_output=True, text=True)
            os.replace(built, out)
    return out


def _output_like(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, zero_point: int,
                 tier: int, x_bits: int = 16) -> torch.Tensor:
    return x.new_empty((x.shape[0], 16 * scales.shape[0]))


def _experts_output_like(x: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                         mins: torch.Tensor, zero_point: int, tier: int, x_bits: int = 16) -> torch.Tensor:
    return x.new_empty((ids.shape[0], ids.shape[1], 16 * scales.shape[1]))


def _dequantized_like(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, zero_point: int, n: int, k: int,
                      dtype: torch.dtype, tier: int) -> torch.Tensor:
    return codes.new_empty((n, k), dtype=dtype)


def _rows_like(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, zero_point: int, rows: torch.Tensor,
               n: int, k: int, dtype: torch.dtype, tier: int) -> torch.Tensor:
    return codes.new_empty((*rows.shape, k), dtype=dtype)


def _attention_output_like(q: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _per_block(values: torch.Tensor, fp32: bool) -> torch.Tensor:
    """[N, H] per-group numbers as the kernel reads them: fp16 or fp32 [N / 16, H, 16], held as
    int16 or int32 bits so that casting the model to another float dtype leaves them as they are."""
    n, groups = values.shape
    blocks = values.view(n // 16, 16, groups).transpose(1, 2)
    return blocks.float().contiguous().view(torch.int32) if fp32 else blocks.half().contiguous().view(torch.int16)


def is_code_table(mins: torch.Tensor) -> bool:
    """Whether a packed weight's ``mins`` are a code table: 16 int8 values its 4-bit codes stand
    for, ``w = scale * table[c]`` (IQ4_NL, IQ4_XS and MXFP4 packed from a GGUF's blocks)."""
    return mins.dtype == torch.int8


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """Exponent bytes e as their scales 2^(e - 128) in fp32 (kernels/common.h's e8m0_half)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def per_group(numbers: torch.Tensor) -> torch.Tensor:
    """The inverse of _per_block (and of _super_records, and of a GGUF packing's exponent bytes
    [N / 16, H, 16] uint8): the kernels' numbers back as fp32 [N, H] (H may be 0)."""
    if numbers.dtype == torch.uint8 and numbers.shape[-1] == 16:  # exponent bytes
        blocks, groups, _ = numbers.shape
        return e8m0_half(numbers).transpose(1, 2).reshape(16 * blocks, groups)
    if numbers.dtype == torch.uint8:  # super-block records
        blocks, supers, size = numbers.shape
        per_super = (size - 32) // 16
        head = numbers[..., :32].contiguous().view(torch.float16).float()  # [blocks, supers, 16]
        rows = numbers[..., 32:].contiguous().view(torch.int8).view(blocks, supers, per_super, 16).float()
        return (head[:, :, None, :] * rows).permute(0, 3, 1, 2).reshape(16 * blocks, supers * per_super)
    blocks, groups, _ = numbers.shape
    values = numbers.view(torch.float32 if numbers.dtype == torch.int32 else torch.float16).float()
    return values.transpose(1, 2).reshape(16 * blocks, groups)


def fp16_holds(values: torch.Tensor) -> bool:
    """Whether every value is finite and exactly an fp16 number."""
    return bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values.float())


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 as the kernels' nibble layout (kernels/common.h), N / 16 * K / 2 bytes."""
    n, k = q.shape
    blocks = q.view(n // 16, 16, k // GROUP_SIZE, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    return (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).to(torch.uint8).contiguous().view(-1)


def unpack_nibbles(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_nibbles: [N, K] uint8 codes."""
    lanes = codes.view(n // 16, k // GROUP_SIZE, 4, 16, 4)
    both = torch.stack([lanes & 15, lanes >> 4], dim=3)  # [blocks, G, 4, 2, 16, 4]
    return both.permute(0, 4, 1, 2, 3, 5).reshape(n, k)


def pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..255 as the kernels' byte layout, N * K bytes."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def unpack_bytes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return codes.view(n // 16, k // GROUP_SIZE, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)


def _bit_plane(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit ``bit`` of each code [N, K] as a bit plane of the 5- and 6-bit layouts: [N / 16, G, 64]
    bytes, bit b of byte 8 v + b // 8 the code in byte b of nibble vector v (kernels/common.h)."""
    n, k = codes.shape
    high = ((codes >> bit) & 1).view(n // 16, 16, k // GROUP_SIZE, 4, 2, 4)  # [blocks, r, G, row, half, i]
    bits = high.permute(0, 2, 3, 4, 1, 5).reshape(-1, 8)  # per byte of the plane: its 8 bits, lowest first
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32)
    return (bits.int() * weights).sum(-1).to(torch.uint8).view(n // 16, k // GROUP_SIZE, 64)


def _from_bit_plane(planes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of _bit_plane: [N, K] bits 0 or 1."""
    bits = planes.reshape(-1, 8, 1) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8) & 1
    return bits.view(n // 16, k // GROUP_SIZE, 4, 2, 16, 4).permute(0, 4, 1, 2, 3, 5).reshape(n, k)


def _crumbs(codes: torch.Tensor) -> torch.Tensor:
    """Bits 4 and 5 of each code [N, K] as the 6-bit layout's crumb vectors: [N / 16, G, 128] bytes,
    bits 2 t, 2 t + 1 of byte b of vector q those of the code in byte b of code vector 4 q + t."""
    n, k = codes.shape
    high = ((codes >> 4) & 3).view(n // 16, 16, k // GROUP_SIZE, 2, 4, 4)  # [blocks, r, G, q, t, i]
    shifted = high.permute(0, 2, 3, 1, 5, 4).to(torch.int32) << (2 * torch.arange(4, dtype=torch.int32))
    return shifted.sum(-1).to(torch.uint8).reshape(n // 16, k // GROUP_SIZE, 128)


def _from_crumbs(crumbs: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of _crumbs: [N, K] values 0..3."""
    shifts = 2 * torch.arange(4, dtype=torch.uint8)
    high = crumbs.reshape(n // 16, k // GROUP_SIZE, 2, 16, 4, 1) >> shifts & 3  # [blocks, G, q, r, i, t]
    return high.permute(0, 3, 1, 2, 5, 4).reshape(n, k)


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] below 2 ** bits (5 or 6) as the kernels' layout: per group the low nibbles, then
    the fifth bits' plane (5 bits) or the crumbs of the fifth and sixth (6 bits), N / 16 * K / 32 *
    64 * bits bytes."""
    n, k = codes.shape
    nibbles = pack_nibbles(codes & 15).view(n // 16, k // GROUP_SIZE, 256)
    high = _bit_plane(codes, 4) if bits == 5 else _crumbs(codes)
    return torch.cat([nibbles, high], dim=-1).contiguous().view(-1)


def unpack_planes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    bits = 8 * codes.numel() // (n * k)
    groups = codes.view(n // 16, k // GROUP_SIZE, 64 * bits)
    out = unpack_nibbles(groups[..., :256].contiguous().view(-1), n, k)
    high = _from_bit_plane(groups[..., 256:], n, k) if bits == 5 else _from_crumbs(groups[..., 256:], n, k)
    return out | high << 4


STORAGE = {4: (pack_nibbles, unpack_nibbles), 5: (lambda c: pack_planes(c, 5), unpack_planes),
           6: (lambda c: pack_planes(c, 6), unpack_planes), 8: (pack_bytes, unpack_bytes)}


def storage_bits(bits: int) -> int:
    """The bits a code of ``bits`` bits is stored in: 4, 5, 6, or a byte."""
    return 4 if bits <= 4 else bits if bits <= 6 else 8


def pack_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, scale_factors=None,
                min_factors=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``w = scales * codes + mins`` per scale group (codes [N, K] uint8 below ``2 ** bits``;
    scales and mins [N, K / g] fp32, g = 32 or 16) as (codes, scales, mins, zero point) in the
    kernels' layout, the codes in ``storage_bits(bits)``. A symmetric weight, every minimum
    ``-2 ** (bits - 1)`` times its scale (Q4_0, Q5_0, Q8_0, Q6_K), keeps no minimums: its zero
    point says them. The numbers stay fp16 where every one of them is an fp16 number (a legacy
    GGUF block's d, m); with their K-quant's factors (group_codes.SuperScales: fp16 super-scales times
    int8 multipliers) as super-block records (kernels/common.h); else fp32: exact every way."""
    zero_point = 2 ** (bits - 1)
    if not torch.equal(mins, -zero_point * scales):
        zero_point = 0
    packed = STORAGE[storage_bits(bits)][0](codes)
    needed = [scale_factors] if zero_point else [scale_factors, min_factors]
    if codes.shape[1] % 256 == 0 and all(f is not None and fp16_holds(f.supers) for f in needed):
        records = [_super_records(f) for f in needed]
        return packed, records[0], records[1] if len(records) > 1 else records[0][:, :, :0], zero_point
    fp32 = not (fp16_holds(scales) and (zero_point or fp16_holds(mins)))
    kept = mins[:, :0] if zero_point else mins
    return packed, _per_block(scales, fp32), _per_block(kept, fp32), zero_point


def pack_gguf(blocks: np.ndarray, qtype: int, rows: int, cols: int,
              row_order: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF block tensor's raw bytes [rows, row bytes] (gguf's GGMLQuantizationType ``qtype``)
    as (codes, scales, mins) in the layout ``pack_groups`` makes from its GroupCodes, in one pass
    over the bytes (gguf_pack.cpp); ``row_order``: the file row of each row. The table types
    (IQ4_NL, IQ4_XS, MXFP4) keep the file's nibbles as 4-bit codes, their code table in place of
    the mins (``is_code_table``) and MXFP4's scales as its exponent bytes (``per_group``). The
    bytes are read, never written, so a read-only view of a memory-mapped file serves."""
    return pack_gguf_parts([(blocks, rows, row_order)], qtype, cols)


def pack_gguf_parts(parts: Sequence[tuple[np.ndarray, int, np.ndarray | None]], qtype: int, cols: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tensors of one type and width, each (bytes, rows, row order) as ``pack_gguf`` takes
    one, packed as the one weight they stack into along their rows: written in place, the same
    bytes as packing each and concatenating."""
    if not _ops_loaded():
        raise RuntimeError("nanoserve's CPU ops did not build; unpack the blocks instead (BlockTensor.group_codes)")
    with warnings.catch_warnings():  # a read-only memory map: torch warns that it cannot be written
        warnings.simplefilter("ignore", UserWarning)
        data = [torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1)) for blocks, _, _ in parts]
    orders = [torch.empty(0, dtype=torch.int64) if order is None else
              torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64)) for _, _, order in parts]
    return torch.ops.nanoserve.pack_gguf(data, qtype, [rows for _, rows, _ in parts], cols, orders)


def gguf_codes(blocks: np.ndarray, qtype: int, rows: int, cols: int, scalar: bool = False) -> torch.Tensor:
    """The codes [rows, cols] uint8 that ``pack_gguf`` reads from a block tensor's bytes (a table
    type's nibbles): through its vectorised decoders, or (``scalar``) its scalar reference ones."""
    if not _ops_loaded():
        raise RuntimeError("nanoserve's CPU ops did not build")
    with warnings.catch_warnings():  # read-only bytes: as pack_gguf_parts
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1))
    return torch.ops.nanoserve.gguf_codes(data, qtype, rows, cols, scalar)


def _super_records(factors) -> torch.Tensor:
    """group_codes.SuperScales as the kernels' records [N / 16, K / 256, 32 + 16 S] uint8: per block of
    16 outputs and super-block, the 16 fp16 super-scales, then S rows of 16 int8 multipliers."""
    n, supers = factors.supers.shape
    per_super = factors.multipliers.shape[1] // supers
    head = factors.supers.view(n // 16, 16, supers).transpose(1, 2).half().contiguous().view(torch.uint8)
    rows = factors.multipliers.view(n // 16, 16, supers, per_super).permute(0, 2, 3, 1).contiguous()
    return torch.cat([head, rows.view(torch.uint8).view(n // 16, supers, 16 * per_super)], dim=-1).contiguous()
