"""One vectorised sampler for a batch whose rows each carry their own SamplingParams.

On the CPU a row's token is the one at a uniform draw u of its law's cumulative distribution,
chosen by nanoserve's ``sample_rows`` op (worker/sample_rows.cpp): one random number a row, the
vocabulary neither sorted nor raced; the same file's ``law_probabilities`` op gives the law itself
(``distribution``, which speculative decoding reads) without the sort torch's path needs.
Elsewhere (a GPU) sampling is the exponential race (Gumbel-max in disguise): ``argmax(probs / q)``
with ``q ~ Exp(1)`` draws from ``probs``, one random number per vocabulary entry and no sort. Both draw from ``distribution``'s law, and a request
with a seed draws from its own generator, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoserve.model.quant import cpu_kernels
from nanoserve.structured.masks import TokenMasks, apply_token_masks
from nanoserve.worker.scoring import TokenLogprobs, gather_logprobs

if TYPE_CHECKING:
    from nanoserve.engine.sampling_params import SamplingParams  # plain data: the type alone

__all__ = ["Sampler", "SamplerOutput", "TokenLogprobs", "exponential_race", "gather_logprobs", "inverse_cdf_draw",
           "law_tensors", "row_uniforms", "sample_isolated", "sample_rows"]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]


def sample_isolated(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                    generators: list[torch.Generator | None], histories: list | None,
                    masks: TokenMasks | None = None
                    ) -> tuple[torch.Tensor, list[TokenLogprobs | None], dict[int, str]]:
    """One token per row, and the rows whose sampling failed (row -> message). If sampling the
    batch raises, every row is sampled alone (a seeded row's generator rewound first), so only
    a row that fails on its own fails."""
    states = [None if g is None else g.get_state() for g in generators]
    masked = {} if masks is None else {"masks": masks}  # a batch with no constrained row calls as before
    try:
        sampled = sampler(logits, params, generators, histories, **masked)
        return sampled.token_ids, sampled.logprobs, {}
    except Exception:  # find the rows at fault below
        pass
    token_ids = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    failed = {}
    for row, (p, generator, state) in enumerate(zip(params, generators, states)):
        if generator is not None:
            generator.set_state(state)
        try:
            row_mask = {} if masks is None else {"masks": masks.select(row)}
            one = sampler(logits[row:row + 1], [p], [generator], None if histories is None else [histories[row]],
                          **row_mask)
        except Exception as exc:
            failed[row] = f"sampling failed: {type(exc).__name__}: {exc}"
            continue
        token_ids[row], logprobs[row] = one.token_ids[0], one.logprobs[0]
    return token_ids, logprobs, failed


class Sampler:
    """Samples one token per row. ``histories[i]`` is row i's (prompt ids, output ids),
    read only when a row asks for penalties. ``masks`` hold the constrained rows' allowed
    tokens: applied after the logprobs are taken and before every filter, greedy included.
    ``cpu_op``: CPU logits go to the ``sample_rows`` op where nanoserve's ops library loads
    (False: the exponential race everywhere, as on a GPU)."""

    def __init__(self, cpu_op: bool = True) -> None:
        self.cpu_op = cpu_op

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[tuple[list[int], list[int]]] | None = None,
                 masks: TokenMasks | None = None) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process(logits, params, histories, masks)
        token_ids = self._choose(logits, params, generators)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, [None] * len(params))
        return SamplerOutput(token_ids, gather_logprobs(raw_logprobs, token_ids, [p.logprobs for p in params]))

    def distribution(self, logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[tuple[list[int], list[int]]] | None = None,
                     masks: TokenMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(processed logits, probs) [n, vocab] float32: the logits greedy argmaxes (masks and
        penalties applied) and the law a sampling row draws from (temperature, top-k/top-p, min-p
        applied, rows summing to 1). A greedy row's probs are those at temperature 1 and mean
        nothing. ``__call__`` draws from exactly this law."""
        processed = self.process(logits.float(), params, histories, masks)
        if self._uses_op(processed) and any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # where torch's path sorts the vocabulary, the op's law (softmax alone is as fast)
            return processed, torch.ops.nanoserve.law_probabilities(processed, *law_tensors(params))
        probs = self.probabilities(processed, params)
        if any(p.min_p > 0 for p in params):  # min-p's cut is the one step after the softmax
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return processed, probs

    def _uses_op(self, logits: torch.Tensor) -> bool:
        return self.cpu_op and logits.device.type == "cpu" and cpu_kernels.ops_available()

    def process(self, logits: torch.Tensor, params: list[SamplingParams],
                histories: list[tuple[list[int], list[int]]] | None = None,
                masks: TokenMasks | None = None) -> torch.Tensor:
        """Float logits with each constrained row's mask, then each row's penalties, applied."""
        logits = apply_token_masks(logits, masks)
        if any(p.uses_penalties for p in params):
            if histories is None:
                raise ValueError("penalties need each row's token history")
            logits = apply_penalties(logits, params, histories)
        return logits

    def probabilities(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Processed logits -> each row's sampling law (greedy rows: temperature 1, meaningless),
        not renormalised after min-p: the race needs no normalising, and skipping it keeps draws
        bit-identical to before ``distribution`` existed."""
        device = logits.device
        # Greedy rows get temperature 1 here and are overridden by argmax by every caller.
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        scaled = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            vocab = logits.shape[-1]
            top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _choose(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        greedy = [p.greedy for p in params]
        if self._uses_op(logits):
            return sample_rows(logits, params, generators, draws=not all(greedy))
        if all(greedy):
            return logits.argmax(dim=-1)
        sampled = exponential_race(self.probabilities(logits, params), generators)
        if not any(greedy):  # torch's argmax is a slow reduction on the CPU (~0.9 ms for 8 rows of 128K)
            return sampled
        return torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), sampled)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                draws: bool = True) -> torch.Tensor:
    """One token per row of processed CPU logits by the ``sample_rows`` op, each row's u from
    ``row_uniforms`` (the order ``exponential_race`` draws its races in). ``draws`` False (every
    row greedy): no draw at all."""
    uniform = row_uniforms(generators, logits.device) if draws else torch.zeros(len(params), dtype=torch.float64)
    return torch.ops.nanoserve.sample_rows(logits, *law_tensors(params), uniform)


def row_uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform [0, 1) fp64 a row: every row's from the global RNG, then a seeded row's again
    from its own generator, so a seeded row's draw depends on its generator alone."""
    uniform = torch.rand(len(generators), dtype=torch.float64, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            uniform[row] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device)
    return uniform


def law_tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """Each row's temperature, top_k, top_p and min_p as the CPU ops take them."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from ``probs`` [n, vocab] (any non-negative scale: the argmax ignores
    it). Every row's race is first drawn from the global RNG, then a seeded row's is redrawn
    from its own generator, so a seeded row's draw depends only on its generator."""
    race = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            race[row].exponential_(generator=gen)
    return (probs / race).argmax(dim=-1)


def inverse_cdf_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from ``probs`` [n, vocab] (non-negative, any scale): the token where the
    row's running sum (in fp64) first passes u times its total, u from ``row_uniforms``. On the
    CPU a row costs a cumulative sum, where the race's one random number a token cost ~16x that."""
    uniform = row_uniforms(generators, probs.device)
    tokens = []
    for row in range(probs.shape[0]):  # one row at a time: torch's fp64 cumsum over a 2-d tensor is ~5x slower a row
        cdf = probs[row].double().cumsum(0)
        token = int(torch.searchsorted(cdf, uniform[row:row + 1] * cdf[-1], right=True))
        if token == cdf.numel():  # rounding past the end: the last token of positive mass
            token = int((probs[row] > 0).nonzero()[-1])
        tokens.append(token)
    return torch.tensor(tokens, dtype=torch.long, device=probs.device)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its nucleus top-p.
    ``top_k`` holds the vocabulary size where disabled; ``top_p`` holds 1.0."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    # k-th largest value per row; ties with it stay in, as in vLLM.
    kth = ascending.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Repetition penalty over prompt and output; presence and frequency over the output. Only
    the tokens a row has seen change, so only they are read and written (a new tensor: the
    caller's logits stay as they were)."""
    n, vocab = logits.shape
    device = logits.device
    flat = logits.reshape(-1).clone()

    def keys(ids: list[list[int]]) -> torch.Tensor:  # row * vocab + token, every row's at once
        # (through an int64 array: torch.tensor walks a list of ints ~6x slower)
        parts = [torch.frombuffer(array("q", row_ids), dtype=torch.long) + row * vocab
                 for row, row_ids in enumerate(ids) if row_ids]
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)

    output_keys = keys([output for _, output in histories])
    seen = torch.cat([keys([prompt for prompt, _ in histories]), output_keys]).unique()
    if seen.numel():
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / rep, values * rep)
    outputs, counts = output_keys.unique(return_counts=True)
    if outputs.numel():
        rows = outputs // vocab
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        flat[outputs] = flat[outputs] - presence - frequency * counts.to(flat.dtype)
    return flat.view(n, vocab)
