"""Mixture-of-experts MLPs: a router picks each token's experts, and one grouped operation runs
every active expert over the rows routed to it.

The grouped operation is a torch op (``nanoserve::experts_dense``, ``nanoserve::experts_packed``)
with a fake that says only "a tensor shaped like x": which experts a step routes to is data, so
the compiled decode graph keeps its static shapes and never recompiles on routing. Float experts
(``experts_dense``): the op sorts the step's (row, expert) pairs by expert and, per active
expert, gathers its rows, runs gate and up, the activation, down, and adds the result times the
routing weight into the output (in expert order, as the reference does). Packed experts hold
each expert as its own group-wise matrix (``cpu_kernels`` layout, the experts stacked along a
leading dimension), packed expert by expert from the file's blocks: a step reads only the routed
experts' bytes. Their step runs every routed pair in two grouped kernel calls (gate and up of
every pair, then down; ``nanoserve::experts_mm``), with no per-expert Python; in a prompt's step
an expert with many rows dequantises its matrix and runs a dense GEMM instead, as a packed linear
does (``quant.linear.dequant_from_rows``: not on a tier computing in fp32 with 8-bit activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.network.config import ModelConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}
# The expert ops take their activation as an index into GLUS: with a string argument the CPU
# graph's C++ wrapper would box the call through c10's dispatcher, whose headers cost each graph
# ~5 s more to build, where ints, floats and tensors go through torch's C shim.
GLUS = (*ACTIVATIONS, "swiglu_oai")


class Router(nn.Linear):
    """A router or gate linear: kept dense in every weight format (it is tiny, and routing is
    sensitive to rounding)."""

    keep_dense = True


def _routed_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (row, slot) pairs of ``ids`` [N, k] ordered by expert (stably), and each expert's count."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def _mix(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, expert) -> torch.Tensor:
    """out[r] = sum over r's slots s of weights[r, s] * expert(ids[r, s], x[r]), experts in order."""
    if x.shape[0] == 1:  # a batch-1 decode step: the row through its experts, no gathering
        return _mix_one(x, ids[0].tolist(), weights[0].tolist(), expert)
    out = torch.zeros_like(x)
    order, counts = _routed_pairs(ids, num_experts)
    k = ids.shape[1]
    flat_weights = weights.reshape(-1)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // k
        y = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, (y * flat_weights.index_select(0, pairs)[:, None]).to(out.dtype))
    return out


def glu(activation: str, gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """The gated unit: act(gate) * up, or gpt-oss's clamped SwiGLU ("swiglu_oai": gate clamped
    to at most ``limit``, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate))."""
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up


def _biased(y: torch.Tensor, bias: torch.Tensor | None, e: int) -> torch.Tensor:
    return y if bias is None else y + bias[e]


def _mix_one(x: torch.Tensor, ids: list[int], weights: list[float], expert) -> torch.Tensor:
    """One row: its experts' outputs times their weights (exact in x's dtype: the weights are
    its values), added in expert order from zero as the many-row path adds them."""
    out = torch.zeros_like(x)
    for e, weight in sorted(zip(ids, weights)):
        out = out + (expert(e, x) * weight).to(out.dtype)
    return out


@torch.library.custom_op("nanoserve::experts_dense", mutates_args=())
def experts_dense(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None,
                  down_bias: torch.Tensor | None, activation: int, limit: float, alpha: float) -> torch.Tensor:
    """Experts held as float matrices gate, up [E, I, H] and down [E, H, I], with optional
    biases gate, up [E, I] and down [E, H] (gpt-oss); ``activation``: the GLUS index."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        g = _biased(F.linear(rows, gate[e]), gate_bias, e)
        u = _biased(F.linear(rows, up[e]), up_bias, e)
        return _biased(F.linear(glu(GLUS[activation], g, u, limit, alpha), down[e]), down_bias, e)

    return _mix(x, ids, weights, gate.shape[0], expert)


@experts_dense.register_fake
def _(x, ids, weights, gate, up, down, gate_bias, up_bias, down_bias, activation, limit, alpha):
    return torch.empty_like(x)


def activation_bits(rows: int, a8_from_rows: int | None) -> int:
    """The ``x_bits`` of a packed product of ``rows`` rows (the kernels' activation codes, 8 or
    16 bits): 8 from ``a8_from_rows`` rows on (None: never), else 16. Here, below quant, so that
    the experts and quant's linears share it."""
    return 8 if a8_from_rows is not None and rows >= a8_from_rows else 16


@torch.library.custom_op("nanoserve::experts_packed", mutates_args=())
def experts_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_codes: torch.Tensor,
                   gate_up_scales: torch.Tensor, gate_up_mins: torch.Tensor, gate_up_zero: int,
                   down_codes: torch.Tensor, down_scales: torch.Tensor, down_mins: torch.Tensor, down_zero: int,
                   intermediate: int, tier: int, dequant_from_rows: int | None, activation: int,
                   gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, limit: float,
                   alpha: float, x_bits: int = 16) -> torch.Tensor:
    """Experts held packed (``cpu_kernels.pack_groups`` layout, one leading index per expert):
    gate and up as one [2 I, H] matrix per expert, down [H, I]; optional biases [E, 2 I] (gate's
    then up's) and [E, H]; ``activation``: the GLUS index. Runs _packed_step."""
    experts = PackedStep((gate_up_codes, gate_up_scales, gate_up_mins, gate_up_zero),
                         (down_codes, down_scales, down_mins, down_zero), intermediate, tier, GLUS[activation],
                         gate_up_bias, down_bias, limit, alpha, x_bits)
    return _packed_step(x, ids, weights, experts, dequant_from_rows)


