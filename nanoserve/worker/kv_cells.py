"""How a layer's K and V cells are stored, written and read: every access to K/V goes through
``KVLayers``.

A cell is one position's K (or V) of every K/V head, [KV, D]. K and V each have a format:

- dense, in a float dtype (``bf16``, ``fp32``; ``auto`` is the compute dtype), one tensor per
  layer [slots, KV, D];
- ``q8_0``, as llama.cpp's q8_0 blocks: each run of 32 values along the head is held as int8
  codes and one fp16 step, value = code * step, step = max |x| / 127 (8.5 bits a value against
  bf16's 16: ~1.9x the tokens in the same bytes). Two tensors per layer: codes [slots, KV, D]
  int8 and steps [slots, KV, D / 32] fp16.

The CPU kernel tiers read q8_0 cells directly (``decode_attention``'s ``k_scales`` /
``v_scales``); SDPA and the prefill read what they gather dequantised. Writes quantise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.worker.huge_pages import zeros_on_huge_pages

Q8_BLOCK = 32  # values per q8_0 step
DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
NAMES = {dtype: name for name, dtype in DENSE.items()}


@dataclass(frozen=True)
class CellFormat:
    """One of K or V's storage: ``name`` "q8_0", or a dense dtype's ("bf16", "fp32", "fp16")."""

    name: str

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    @property
    def dtype(self) -> torch.dtype:
        """The cells' tensor dtype (q8_0: its codes')."""
        return torch.int8 if self.quantized else DENSE[self.name]

    @property
    def bytes_per_value(self) -> float:
        """Bytes a value costs on average (q8_0: 34 bytes a run of 32)."""
        return (Q8_BLOCK + 2) / Q8_BLOCK if self.quantized else self.dtype.itemsize

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes of one K/V head of one cell."""
        if self.quantized:
            return head_dim + 2 * (head_dim // Q8_BLOCK)
        return head_dim * self.dtype.itemsize


def resolve_cell_format(name: str | None, compute_dtype: torch.dtype, head_dim: int) -> CellFormat:
    """The format ``name`` asks for ("auto" or None: the compute dtype's), checked against the
    head size (q8_0 blocks are 32 values along the head)."""
    if name in (None, "auto"):
        if compute_dtype not in NAMES:
            raise ValueError(f"no K/V cell format for compute dtype {compute_dtype}")
        return CellFormat(NAMES[compute_dtype])
    if name != "q8_0" and name not in DENSE:
        raise ValueError(f"unknown K/V cache type {name!r}: expected auto, bf16, fp32 or q8_0")
    if name == "q8_0" and head_dim % Q8_BLOCK:
        raise ValueError(f"K/V cache type q8_0 needs head_dim a multiple of {Q8_BLOCK}; this model's is {head_dim}")
    return CellFormat(name)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D], steps fp16 [..., D / 32]): per run of 32, the step
    max |x| / 127 and codes round(x / step) (0 where the run is all zeros)."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = torch.round(blocks * inverse).clamp_(-127, 127).to(torch.int8)
    return codes.flatten(-2), step.squeeze(-1).to(torch.float16)


