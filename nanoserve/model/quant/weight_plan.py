"""How a model's weights are held (``WeightPlan``) and the pass that packs them (``pack_model``):
each linear replaced by its packed layer (``quant.linear``), from a GGUF's own blocks where it has them,
fused where one kernel call serves several projections, the LM head and embedding as the plan
says; ``weight_types`` reports how each tensor type ended up running.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.model.network.experts import DenseExperts, PackedExperts
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.cpu_kernels import GROUP_SIZE
from nanoserve.model.quant.gguf_blocks import BlockTensor, ExpertBlocks, StackedBlocks
from nanoserve.model.quant.group_codes import (
    GroupCodes,
    int8_groups,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
)
from nanoserve.model.quant.linear import (
    GROUP_KERNELS,
    HEAD_DENSE_FROM_ROWS,
    WEIGHT_FORMATS,
    ConcatLinear,
    GroupEmbedding,
    GroupLinear,
    Int8Embedding,
    Int8Linear,
    dequant_from_rows,
    int4_kernel_accepts,
    int8_kernel_accepts,
)

# A weight as a loader hands it over to be packed as it is: unpacked codes, or a GGUF's blocks.
WeightSource = GroupCodes | BlockTensor | ExpertBlocks


@dataclass(frozen=True)
class WeightPlan:
    """How the weights are held. ``format`` is one of WEIGHT_FORMATS: "int4" runs each linear
    group-wise, from a GGUF's own blocks where it has them (any type in gguf_blocks) and rounded
    to int4 groups where the weight is float. With ``dense_from_rows`` set, packed linears also
    keep a dense copy (in the compute dtype) used for inputs of at least that many rows.
    ``int8_head`` (int4 only) runs the LM head group-wise too (from the file's blocks, such as
    the default GGUF's Q8_0, else rounded to int8 groups) instead of dense; a tied embedding
    stays a dense table, except where nanoserve's kernels run the head without a dense copy
    (then ``GroupEmbedding`` reads it from the head's codes). With a dense copy the head takes it from
    ``min(dense_from_rows, HEAD_DENSE_FROM_ROWS)`` rows. ``kernel`` (GROUP_KERNELS, int4 only)
    says who runs the group-wise layers. ``a8_from_rows`` (int4 on nanoserve's kernels): from how
    many rows of input those products round activations to 8 bits (one int8 code a value, a step
    per 16 in sixteenths of its group of 32's max |x| / 127, about llama.cpp's q8_0), which
    multiplies each weight code once instead of twice; fewer rows (all, with None) keep 16 (two codes a value, finer than bf16)."""

    format: str
    dense_from_rows: int | None = None
    int8_head: bool = False
    kernel: str = "auto"
    a8_from_rows: int | None = None

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)} or 'auto', got {self.format!r}")
        if self.dense_from_rows is not None and self.format not in ("int8", "int4"):
            raise ValueError(f"a dense copy for large row counts only applies to int8/int4, not {self.format}")
        if self.int8_head and self.format != "int4":
            raise ValueError(f"a group-wise int8 LM head only applies to int4, not {self.format}")
        if self.kernel not in GROUP_KERNELS or (self.kernel != "auto" and self.format != "int4"):
            raise ValueError(f"kernel {self.kernel!r}: one of {', '.join(GROUP_KERNELS)}, and only with int4")
        if self.a8_from_rows is not None and (type(self.a8_from_rows) is not int or self.a8_from_rows < 1):
            raise ValueError(f"8-bit activations start from a row count of at least 1, got {self.a8_from_rows!r}")
        if self.a8_from_rows is not None and (self.format != "int4" or self.tier == "torch"):
            raise ValueError("8-bit activations (a8) apply to int4 on nanoserve's kernels only")

    @classmethod
    def parse(cls, name: str) -> WeightPlan:
        """The plan a ``name`` (``WeightPlan.name``) describes: "int4", "int4+int8head",
        "int4+int8head+bf16>=24", "int4+avx2", "int4+a8", "int4+a8>=16"... Raises ValueError naming what it
        cannot read."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"weights must be one of auto, {', '.join(WEIGHT_FORMATS)} or a plan name, got {name!r}")
        fmt, *options = name.split("+")
        fields: dict = {}
        for option in options:
            dtype, sep, rows = option.partition(">=")
            if option == "int8head":
                fields["int8_head"] = True
            elif sep and dtype in ("bf16", "fp32") and rows.isdigit():
                fields["dense_from_rows"] = int(rows)
            elif sep and dtype == "a8" and rows.isdigit():
                fields["a8_from_rows"] = int(rows)
            elif option in GROUP_KERNELS:
                fields["kernel"] = option
            elif option in ("a8", "a16"):
                fields["a8_from_rows"] = 1 if option == "a8" else None
            else:
                raise ValueError(f"weights {name!r}: unknown part {option!r} (int8head, bf16>=N, a8, a8>=N, a16, or a "
                                 f"kernel: {', '.join(GROUP_KERNELS)})")
        try:
            plan = cls(fmt, **fields)
        except ValueError as e:
            raise ValueError(f"weights {name!r}: {e}") from None
        short = {torch.float32: "fp32", torch.bfloat16: "bf16"}[plan.dtype]
        if any(o.split(">=")[0] not in (short, "a8") for o in options if ">=" in o):
            raise ValueError(f"weights {name!r}: {plan.format} computes in {short} on this host, so its dense copy "
                             f"is {short}>=N")
        return plan

    @property
    def tier(self) -> str | None:
        """The kernel tier that runs the group-wise layers (int4 only), resolved on this host."""
        return cpu_kernels.resolve_tier(self.kernel) if self.format == "int4" else None

    @property
    def name(self) -> str:
        """"int4", or "int4+int8head+bf16>=10" with a group-wise int8 head and a bf16 copy from 10
        rows ("+torch" or "+avx2" when the kernel is chosen, "+a8" with 8-bit activations, "+a8>=16"
        with them from 16 rows)."""
        head = "+int8head" if self.int8_head else ""
        short = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        dense = "" if self.dense_from_rows is None else f"+{short}>={self.dense_from_rows}"
        bits = {None: "", 1: "+a8"}.get(self.a8_from_rows, f"+a8>={self.a8_from_rows}")
        return self.format + head + dense + ("" if self.kernel == "auto" else f"+{self.kernel}") + bits

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and the K/V cache's) dtype: fp32 and bf16 as named; the packed
        formats compute in bf16 where the CPU does so natively and in fp32 elsewhere
        (cpu_kernels.compute_dtype of the tier that runs them)."""
        if self.format in ("fp32", "bf16"):
            return torch.float32 if self.format == "fp32" else torch.bfloat16
        return cpu_kernels.compute_dtype(self.tier or cpu_kernels.resolve_tier())


def pack_model(model: nn.Module, plan: WeightPlan, sources: Mapping[str, WeightSource] | None = None,
               tensor_types: Mapping[str, str] | None = None) -> None:
    """Replace the model's linear layers (and a tied LM head) with packed ones, in place.

    The model holds float weights (fp32 keeps the rounding to the packed format exact); cast it
    to ``plan.dtype`` afterwards (packed codes are integers and stay as they are). ``sources``
    maps HF weight names to group-wise weights taken as they are (a GGUF's blocks); other weights
    are quantised here. With int8 the LM head runs int8 per channel too (a tied head shares its
    codes with the token embedding); with int4 it stays dense in ``plan.dtype`` unless
    ``plan.int8_head``. ``model.weight_types`` then says how each tensor type runs
    (``weight_types``); ``tensor_types`` maps HF names to their types (a GGUF's), by default
    each weight's dtype.
    """
    if plan.format not in ("int8", "int4"):
        return
    if any(isinstance(m, (GroupLinear, Int8Linear)) for m in model.modules()):
        raise ValueError("the model's weights are packed already; load it again to choose another format")
    sources = sources or {}
    types = dict(tensor_types or _dtype_names(model))
    modes = pack_linears(model, plan, sources)
    modes.update(pack_head(model, plan, sources))
    model.weight_types = weight_types(types, modes)


def pack_linears(module: nn.Module, plan: WeightPlan, sources: Mapping[str, WeightSource], prefix: str = "",
                 ) -> dict[str, str]:
    """Pack the linears under ``module`` (named ``prefix`` in the model: a loader packs one decoder
    layer at a time), the LM head aside; returns each HF weight's mode (``weight_types``). A
    linear whose weight has a source is packed from it, so its float weight may be a meta tensor."""
    if plan.format not in ("int8", "int4"):
        return {}
    _fuse_gate_up(module, plan)
    modes: dict[str, str] = {}
    for name, linear in list(module.named_modules()):
        full = ".".join(filter(None, (prefix, name)))
        if isinstance(linear, DenseExperts):
            modes.update(_pack_experts(module, name, full, linear, plan, sources))
        elif isinstance(linear, nn.Linear) and full != "lm_head" and not getattr(linear, "keep_dense", False):
            # Parts of different types run each in its own format, where nanoserve's kernels run them.
            packed, mode = _packed_linear(linear, plan, group_source(full, sources, split=plan.tier != "torch"))
            _replace(module, name, packed)
            modes.update(dict.fromkeys(hf_parts(full), mode))
    return modes


def pack_head(model: nn.Module, plan: WeightPlan, sources: Mapping[str, WeightSource]) -> dict[str, str]:
    """Pack the LM head (and the embedding that shares or mirrors it) as the plan says; returns
    their HF weights' modes."""
    modes: dict[str, str] = {}
    tied = model.lm_head is None
    head_names = ["model.embed_tokens.weight"] if tied else ["lm_head.weight"]
    if plan.format == "int4":
        # The LM head stays dense unless asked for a group-wise one (per-channel int8 fails the
        # fidelity gates, README).
        if plan.int8_head:
            modes.update(dict.fromkeys(head_names, _pack_group_head(model, plan, sources)))
        if not tied:
            modes.update(_pack_group_embedding(model, plan, sources))
    elif plan.format == "int8" and int8_kernel_accepts((model.embed_tokens if tied else model.lm_head).weight.shape[1]):
        head = model.embed_tokens if tied else model.lm_head
        model.lm_head = _int8_linear(head.weight, None if tied else head.bias, plan)
        if tied:  # one int8 matrix serves as the embedding and the head
            model.embed_tokens = Int8Embedding(model.lm_head)
        modes.update(dict.fromkeys(head_names, "int8"))
    return modes


def weight_types(tensor_types: Mapping[str, str], modes: Mapping[str, str]) -> dict[str, str]:
    """How each tensor type runs, from each tensor's type and mode ("packed": from its own blocks;
    "int4" or "int8": rounded here to that format; "dense": in the compute dtype, the default):
    {type: mode}, modes joined by "+" where a type's tensors differ (a Q8_0 embedding table held
    dense beside Q8_0 linears run packed)."""
    by_type: dict[str, set[str]] = {}
    for name, kind in tensor_types.items():
        by_type.setdefault(kind, set()).add(modes.get(name, "dense"))
    return {kind: "+".join(sorted(found)) for kind, found in sorted(by_type.items())}


def _dtype_names(model: nn.Module) -> dict[str, str]:
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    return {name: names.get(t.dtype, str(t.dtype)) for name, t in _hf_weights(model).items()}


def _hf_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's float weights by HF name (fused linears by their parts' names)."""
    out = {}
    for name, tensor in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        for part in hf_parts(module):
            out[part.removesuffix(".weight") + "." + leaf] = tensor
    return out


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _pack_group_embedding(model: nn.Module, plan: WeightPlan, sources: Mapping[str, WeightSource]) -> dict[str, str]:
    """An untied token embedding with a source read from its own codes (GroupEmbedding) instead of
    a dense table, where nanoserve's kernels run: about the file's size instead of the compute
    dtype's."""
    source = group_source("embed_tokens", sources)
    if source is None or plan.tier == "torch" or not int4_kernel_accepts(*source.shape):
        return {}
    model.embed_tokens = GroupEmbedding(GroupLinear(source, None, plan.dtype, kernel=plan.kernel,
                                                    a8_from_rows=plan.a8_from_rows))
    return {"model.embed_tokens.weight": "packed"}


def _pack_group_head(model: nn.Module, plan: WeightPlan, sources: Mapping[str, WeightSource]) -> str:
    """The LM head group-wise (its source's blocks, else int8 groups); returns its mode."""
    tied = model.lm_head is None
    head = model.embed_tokens if tied else model.lm_head
    source = group_source("embed_tokens" if tied else "lm_head", sources)
    if not int4_kernel_accepts(*head.weight.shape) or (
            source is not None and source.group != GROUP_SIZE and plan.tier == "torch"):
        return "dense"  # the kernel's shape rules do not hold, or torch has no such format
    dense = None
    if tied and plan.dense_from_rows is not None:
        # The embedding table, cast now, is the head's dense copy too: the later cast of the
        # model leaves a tensor already in its dtype as it is, so the two stay one tensor.
        model.embed_tokens.to(plan.dtype)
        dense = model.embed_tokens.weight.detach()
    elif plan.dense_from_rows is not None:
        dense = _dense_copy(head.weight, plan)
    weight = source if source is not None else int8_groups(*quantize_int8_groups(head.weight))
    dense_from_rows = None if dense is None else min(plan.dense_from_rows, HEAD_DENSE_FROM_ROWS)
    model.lm_head = GroupLinear(weight, None if tied else head.bias, plan.dtype, dense, dense_from_rows, plan.kernel,
                                plan.a8_from_rows)
    if tied and dense is None and model.lm_head.handle is not None:
        model.embed_tokens = GroupEmbedding(model.lm_head)  # the head's codes serve as the table
    return "packed" if source is not None else "int8"


# A fused linear of this model and the HF tensors it stacks along the output dimension, in order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_parts(module_name: str) -> list[str]:
    """The HF weight names one of the model's linears holds: a fused linear (FUSED_PARTS) its
    parts', stacked along the output dimension."""
    hf = _hf_name(module_name + ".weight")
    fused = next((f for f in FUSED_PARTS if f".{f}." in hf), None)
    return [hf.replace(fused, part) for part in FUSED_PARTS[fused]] if fused else [hf]


def group_source(module_name: str, sources: Mapping[str, WeightSource], split: bool = False,
                 ) -> GroupCodes | StackedBlocks | list[StackedBlocks] | None:
    """The group-wise weight of one of the model's linears from HF-named ``sources``, or None:
    a GGUF's blocks of one type stay blocks (packed from the file's bytes). Parts of different
    types (a Q6_K v beside Q4_K q and k) are, with ``split``, one StackedBlocks per run of one
    type (each packed in its own format: ConcatLinear), else they meet as GroupCodes in the
    widest codes and smallest group (GroupCodes.cat)."""
    parts = hf_parts(module_name)
    if not all(p in sources for p in parts):
        return None
    found = [sources[p] for p in parts]
    if all(isinstance(p, BlockTensor) and p.rows % 16 == 0 for p in found):
        runs = [list(run) for _, run in itertools.groupby(found, key=lambda p: (p.qtype, p.cols))]
        if len(runs) == 1:
            return StackedBlocks(tuple(found))
        if split:
            return [StackedBlocks(tuple(run)) for run in runs]
    return GroupCodes.cat([p.group_codes() if isinstance(p, BlockTensor) else p for p in found])


def _fuse_gate_up(model: nn.Module, plan: WeightPlan) -> None:
    """Give every MLP one [2 * intermediate, hidden] linear for gate and up, to be packed next:
    one kernel call per layer instead of two. Lossless: groups and int8 scales run along K
    within an output row, so stacking rows changes no code or scale. An MLP whose parts the
    kernel would not pack each on their own keeps them apart (and dense)."""
    for mlp in model.modules():
        if not hasattr(mlp, "fuse_gate_up") or mlp.gate_up_proj is not None:
            continue
        gate, up = mlp.gate_proj, mlp.up_proj
        linears = isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
        if not linears or gate.bias is not None or up.bias is not None:
            continue
        if plan.format == "int4" and not all(int4_kernel_accepts(*m.weight.shape) for m in (gate, up)):
            continue
        fused = nn.Linear(gate.in_features, gate.out_features + up.out_features, bias=False, device="meta")
        if not (gate.weight.is_meta or up.weight.is_meta):  # else a loader's source packs it, unread
            fused.weight = nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        mlp.fuse_gate_up(fused)


def _packed_linear(linear: nn.Linear, plan: WeightPlan, source: GroupCodes | StackedBlocks | list | None,
                   ) -> tuple[nn.Module, str]:
    """The packed layer for ``linear`` and its mode (weight_types); a layer the kernel cannot
    take stays as it is, dense."""
    n, k = linear.weight.shape
    if isinstance(source, list):  # parts in formats of their own, their outputs stacked
        rows = [part.shape[0] for part in source]
        weights = linear.weight.split(rows) if plan.dense_from_rows is not None else [None] * len(source)
        biases = linear.bias.split(rows) if linear.bias is not None else [None] * len(source)
        return ConcatLinear([GroupLinear(part, bias, plan.dtype, None if w is None else _dense_copy(w, plan),
                                         plan.dense_from_rows, plan.kernel, plan.a8_from_rows)
                             for part, w, bias in zip(source, weights, biases)]), "packed"
    if plan.format == "int8":
        return (_int8_linear(linear.weight, linear.bias, plan), "int8") if int8_kernel_accepts(k) else (linear, "dense")
    if not int4_kernel_accepts(n, k) or (source is not None and source.group != GROUP_SIZE and plan.tier == "torch"):
        return linear, "dense"
    weight = source if source is not None else quantize_int4(linear.weight)
    layer = GroupLinear(weight, linear.bias, plan.dtype, _dense_copy(linear.weight, plan), plan.dense_from_rows,
                        plan.kernel, plan.a8_from_rows)
    return layer, "packed" if source is not None else "int4"


def _pack_experts(module: nn.Module, name: str, full: str, experts: DenseExperts, plan: WeightPlan,
                  sources: Mapping[str, WeightSource]) -> dict[str, str]:
    """Pack a layer's experts (int4 plans on nanoserve's kernels): gate and up of each expert
    stacked into one matrix, from the file's blocks where it has them (a GGUF's expert tensors,
    every expert in one pass), else rounded to int4 groups expert by expert; returns their HF
    weights' modes. Elsewhere (fp32,
    bf16, int8, or torch's kernel) the experts stay float matrices in the compute dtype."""
    hf = {part: f"{_hf_name(full + '.weight').removesuffix('.weight')}.{part}"
          for part in ("gate_proj", "up_proj", "down_proj")}
    handle = cpu_kernels.handle(plan.tier) if plan.format == "int4" and plan.tier != "torch" else None
    num, width, hidden = experts.gate_proj.shape
    if handle is None or not (int4_kernel_accepts(2 * width, hidden) and int4_kernel_accepts(hidden, width)):
        return {}
    found = {part: sources.get(name) for part, name in hf.items()}
    from_blocks = all(isinstance(f, ExpertBlocks) for f in found.values())

    def weight(part: str, e: int) -> BlockTensor | GroupCodes:
        if from_blocks:
            return found[part].experts[e]
        return quantize_int4(getattr(experts, part)[e])

    def pack(parts: list[BlockTensor | GroupCodes]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        source = (StackedBlocks(tuple(parts)) if all(isinstance(p, BlockTensor) for p in parts)
                  and len({(p.qtype, p.cols) for p in parts}) == 1 else
                  GroupCodes.cat([p.group_codes() if isinstance(p, BlockTensor) else p for p in parts]))
        if isinstance(source, StackedBlocks):
            return source.pack()
        return cpu_kernels.pack_groups(source.codes, source.scales, source.mins, source.bits, source.scale_factors,
                                       source.min_factors)

    def stacked(parts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Every expert's ``parts`` (stacked rows) packed, as [experts, ...] tensors."""
        if from_blocks:
            whole = _pack_expert_blocks([tuple(found[part].experts[e] for part in parts) for e in range(num)])
            if whole is not None:
                return whole
        packs = [pack([weight(part, e) for part in parts]) for e in range(num)]
        zeros = {p[3] for p in packs}
        if len(zeros) != 1:  # experts of one tensor share their format, so their zero point
            raise RuntimeError(f"{full}: experts packed with different zero points {sorted(zeros)}")
        return (*(torch.stack([p[i] for p in packs]) for i in range(3)), zeros.pop())

    gate_up_bias = None if experts.gate_bias is None else torch.cat([experts.gate_bias, experts.up_bias], dim=-1)
    packed = PackedExperts(stacked(["gate_proj", "up_proj"]), stacked(["down_proj"]), width, handle,
                           dequant_from_rows(plan.tier, plan.a8_from_rows),
                           experts.activation, gate_up_bias, experts.down_bias, experts.limit, experts.alpha,
                           plan.a8_from_rows)
    _replace(module, name, packed)
    return dict.fromkeys(hf.values(), "packed" if from_blocks else "int4")


def _pack_expert_blocks(per_expert: list[tuple[BlockTensor, ...]],
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """Each expert's block tensors (its rows stacked) packed in one pass into [experts, ...]
    tensors, the bytes of stacking each expert's own packing (blocks of 16 rows pack on their own,
    and every expert has as many); None where the parts differ in type or width."""
    parts = tuple(p for expert in per_expert for p in expert)
    if len({(p.qtype, p.cols) for p in parts}) != 1:
        return None
    codes, scales, mins, zero_point = StackedBlocks(parts).pack()
    experts = len(per_expert)
    per_expert_view = lambda t: t.view(experts, t.shape[0] // experts, *t.shape[1:])  # noqa: E731
    # a table type's mins are its code table, one for every expert
    mins = mins.expand(experts, -1).contiguous() if cpu_kernels.is_code_table(mins) else per_expert_view(mins)
    return codes.view(experts, -1), per_expert_view(scales), mins, zero_point


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, plan: WeightPlan) -> Int8Linear:
    codes, scales = quantize_int8(weight)
    return Int8Linear(codes, scales, bias, plan.dtype, _dense_copy(weight, plan), plan.dense_from_rows)


def _dense_copy(weight: torch.Tensor, plan: WeightPlan) -> torch.Tensor | None:
    return None if plan.dense_from_rows is None else weight.detach().to(plan.dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)
