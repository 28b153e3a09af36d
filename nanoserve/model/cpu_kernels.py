"""nanoserve's CPU kernels: group-wise int4 and int8 weight products and the decode attention
read, in one tier per instruction set, chosen at run time.

``torch.ops.nanoserve.int4_mm(x, codes, scales, mins, tier)`` and ``int8_mm`` compute ``x @ w.T``
for bf16 or fp32 ``x`` [M, K] with ``w[n, k] = scales[n, k // 32] * c[n, k] + mins[n, k // 32]``:
each activation is written per group of 32 as two int8 codes and multiplied with the weight
codes in integers, reading 4 (or 8) bits per weight plus two fp16 numbers per group (held as
int16 bits); each block of 16 outputs is read from memory once for all rows.
``torch.ops.nanoserve.decode_attention(q, k_cache, v_cache, slots, lens, scale, tier, window=0)`` is
the decode read of K/V: each row's query heads over its first ``lens`` cells, through its slots
(a sliding-window layer's ``window``: over the last ``window`` of them).

The tiers (``kernels/``, one source tree): ``avx512-vnni`` (vpdpbusd on 512 bits), ``avx-vnni``
(vpdpbusd on 256 bits), ``avx2`` (vpmaddubsw + vpmaddwd), ``neon-dot`` (sdot), ``neon``
(smull + sadalp) and ``scalar`` (plain C++, the reference every tier is tested against), plus
``torch``: torch's int4 kernel and SDPA, no library of ours. Each tier is a shared library built
with its own explicit instruction flags (never ``-march=native``: the build cache is keyed by
source and flags, not by the CPU), the first time it is used (a few seconds, kept under torch's
extension directory), and loaded only where the CPU has those instructions, as cpuid / hwcaps
report them. ``NANOSERVE_CPU_KERNELS=auto|<tier>`` forces a tier the host can run; ``auto`` takes
the best vector tier, and ``torch`` where none builds.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
GROUP_SIZE = 32  # kernels/common.h's GROUP: the group of every packed format here
HERE = Path(__file__).parent
KERNELS = HERE / "kernels"
ENV = "NANOSERVE_CPU_KERNELS"


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
    """Build and register the torch ops (cpu_ops.cpp, no instruction flags) once per process."""
    from torch.utils.cpp_extension import load
    # torch's build cache keys on the source and flags: the shared header's hash, passed as a
    # define, rebuilds the ops when the table they read changes.
    header = hashlib.sha256((KERNELS / "common.h").read_bytes()).hexdigest()[:12]
    # -fopenmp: at::parallel_for is inline and splits the work over torch's OpenMP threads only
    # where the caller is built with OpenMP (without it, one thread). A compiler without OpenMP
    # (Apple's clang) still gets the kernels, on one thread, and says so.
    for openmp in (["-fopenmp"], []):
        try:
            load("nanoserve_cpu_ops", [str(HERE / "cpu_ops.cpp")], extra_include_paths=[str(HERE)],
                 extra_cflags=["-O2", *openmp, f"-DNANOSERVE_COMMON_H={header}"], extra_ldflags=["-ldl", *openmp],
                 is_python_module=False)
            break
        except Exception as error:  # no compiler, or one without OpenMP
            if not openmp:
                log.warning("nanoserve's CPU kernels did not build (%s); using torch's kernels", error)
                return False
            log.warning("nanoserve's CPU kernels did not build with OpenMP (%s); trying one thread", error)
    for op in ("int4_mm", "int8_mm"):
        torch.library.register_fake(f"nanoserve::{op}")(_output_like)
    torch.library.register_fake("nanoserve::decode_attention")(_attention_output_like)
    torch.library.register_fake("nanoserve::dequantize")(_dequantized_like)
    torch.library.register_fake("nanoserve::dequantize_rows")(_rows_like)
    return True


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


def _build(tier: Tier) -> Path:
    """The tier's shared library, compiled once per source and flags into torch's extension
    directory (written under a temporary name and renamed, so a concurrent build never reads half
    a file)."""
    from torch.utils.cpp_extension import get_default_build_root
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", *tier.flags]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (version, compiler, *flags):
        digest.update(part.encode())
    for file in sorted(KERNELS.glob("*")):
        digest.update(file.name.encode() + file.read_bytes())
    out = Path(get_default_build_root()) / "nanoserve_tiers" / f"{tier.name}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / out.name
            subprocess.run([compiler, *flags, str(KERNELS / tier.source), "-o", str(built)], check=True,
                           capture_output=True, text=True)
            os.replace(built, out)
    return out


def _output_like(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 tier: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], 16 * scales.shape[0]))


def _dequantized_like(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int, k: int, nibbles: bool,
                      dtype: torch.dtype, tier: int) -> torch.Tensor:
    return codes.new_empty((n, k), dtype=dtype)


def _rows_like(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, rows: torch.Tensor, n: int, k: int,
               nibbles: bool, dtype: torch.dtype, tier: int) -> torch.Tensor:
    return codes.new_empty((*rows.shape, k), dtype=dtype)


def _attention_output_like(q: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """[N, G] per-group numbers as the kernel reads them: fp16 [N / 16, G, 16], held as int16 bits
    so that casting the model to another float dtype leaves them as they are."""
    n, groups = values.shape
    return values.view(n // 16, 16, groups).transpose(1, 2).half().contiguous().view(torch.int16)


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


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w = (q - 8) * scales + zeros`` (q [N, K], scales/zeros [N, K / 32]) as (codes, scales, mins)."""
    return pack_nibbles(q), _per_block(scales), _per_block(zeros - 8 * scales)


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w = codes * scales`` (codes [N, K] int8, scales [N, K / 32]) as unsigned codes + 128,
    scales and mins ``-128 * scales``."""
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    return pack_bytes(unsigned), _per_block(scales), _per_block(-128 * scales)
