"""Megatron-style sharding of a LlamaModel over ``size`` ranks.

Column-parallel (each rank keeps a slice of the output features): the fused q/k/v projection
(the rank's query heads and its K/V heads), gate and up. Row-parallel (a slice of the input
features, the outputs summed by one all-reduce): o_proj and down_proj. The embedding and the
LM head are split over the vocabulary, the last shard padded with zero rows so that every rank
holds the same number; the logits are gathered. Norms (including the per-head q/k norms, whose
one weight serves every head) are replicated.

``shard_weights`` slices a float model before it is packed, so the packing of each shard is
the packing of its slice (int4 groups run along K, so a row-parallel slice cut on a group
boundary keeps every group whole); ``parallelize`` wraps the packed shard's collective edges.
``check_tensor_parallel`` refuses what cannot be cut, before anything is loaded or started.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nanoserve.distributed.layers import GatheredHead, RowParallel, TiedHead, VocabParallelEmbedding
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.quant.cpu_kernels import GROUP_SIZE
from nanoserve.model.quant.group_codes import GroupCodes, SuperScales
from nanoserve.model.quant.weight_plan import WeightPlan


def check_tensor_parallel(config: ModelConfig, size: int, plan: WeightPlan | None) -> None:
    """Raise ValueError naming every reason ``config`` cannot be split over ``size`` ranks in
    ``plan``'s format (None: dense)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    for name, count in (("attention heads", config.num_heads), ("K/V heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % size:
            problems.append(f"{name} ({count}) are not divisible by {size}")
    if plan is not None and plan.format == "int4" and not problems:
        # A row-parallel shard of a group-wise layer must hold whole groups of 32 along K.
        for name, k in (("o_proj", config.q_size), ("down_proj", config.intermediate_size)):
            if k % GROUP_SIZE == 0 and (k // size) % GROUP_SIZE:
                problems.append(f"{name}'s {k} input features split {size} ways ({k // size} each) cut "
                                f"its int4 groups of {GROUP_SIZE}")
    if config.num_experts and size > 1:
        problems.append("its experts are not sharded yet (run a mixture-of-experts model on one rank)")
    if problems:
        raise ValueError(f"cannot shard {config.architecture} over tensor_parallel_size={size}: "
                         + "; ".join(problems))


def check_float_model(model: nn.Module) -> None:
    """Shards are cut from float weights (then packed each on its own): refuse a packed model."""
    if not all(isinstance(layer.mlp.gate_proj, nn.Linear) for layer in model.layers):
        raise ValueError("tensor parallelism shards a float model; this one is packed already (load it again)")


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows) of rank's vocabulary shard; every shard has ceil(vocab / size) rows."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


