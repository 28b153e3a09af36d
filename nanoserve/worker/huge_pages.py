"""A loaded model's large tensors moved onto memory advised for transparent huge pages.

A decode step streams every weight once. On 4 KB pages that is a TLB miss every 64 cache lines,
and in a virtual machine each miss is a two-level page walk, enough to hold a stream well below
the memory's rate (the README's session 15 figures, under Measured). Linux backs an anonymous
mapping with 2 MB pages where it is told to (``madvise(MADV_HUGEPAGE)``), which its default
setting ("madvise") needs; torch's allocator does not ask. So a loaded model's tensor storages of
at least a small page that torch's allocator owns (not a file's mapped bytes) are copied, one at
a time, into one such mapping (an arena: a 2 MB page of slack in all, not per tensor) and every
parameter and buffer that viewed one is pointed at the copy. The small ones matter too: a
product streams its scales beside its codes, and a 1B step's scale tensors (128 KB to 1 MB each)
left on small pages held its products 8-15% slower (the README's session 18 figures). Elsewhere
(no MADV_HUGEPAGE, transparent huge pages compiled out) nothing moves.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import mmap
from collections import defaultdict

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each storage starts on its own small page: no two share a cache line


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_arena(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of at least `nbytes` advised for huge pages, and the offset in it of
    its first 2 MB boundary (where the arena starts)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: its faults then take 2 MB pages
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, -address % HUGE_PAGE


def arena_slices(nbytes: list[int]) -> list[torch.Tensor] | None:
    """Byte tensors of these sizes, each starting on its own small page of one huge-page arena
    (nothing is touched yet: a slice takes its memory as it is first written), or None where
    the host cannot advise huge pages."""
    if not available():
        return None
    sizes = [-(-n // ALIGN) * ALIGN for n in nbytes]
    try:
        mapping, start = huge_page_arena(sum(sizes))
    except OSError:  # the kernel refuses the advice
        return None
    offsets = itertools.accumulate(sizes[:-1], initial=start)
    return [torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=at) for n, at in zip(nbytes, offsets)]


def _movable(t: torch.Tensor, min_bytes: int) -> bool:
    storage = t.untyped_storage()
    # resizable: torch's allocator owns the bytes (a tensor over a mapped file's bytes is not)
    return t.device.type == "cpu" and storage.nbytes() >= min_bytes and storage.resizable()


def move_to_huge_pages(model: nn.Module, min_bytes: int = ALIGN) -> int:
    """Moves the model's parameter and buffer storages of at least `min_bytes` that torch's
    allocator owns into one huge-page arena, keeping every alias (tied weights, views) an alias.
    Returns the bytes moved (0 where the host cannot advise huge pages). Each old storage is
    freed as soon as its tensors point at the copy, so the peak is the model plus one storage."""
    holders: dict[int, list[tuple[nn.Module, str, bool]]] = defaultdict(list)
    storages: dict[int, torch.UntypedStorage] = {}
    for module in model.modules():
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None and _movable(t, min_bytes):
                    key = t.untyped_storage().data_ptr()
                    storages[key] = t.untyped_storage()
                    holders[key].append((module, name, is_param))
    copies = arena_slices([s.nbytes() for s in storages.values()]) if storages else None
    if copies is None:
        return 0
    moved = 0
    for key, copy in zip(list(storages), copies):
        nbytes = storages[key].nbytes()
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storages.pop(key), 0, (nbytes,), (1,)))
        for module, name, is_param in holders.pop(key):
            old = (module._parameters if is_param else module._buffers)[name]
            view = torch.empty(0, dtype=old.dtype).set_(copy.untyped_storage(), old.storage_offset(),
                                                        old.size(), old.stride())
            if is_param:
                old.data = view  # the Parameter object stays: tied parameters stay one
            else:
                module._buffers[name] = view
        moved += nbytes
    return moved


def zeros_on_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Zeroed tensors of these shapes and dtypes, each on its own small page in one arena advised
    for huge pages (the K/V pool: a step reads each live row's cells), or None where the host
    cannot advise them. Written once here, as torch.zeros would: the memory is taken at start (a
    pool too large for the host fails now, not once rows fill it), and the faults take 2 MB pages."""
    slices = arena_slices([math.prod(shape) * dtype.itemsize for shape, dtype in specs])
    if slices is None:
        return None
    return [bytes_.zero_().view(dtype).view(shape) for bytes_, (shape, dtype) in zip(slices, specs)]