def dequantize_q8_0(codes: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values (codes [..., D], steps [..., D / 32]) hold, in ``dtype``."""
    values = codes.unflatten(-1, (-1, Q8_BLOCK)).float() * steps.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


class KVLayers:
    """Every layer's K and V cells: ``k_cells`` / ``v_cells`` one tensor per layer [slots, KV,
    D] (q8_0: the codes), ``k_steps`` / ``v_steps`` the q8_0 steps per layer [slots, KV, D / 32]
    (empty lists for a dense side). Built from these lists inside a compiled step, so the step's
    inputs stay plain tensors."""

    def __init__(self, k_cells: list[torch.Tensor], v_cells: list[torch.Tensor],
                 k_steps: list[torch.Tensor], v_steps: list[torch.Tensor]) -> None:
        self.k_cells, self.v_cells, self.k_steps, self.v_steps = k_cells, v_cells, k_steps, v_steps

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int | list[int], num_kv_heads: int, head_dim: int,
                 k_format: CellFormat, v_format: CellFormat, device: torch.device,
                 huge_pages: bool = False) -> KVLayers:
        """Zeroed cells: ``num_slots`` in every layer, or layer i's own number (a sliding-window
        layer's rings: window_ring). With ``huge_pages`` (a CPU pool) they lie in memory advised
        for transparent huge pages (huge_pages.zeros_on_huge_pages), where the host allows."""
        # One tensor per layer: when a compiled graph writes a slice of a stacked tensor in
        # place, inductor copies the whole stack every step.
        sizes = num_slots if isinstance(num_slots, list) else [num_slots] * num_layers
        def side(fmt: CellFormat) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:  # cells, steps
            cells = [((n, num_kv_heads, head_dim), fmt.dtype) for n in sizes]
            steps = [((n, num_kv_heads, head_dim // Q8_BLOCK), torch.float16) for n in sizes] if fmt.quantized else []
            return [cells, steps]

        groups = side(k_format) + side(v_format)  # K cells, K steps, V cells, V steps: (shape, dtype) a layer
        specs = [spec for group in groups for spec in group]
        tensors = zeros_on_huge_pages(specs) if huge_pages and torch.device(device).type == "cpu" else None
        made = iter(tensors or [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs])
        k_cells, k_steps, v_cells, v_steps = ([next(made) for _ in group] for group in groups)
        return cls(k_cells, v_cells, k_steps, v_steps)

    @property
    def formats(self) -> tuple[CellFormat, CellFormat]:
        def side(cells: list[torch.Tensor], steps: list[torch.Tensor]) -> CellFormat:
            return CellFormat("q8_0") if steps else CellFormat(NAMES[cells[0].dtype])

        return side(self.k_cells, self.k_steps), side(self.v_cells, self.v_steps)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds K/V (the step marks them static; their bytes are the pool)."""
        return [*self.k_cells, *self.v_cells, *self.k_steps, *self.v_steps]

    def of_layer(self, layer: int) -> list[torch.Tensor]:
        """The tensors holding one layer's K/V."""
        return [tensors[layer] for tensors in (self.k_cells, self.v_cells, self.k_steps, self.v_steps) if tensors]

    def step_args(self) -> tuple[list[torch.Tensor], ...]:
        """The lists a compiled step takes and rebuilds this from (``KVLayers(*args)``)."""
        return self.k_cells, self.v_cells, self.k_steps, self.v_steps

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copy_cells(self, layer: int, src: slice, dst: slice) -> None:
        """Layer ``layer``'s cells ``dst`` become a copy of its cells ``src`` (as long)."""
        for tensor in self.of_layer(layer):
            tensor[dst] = tensor[src]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V [n, KV, D] at ``slots`` [n] (quantised where the side is q8_0)."""
        _store(self.k_cells[layer], _of(self.k_steps, layer), slots, k)
        _store(self.v_cells[layer], _of(self.v_steps, layer), slots, v)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cells at ``slots`` (any shape [...]) as K and V [..., KV, D] in ``dtype``."""
        return (_load(self.k_cells[layer], _of(self.k_steps, layer), slots, dtype),
                _load(self.v_cells[layer], _of(self.v_steps, layer), slots, dtype))

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [..., D] as a read of them once written gives them back (in their own dtype):
        a prefill chunk attending to its own keys sees what later steps will read."""
        k_format, v_format = self.formats
        return round_trip(k, k_format), round_trip(v, v_format)

    def gather(self, layer: int, slot_mapping: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's K and V through its slots: [n, W] -> [n, KV, W, D] in ``dtype`` (one copy,
        the gather, and a transposed view of it)."""
        k, v = self.read(layer, slot_mapping, dtype)
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, layer: int, q: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
               kernel: int, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """The kernel tier's decode read (cpu_kernels' ``decode_attention``) of this layer."""
        return torch.ops.nanoserve.decode_attention(
            q, self.k_cells[layer], self.v_cells[layer], slot_mapping, context_lens, q.shape[-1] ** -0.5, kernel,
            window or 0, sinks, _of(self.k_steps, layer), _of(self.v_steps, layer))


def round_trip(x: torch.Tensor, fmt: CellFormat) -> torch.Tensor:
    """``x`` [..., D] as cells of ``fmt`` hold it, back in x's dtype."""
    if fmt.quantized:
        return dequantize_q8_0(*quantize_q8_0(x), x.dtype)
    return x if fmt.dtype == x.dtype else x.to(fmt.dtype).to(x.dtype)


def _of(steps: list[torch.Tensor], layer: int) -> torch.Tensor | None:
    """A layer's q8_0 steps, or None for a dense side (no steps)."""
    return steps[layer] if steps else None


def _store(cells: torch.Tensor, steps: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
    if steps is None:
        cells.index_copy_(0, slots, x.to(cells.dtype))
        return
    codes, scale = quantize_q8_0(x)
    cells.index_copy_(0, slots, codes)
    steps.index_copy_(0, slots, scale)


def _load(cells: torch.Tensor, steps: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = slots.reshape(-1)
    if steps is None:
        out = cells.index_select(0, flat).to(dtype)
    else:
        out = dequantize_q8_0(cells.index_select(0, flat), steps.index_select(0, flat), dtype)
    return out.view(*slots.shape, *cells.shape[1:])