def shard_weights(model: nn.Module, rank: int, size: int,
                  sources: Mapping[str, GroupCodes] | None = None) -> dict[str, GroupCodes]:
    """Cut a float LlamaModel down to rank's shard, in place; return the GGUF int4 groups
    (HF-named) of the layers it keeps, cut the same way."""
    check_float_model(model)
    config: ModelConfig = model.config
    d = config.head_dim
    heads, kv_heads = config.num_heads // size, config.num_kv_heads // size
    inter = config.intermediate_size // size
    q_rows = torch.arange(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = torch.arange(rank * kv_heads * d, (rank + 1) * kv_heads * d)
    qkv_rows = torch.cat([q_rows, config.q_size + kv_rows, config.q_size + config.kv_size + kv_rows])
    o_cols = slice(rank * heads * d, (rank + 1) * heads * d)
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = _linear(attn.qkv_proj.weight[qkv_rows], _part(attn.qkv_proj.bias, qkv_rows))
        attn.o_proj = _linear(attn.o_proj.weight[:, o_cols], attn.o_proj.bias if rank == 0 else None)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.qk_size, attn.v_size = (heads + kv_heads) * d, kv_heads * d
        mlp = layer.mlp
        mlp.gate_proj = _linear(mlp.gate_proj.weight[mlp_rows], None)
        mlp.up_proj = _linear(mlp.up_proj.weight[mlp_rows], None)
        mlp.down_proj = _linear(mlp.down_proj.weight[:, mlp_rows], None)
    start, rows = vocab_shard(config.vocab_size, rank, size)
    model.embed_tokens = nn.Embedding.from_pretrained(_vocab_rows(model.embed_tokens.weight, start, rows),
                                                      freeze=True)
    if model.lm_head is not None:
        head = model.lm_head
        bias = None if head.bias is None else _vocab_rows(head.bias[:, None], start, rows)[:, 0]
        model.lm_head = _linear(_vocab_rows(head.weight, start, rows), bias)
    return _shard_sources(sources or {}, config, qkv_parts=(q_rows, kv_rows, kv_rows), o_cols=o_cols,
                          mlp_rows=mlp_rows)


def parallelize(model: nn.Module, rank: int, size: int, group) -> None:
    """Wrap a packed shard's collective edges (layers.py), in place."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    embedding = model.embed_tokens
    start, rows = vocab_shard(model.config.vocab_size, rank, size)
    model.embed_tokens = VocabParallelEmbedding(embedding, start, rows, group)
    head = model.lm_head if model.lm_head is not None else TiedHead(embedding)
    model.lm_head = GatheredHead(head, model.config.vocab_size, size, group)


def _shard_sources(sources: Mapping[str, GroupCodes], config: ModelConfig, qkv_parts, o_cols: slice,
                   mlp_rows: slice) -> dict[str, GroupCodes]:
    out = {}
    columns = {"q_proj": qkv_parts[0], "k_proj": qkv_parts[1], "v_proj": qkv_parts[2],
               "gate_proj": mlp_rows, "up_proj": mlp_rows}
    rows = {"o_proj": o_cols, "down_proj": mlp_rows}
    for name, weight in sources.items():
        part = name.split(".")[-2]
        if part in columns:
            out[name] = _output_rows(weight, columns[part])
        elif part in rows:
            out[name] = _input_columns(weight, rows[part])
        # Anything else (an embedding or head in blocks) is not read from the groups: pack_model
        # quantises those from the float weights, which the shard holds already.
    return out


def _output_rows(weight: GroupCodes, rows) -> GroupCodes:
    """A column-parallel shard: the output rows ``rows`` of every tensor (codes, numbers, factors)."""
    factors = [None if f is None else SuperScales(f.supers[rows].contiguous(), f.multipliers[rows].contiguous())
               for f in (weight.scale_factors, weight.min_factors)]
    return GroupCodes(weight.codes[rows].contiguous(), weight.scales[rows].contiguous(),
                      weight.mins[rows].contiguous(), weight.bits, weight.group, *factors)


def _input_columns(weight: GroupCodes, cols: slice) -> GroupCodes:
    """A row-parallel shard: input features ``cols`` (whole groups, checked up front). A K-quant's
    super-block factors go with it where the cut falls on super-blocks; elsewhere the shard holds
    each group's number itself (the same numbers, exact in fp32)."""
    groups = slice(cols.start // weight.group, cols.stop // weight.group)
    factors = [weight.scale_factors, weight.min_factors]
    widths = {weight.codes.shape[1] // f.supers.shape[1] for f in factors if f is not None}  # a super-block's weights
    if all(cols.start % width == 0 and cols.stop % width == 0 for width in widths):
        factors = [None if f is None else SuperScales(f.supers[:, cols.start // w:cols.stop // w].contiguous(),
                                                      f.multipliers[:, groups].contiguous())
                   for f, w in ((f, next(iter(widths), 1)) for f in factors)]
    else:  # a cut inside a super-block: the shard holds each group's number (the same, exact in fp32)
        factors = [None, None]
    return GroupCodes(weight.codes[:, cols].contiguous(), weight.scales[:, groups].contiguous(),
                      weight.mins[:, groups].contiguous(), weight.bits, weight.group, *factors)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return linear


def _part(bias: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias[index]


def _vocab_rows(table: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a [vocab, hidden] table, zero-padded past its end."""
    part = table[start:start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part.detach().contiguous()
