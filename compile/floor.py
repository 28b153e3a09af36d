"""The matrix-product floor: a decode step's linear layers alone, with the step's shapes.

Every decode step multiplies each row's activations by every weight matrix (q/k/v, o,
gate, up, down per layer, then the LM head). Nothing an engine does can make a step faster
than those products on the same weights, so each measured step is quoted as a multiple of
this floor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile.report import median_seconds


def matmul_weights(model) -> list[torch.Tensor]:
    """Every matrix a decode step multiplies by, in order."""
    weights = []
    for layer in model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]
    weights.append(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    return weights


@torch.inference_mode()
def matmul_floor_seconds(model, rows: int, repeats: int = 10) -> float:
    """Median time of one step's matrix products for ``rows`` rows."""
    weights = matmul_weights(model)
    device = weights[0].device
    # One input per distinct in-feature count, so each product has its real shape.
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def step() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    step()
    return median_seconds(step, repeats, device)