@dataclass(frozen=True)
class PackedStep:
    """A layer's packed experts as experts_packed receives them: gate_up and down each (codes,
    scales, mins, zero point) with one leading index per expert, the tier's handle, the
    activation (``glu``'s), the optional biases and the products' activation bits (8 or 16,
    ``activation_bits``)."""

    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    intermediate: int
    tier: int
    activation: str
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    limit: float
    alpha: float
    x_bits: int = 16

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return glu(self.activation, gate, up, self.limit, self.alpha)


def _packed_step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedStep,
                 dequant_from_rows: int | None) -> torch.Tensor:
    """Every routed pair through the grouped kernel (_grouped_outputs: a layer's experts in two
    calls), except, in a step of ``dequant_from_rows`` rows or more (a prompt), the pairs of the
    experts with that many: those experts dequantise their matrices for a dense GEMM each, as a
    packed linear does (None: never, quant.linear.dequant_from_rows). Then each row's pairs
    weighted and summed (in fp32, rounded once)."""
    rows, top_k = ids.shape
    busy: list[int] = []
    if dequant_from_rows is not None and rows >= dequant_from_rows:
        counts = torch.bincount(ids.reshape(-1), minlength=experts.gate_up[0].shape[0])
        busy = (counts >= dequant_from_rows).nonzero().flatten().tolist()
    grouped_ids = ids.masked_fill(torch.isin(ids, torch.tensor(busy, dtype=ids.dtype)), -1) if busy else ids
    y = _grouped_outputs(x, grouped_ids, experts)
    flat_ids, flat = ids.reshape(-1), y.view(rows * top_k, -1)
    for e in busy:
        pairs = (flat_ids == e).nonzero().flatten()
        flat[pairs] = _dequantised_expert(x.index_select(0, pairs // top_k), e, experts)
    return torch.bmm(weights.float().unsqueeze(1), y.float()).squeeze(1).to(x.dtype)


def _grouped_outputs(x: torch.Tensor, ids: torch.Tensor, experts: PackedStep) -> torch.Tensor:
    """Each routed pair's expert output [rows, top_k, H] (x's dtype): gate and up of every pair in
    one grouped kernel call (``nanoserve::experts_mm``, each expert's codes read once for all its
    rows), the activation, down of every pair in another. Pairs of id -1 are left unwritten."""
    rows, top_k = ids.shape
    ids = ids.contiguous()
    gate_up = torch.ops.nanoserve.experts_mm(x, ids, *experts.gate_up, experts.tier, experts.x_bits)  # [rows, k, 2 I]
    if experts.gate_up_bias is not None:
        gate_up = gate_up + experts.gate_up_bias[ids]
    h = experts.glu(gate_up).reshape(rows * top_k, experts.intermediate)
    y = torch.ops.nanoserve.experts_mm(h, ids, *experts.down, experts.tier, experts.x_bits)  # [rows, k, H]
    if experts.down_bias is not None:
        y = y + experts.down_bias[ids]
    return y


def _expert_product(rows: torch.Tensor, e: int, weight: tuple, tier: int, dense: bool, x_bits: int = 16,
                    ) -> torch.Tensor:
    """rows times expert e's matrix of ``weight`` (codes, scales, mins, zero point): through its
    dequantised matrix (``dense``) or the packed product."""
    codes, scales, mins, zero = (*(t[e] for t in weight[:3]), weight[3])
    if not dense:
        return torch.ops.nanoserve.group_mm(rows, codes, scales, mins, zero, tier, x_bits)
    n, k = 16 * scales.shape[0], rows.shape[1]
    return F.linear(rows, torch.ops.nanoserve.dequantize(codes, scales, mins, zero, n, k, rows.dtype, tier))


def _dequantised_expert(rows: torch.Tensor, e: int, experts: PackedStep, dense: bool = True) -> torch.Tensor:
    """Expert e on its rows [n, H], one product at a time: gate and up, the activation, down."""
    gate_up = _biased(_expert_product(rows, e, experts.gate_up, experts.tier, dense, experts.x_bits),
                      experts.gate_up_bias, e)
    y = _expert_product(experts.glu(gate_up), e, experts.down, experts.tier, dense, experts.x_bits)
    return _biased(y, experts.down_bias, e)


def _per_expert_step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedStep,
                     dequant_from_rows: int | None) -> torch.Tensor:
    """The step expert by expert from Python (_mix), each expert's products a call of their
    own (dequantised from ``dequant_from_rows`` rows; None: never): what the grouped kernel
    replaced, kept as the baseline its benchmark and tests compare with."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        dense = dequant_from_rows is not None and rows.shape[0] >= dequant_from_rows
        return _dequantised_expert(rows, e, experts, dense=dense)

    return _mix(x, ids, weights, experts.gate_up[0].shape[0], expert)


@experts_packed.register_fake
def _(x, ids, weights, *args):
    return torch.empty_like(x)


class DenseExperts(nn.Module):
    """Every expert's gate, up [E, I, H] and down [E, H, I] as float matrices (HF's stacked names
    ``mlp.experts.{gate,up,down}_proj``), with ``bias`` their biases ``{gate,up,down}_bias``
    [E, I], [E, I], [E, H] (gpt-oss). ``limit`` and ``alpha``: the clamped SwiGLU's (``glu``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str, bias: bool = False,
                 limit: float = 0.0, alpha: float = 1.0) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_bias = self.up_bias = self.down_bias = None
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(num_experts, intermediate))
            self.up_bias = nn.Parameter(torch.empty(num_experts, intermediate))
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.activation, self.limit, self.alpha = activation, limit, alpha

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanoserve.experts_dense(x, ids, weights, self.gate_proj, self.up_proj, self.down_proj,
                                                 self.gate_bias, self.up_bias, self.down_bias,
                                                 GLUS.index(self.activation), self.limit, self.alpha)


