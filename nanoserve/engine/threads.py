"""How many CPU threads the engine computes on: one setting for torch's ops and nanoserve's CPU
kernels, which split their work with at::parallel_for over torch's OpenMP threads (the kernel
tiers themselves are single-threaded). Process-wide, as llama.cpp's -t."""

from __future__ import annotations


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: leave them as they are, by default one
    per core torch found); returns the count now in effect. A thread that starts later (the
    server's engine loop) takes the same count on its first parallel op."""
    import torch  # the command line calls this after parsing, before the model loads

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
