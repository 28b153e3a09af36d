"""The floors a decode step is quoted against, measured in the same run as the step.

Matrix products: every decode step multiplies each row's activations by every weight matrix
(q/k/v, o, gate, up, down per layer, then the LM head). The floor is the fastest way this host
has to compute them: the model's own modules (its format and kernel tier), or the same shapes as
dense fp32 or dense bf16 GEMMs, whichever is quickest, so a slow format cannot hide behind a
floor timed with its own slow products. Bandwidth: the same step must read
every byte of those weights once, so bytes / the machine's read bandwidth bounds it too
(the bound that matters at few rows, where the products are memory-bound). A mixture of experts
reads its routed experts only: at batch 1, ``experts_per_tok`` of each layer's experts.

On a GPU the products are timed as eager launches, so their launch costs are in the floor:
a replayed CUDA graph pays none and can come in under it (x_floor below 1).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from compile.common import median_seconds
from nanoserve.model.network.experts import ExpertMLP, PackedExperts, activation_bits
from nanoserve.worker import huge_pages


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (0 where it reports none)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


# Four times the last-level cache and at least 1 GiB, so the read comes from memory (a 480 MB L3
# holds a whole small model).
READ_BYTES = max(1 << 30, 4 * last_level_cache_bytes())


def matmul_modules(model) -> list[nn.Module]:
    """Every linear layer a decode step runs, in order (the LM head apart: see ``head_module``);
    a mixture-of-experts layer's router and shared expert (its experts: ``routed_expert_bytes``)."""
    modules = []
    for layer in model.layers:
        mlp = layer.mlp
        modules += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if isinstance(mlp, ExpertMLP):
            modules.append(mlp.gate)
            if mlp.shared_expert is None:
                continue
            mlp = mlp.shared_expert
        gate_up = [m for m in (mlp.gate_proj, mlp.up_proj, mlp.gate_up_proj) if m is not None]  # fused when packed
        modules += [*gate_up, mlp.down_proj]
    return modules


def routed_expert_bytes(model, rows: int) -> int:
    """Bytes of expert weights a step of ``rows`` rows reads at least: each row's experts, as
    many distinct experts as the rows can route to (every expert of a layer has the same size)."""
    total = 0
    for layer in model.layers:
        if isinstance(layer.mlp, ExpertMLP):
            experts = layer.mlp.experts
            held = sum(t.nbytes for t in [*experts.parameters(), *experts.buffers()])
            total += held * min(experts.num_experts, rows * layer.mlp.top_k) // experts.num_experts
    return total


def head_module(model) -> nn.Module:
    """The module holding the LM head's weights (the embedding when they are tied)."""
    return model.embed_tokens if model.lm_head is None else model.lm_head


def step_weight_bytes(model, rows: int) -> int:
    """Bytes of weights one decode step of ``rows`` rows reads: every tensor the linear layers
    and the LM head hold, in the format they are resident in (fp32, bf16, int8 codes and
    scales, packed int4 and its scales and zeros). A packed layer that also keeps a bf16 copy
    for large row counts (``dense`` from ``dense_from_rows`` rows on) reads one or the other."""
    tensors = {}
    for module in [*matmul_modules(model), head_module(model)]:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if _read_at(module, name, rows):
                tensors[tensor.data_ptr()] = tensor.nbytes  # a tensor shared by two modules counts once
    return sum(tensors.values()) + routed_expert_bytes(model, rows)


def packed_read_bytes(linear) -> int:
    """What one product of a packed linear (a GroupLinear on nanoserve's kernels) reads: its codes,
    scales and minimums."""
    return linear.codes.nbytes + linear.scales.nbytes + linear.mins.nbytes


def step_multiply_adds(model) -> int:
    """The integer multiply-adds of one batch-1 decode step's products: each weight of the linear
    layers, the LM head and the routed experts times the row, twice through nanoserve's kernels
    with 16-bit activations (hi and lo codes), once with 8-bit ones (a one-row step's
    ``activation_bits``) or dense."""
    total = 0
    for module in [*matmul_modules(model), head_module(model)]:
        parts = getattr(module, "parts", None) or [getattr(module, "table", module)]  # ConcatLinear, GroupEmbedding
        for part in parts:
            total += part.out_features * part.in_features * _passes(part)
    for layer in model.layers:
        if isinstance(layer.mlp, ExpertMLP):
            experts = layer.mlp.experts
            # packed: its width and activation bits; dense: gate_proj [E, width, hidden], float products
            width = experts.intermediate if isinstance(experts, PackedExperts) else experts.gate_proj.shape[1]
            passes = _passes(experts) if isinstance(experts, PackedExperts) else 1
            total += layer.mlp.top_k * 3 * layer.mlp.gate.in_features * width * passes
    return total


def _passes(module: nn.Module) -> int:
    """How many integer multiply-adds a weight of ``module`` costs a batch-1 step: 2 with 16-bit
    activations, 1 with 8-bit ones or a dense weight."""
    if not hasattr(module, "a8_from_rows"):
        return 1
    return activation_bits(1, module.a8_from_rows) // 8