class PackedExperts(nn.Module):
    """Every expert packed group-wise for nanoserve's kernel tier ``handle``: ``gate_up`` (gate
    and up stacked, [2 I, H] per expert) and ``down`` ([H, I]), each a (codes, scales, mins)
    stack with one leading index per expert and a zero point; optional float biases
    ``gate_up_bias`` [E, 2 I] and ``down_bias`` [E, H]; ``a8_from_rows``: from how many rows of a
    step the products round activations to 8 bits instead of 16 (None: never)."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
                 down: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], intermediate: int, handle: int,
                 dequant_from_rows: int | None, activation: str, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, limit: float = 0.0, alpha: float = 1.0,
                 a8_from_rows: int | None = None) -> None:
        super().__init__()
        for prefix, (codes, scales, mins, zero) in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{prefix}_codes", codes)
            self.register_buffer(f"{prefix}_scales", scales)
            self.register_buffer(f"{prefix}_mins", mins)
            setattr(self, f"{prefix}_zero", zero)
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias, requires_grad=False)
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias, requires_grad=False)
        self.intermediate, self.handle = intermediate, handle
        self.dequant_from_rows, self.activation = dequant_from_rows, activation
        self.limit, self.alpha, self.a8_from_rows = limit, alpha, a8_from_rows

    @property
    def num_experts(self) -> int:
        return self.gate_up_codes.shape[0]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanoserve.experts_packed(
            x, ids, weights, self.gate_up_codes, self.gate_up_scales, self.gate_up_mins, self.gate_up_zero,
            self.down_codes, self.down_scales, self.down_mins, self.down_zero, self.intermediate, self.handle,
            self.dequant_from_rows, GLUS.index(self.activation), self.gate_up_bias, self.down_bias, self.limit,
            self.alpha, activation_bits(x.shape[0], self.a8_from_rows))


class ExpertMLP(nn.Module):
    """A mixture-of-experts MLP: ``gate`` (the router, [E, H], biased for gpt-oss) scores the
    experts; each token runs its top ``num_experts_per_tok``, weighted. The architecture's
    routing says how: "softmax_topk" (softmax over all experts in fp32, then the top k,
    renormalised where the config says) or "topk_softmax" (gpt-oss: the top k logits, then the
    softmax over those k). Qwen2-MoE adds a shared expert (a dense MLP) times the sigmoid of
    ``shared_expert_gate``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from nanoserve.model.network.architectures import architecture
        from nanoserve.model.network.llama import LlamaMLP

        hidden, experts = config.hidden_size, config.num_experts
        self.gate = Router(hidden, experts, bias=config.expert_bias)
        self.experts: nn.Module = DenseExperts(experts, hidden, config.moe_intermediate_size, config.expert_activation,
                                               config.expert_bias, config.swiglu_limit or 0.0, config.swiglu_alpha)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.routing = architecture(config.architecture).routing
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k] in x's dtype) for rows x [N, H]."""
        if self.routing == "topk_softmax":
            top, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
