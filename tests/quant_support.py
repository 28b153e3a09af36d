"""What the tests read back of a packed layer: its codes unpacked, and the numbers the kernels
multiply them by."""

from __future__ import annotations

import torch

from nanoserve.model.quant import cpu_kernels


def unpack_codes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Packed codes (4, 5, 6 or 8 bits, from their count) back as [N, K] uint8."""
    return cpu_kernels.STORAGE[8 * codes.numel() // (n * k)][1](codes, n, k)


def held_numbers(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A GroupLinear's scales and minimums as our kernels read them, fp32 [N, K / group] each (a
    symmetric format's minimums from its zero point; a code table's format has none: zeros)."""
    scales = cpu_kernels.per_group(layer.scales)
    if cpu_kernels.is_code_table(layer.mins):
        return scales, torch.zeros_like(scales)
    return scales, -layer.zero_point * scales if layer.zero_point else cpu_kernels.per_group(layer.mins)