def _read_at(module: nn.Module, tensor_name: str, rows: int) -> bool:
    if getattr(module, "dense", None) is None:
        return True
    dense_rows = rows >= module.dense_from_rows
    return tensor_name in ("dense", "bias") if dense_rows else tensor_name != "dense"


def activation_dtype(model) -> torch.dtype:
    """The dtype of the hidden states between layers (the final norm's weight holds it)."""
    return model.norm.weight.dtype


@torch.inference_mode()
def matmul_floor_seconds(model, rows: int, repeats: int = 10) -> float:
    """Median time of one step's matrix products for ``rows`` rows: the fastest of the model's own
    linear modules and LM head (each weight format timed with its own kernels) and dense fp32 and
    bf16 GEMMs of the same shapes."""
    modules = matmul_modules(model)
    device = model.norm.weight.device
    dtype = activation_dtype(model)
    # One input per distinct in-feature count, so each product has its real shape.
    inputs = {m: torch.randn(rows, m.in_features, dtype=dtype, device=device) for m in modules}
    hidden = torch.randn(rows, model.config.hidden_size, dtype=dtype, device=device)

    def own() -> None:
        for module, x in inputs.items():
            module(x)
        model.compute_logits(hidden)

    own()
    times = [median_seconds(own, repeats, device)]
    shapes = [(m.out_features, m.in_features) for m in modules]
    shapes.append((model.config.vocab_size, model.config.hidden_size))
    for dense_dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k, dtype=dense_dtype, device=device) for n, k in shapes]
        xs = [torch.randn(rows, k, dtype=dense_dtype, device=device) for _, k in shapes]

        def dense(weights=weights, xs=xs) -> None:
            for w, x in zip(weights, xs):
                torch.nn.functional.linear(x, w)

        dense()
        times.append(median_seconds(dense, repeats, device))
        del weights, xs
    return min(times)


def read_buffer(num_bytes: int) -> torch.Tensor:
    """A tensor to time reads of: on transparent huge pages where the host offers them, as the
    engine's weights are (on 4 KB pages a virtual machine's page walks hold the stream below the
    memory's rate), its pages mapped before any timing."""
    if huge_pages.available():
        mapping, start = huge_pages.huge_page_arena(num_bytes)
        data = torch.frombuffer(mapping, dtype=torch.float32, count=num_bytes // 4, offset=start).fill_(1.0)
    else:
        data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()
    return data


def read_bandwidth(num_bytes: int = READ_BYTES, repeats: int = 7) -> float:
    """The host's read bandwidth in bytes/s: the median time to sum a tensor that fits in no cache."""
    data = read_buffer(num_bytes)
    return data.nbytes / median_seconds(data.sum, repeats, data.device)


# A read sampled between steps: four times the last-level cache, and at least 256 MB.
SAMPLE_BYTES = max(256 << 20, 4 * last_level_cache_bytes())


class ReadSampler:
    """One timed read of ``data`` (a ``read_buffer``) per ``step()``: an arm of an interleaved
    pass (compile/interleave.py), so each sample sees the machine state of the steps beside it. A
    shared VM's memory can read at half speed for tens of seconds and then at full speed again
    (seen on the 2-core Zen 4 VM: 31-37 GB/s, then 56-66), so a floor timed once, before or
    after a pass, can belong to another phase than the steps it is quoted against."""

    done = True  # it samples while the other arms step and never holds the pass back
    tokens: list[list[int]] = []

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.seconds: list[float] = []

    def step(self) -> None:
        started = time.perf_counter()
        self.data.sum()
        self.seconds.append(time.perf_counter() - started)

    @property
    def decode_steps(self) -> list[float]:
        return self.seconds[1:]  # the first sat beside the prefill, which the engines leave out too


def step_cache_bytes(engine, rows: int, context: float) -> int:
    """Bytes of K/V cells one decode step of ``rows`` rows reads at ``context`` positions a row:
    each layer's cells of every K/V head, a sliding layer's last ``window`` only, in the pool's
    formats (q8_0 with its steps). At a 32-token prompt a 1B step's are under 1% of its weights';
    at thousands they are a large part of what a step must read."""
    config = engine.model.config
    k_format, v_format = engine.worker.cache.layers.formats
    per_cell = config.num_kv_heads * (k_format.bytes_per_head(config.head_dim) + v_format.bytes_per_head(config.head_dim))
    cells = sum(min(context, config.layer_window(layer) or context) for layer in range(config.num_layers))
    return int(rows * cells * per_cell)


def x_read_floor(steps: list[float], reads: list[float], read_bytes: int, weight_bytes: int) -> float:
    """The median over neighbouring pairs of a step over its floor, its weight bytes at the rate
    of the read beside it (``ReadSampler``: both seen in one machine state)."""
    return statistics.median(step * read_bytes / (read * weight_bytes) for step, read in zip(steps, reads))
