"""The draft proposer: a second, smaller model (or the target's own file in a cheaper weight
format) that runs k steps ahead of each speculating row on its own paged K/V cache.

Each request keeps a block table in the draft's pool and the tokens whose K/V it holds. A
proposal first syncs that state with the request (the tokens past the longest common prefix
were rejected proposals: trimmed), catches up on the tokens the target accepted since (a
prompt in eager prefill chunks, the last one or two tokens in one compiled step shaped like a
verify), then decodes k - 1 more tokens. Rows are re-seated every call: speculating request i
sits on draft row i and its slot-table row is adopted from its block table, so the draft's
rows are always the window 0..m-1 its compiled graphs read. The proposer is the only writer of
its cache and pool; the target's plans never mention it (under tensor parallelism the draft
runs on rank 0 alone).

A greedy row's draft proposes its argmax; a sampling row's draft samples its own processed
distribution, which it hands to the acceptance step as q.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanoserve.cache.blocks import BlockPool, BlockTable
from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.worker.attention import decode_attention_kernel
from nanoserve.worker.bucketing import Buckets, step_shape
from nanoserve.worker.build import WorkerConfig, build_worker
from nanoserve.worker.plan import DecodeBatch, PrefillChunk, StepPlan
from nanoserve.worker.worker import Worker

if TYPE_CHECKING:
    from nanoserve.engine.request import Request
    from nanoserve.model.quant.weight_plan import WeightPlan

# The engine's sampler's processed distribution: (logits, params, histories) -> (logits, probs).
Distribution = Callable[..., tuple[torch.Tensor, torch.Tensor]]

PREFILL_CHUNK = 512  # tokens of a catch-up prefill per row and step: a prompt's K/V, chunk by chunk


@dataclasses.dataclass
class DraftState:
    """One request's place in the draft's pool: its blocks and the tokens whose K/V they hold."""

    table: BlockTable
    fed: list[int]
    confirmed: int = 0  # the first ``confirmed`` fed tokens are the request's own (the rest were drafted)


class DraftProposer:
    def __init__(self, worker: Worker, num_blocks: int, block_size: int, max_rows: int, max_model_len: int,
                 buckets: Buckets | None, distribution: Distribution) -> None:
        self.worker, self.block_size, self.max_rows = worker, block_size, max_rows
        self.max_model_len, self.buckets = max_model_len, buckets
        self.pool = BlockPool(num_blocks, block_size)
        self.scratch_slot = self.pool.allocate(1)[0] * block_size  # padded rows write here
        self.distribution = distribution
        self.states: dict[str, DraftState] = {}
        self.step_seconds, self.steps = 0.0, 0  # the draft's compiled-shape steps (catch-up prefills aside)

    # -- the proposer interface --------------------------------------------------------------
    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        chosen = [i for i, (r, k) in enumerate(zip(requests, ks)) if k > 0][:self.max_rows]
        kept, reserved = [], 0  # blocks the rows kept so far will take in _draft
        for i in chosen:
            k = min(ks[i], self.max_model_len - requests[i].num_tokens)
            need = self._sync(requests[i], k, {requests[j].request_id for j in chosen}, reserved) if k > 0 else None
            if need is not None:
                kept.append((i, k))
                reserved += need
        proposals: list[list[int]] = [[] for _ in requests]
        probs: list[torch.Tensor | None] = [None] * len(requests)
        if not kept:
            return proposals, probs
        drafted, dists = self._draft([requests[i] for i, _ in kept], [k for _, k in kept])
        for (i, k), tokens, q in zip(kept, drafted, dists):
            proposals[i] = tokens[:k]
            probs[i] = None if q is None else q[:k]
        return proposals, probs

    def seconds_per_token(self) -> float | None:
        """What drafting one more token of a row costs: a draft step's mean time (a prompt's
        catch-up prefill aside: it is paid once)."""
        return self.step_seconds / self.steps if self.steps else None

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.pool.free(state.table.clear()[::-1])

    def close(self) -> None:
        self.worker.close()

    # -- state -------------------------------------------------------------------------------
    def _sync(self, request: Request, k: int, keep: set[str], reserved: int) -> int | None:
        """Trim the request's draft K/V to what still matches its tokens and make room for this
        proposal (catching up, then k - 1 tokens fed) beside the ``reserved`` blocks the rows
        synced before it will take; the blocks it needs, or None if the pool cannot hold it even
        after dropping the states of requests not proposing now."""
        state = self.states.setdefault(request.request_id, DraftState(BlockTable(self.block_size), []))
        tokens = request.all_token_ids
        valid = state.confirmed  # only the drafted tail can disagree with what the target kept
        for fed, token in zip(state.fed[valid:], tokens[valid:]):
            if fed != token:
                break
            valid += 1
        valid = min(valid, len(tokens) - 1)  # the last token is always fed: its logits give the first proposal
        self.pool.free(state.table.truncate(valid)[::-1])
        del state.fed[valid:]
        state.confirmed = valid
        need = state.table.blocks_needed(len(tokens) - valid + k - 1)
        for other in [rid for rid in self.states if rid not in keep]:
            if need + reserved <= self.pool.num_free:
                break
            self.forget({other})
        if need + reserved > self.pool.num_free:
            self.forget({request.request_id})
            return None
        return need

    def _grow(self, state: DraftState, tokens: list[int]) -> list[int]:
        """Append ``tokens`` to the state (blocks allocated, as _sync made room); their slots."""
        table, start = state.table, state.table.num_tokens
        table.add_blocks(self.pool.allocate(table.blocks_needed(len(tokens))))
        table.advance(len(tokens))
        state.fed += tokens
        return [table.slot(t) for t in range(start, start + len(tokens))]

    # -- running the draft -------------------------------------------------------------------
    @torch.inference_mode()
    def _draft(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        states = [self.states[r.request_id] for r in requests]
        histories = [r.all_token_ids for r in requests]
        self._prefill(requests, states, histories)
        # The last one or two tokens of each row in one step shaped like a verify.
        batch = []
        for state, tokens in zip(states, histories):
            start = state.table.num_tokens
            batch.append((tokens[start], start, self._grow(state, tokens[start:])))
        for row, state in enumerate(states):
            self.worker.cache.adopt(row, torch.tensor(state.table.slots(batch[row][1]), dtype=torch.long))
            state.confirmed = len(state.fed)
        logits = self._step(requests, [(token, position, slots, tuple(tokens[position + 1:]))
                                       for (token, position, slots), tokens in zip(batch, histories)])
        drafted: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        steps = max(ks)
        for step in range(steps):
            tokens, q = self._choose(logits, requests, drafted, [step < k for k in ks])
            for i, token in enumerate(tokens):
                drafted[i].append(token)
                if q is not None and q[i] is not None:
                    dists[i].append(q[i])
            if step == steps - 1:
                break
            fed = []
            for state, token in zip(states, tokens):
                position = state.table.num_tokens
                fed.append((token, position, self._grow(state, [token]), ()))
            logits = self._step(requests, fed)
        return drafted, [torch.stack(d) if d else None for d in dists]

    def _prefill(self, requests: list[Request], states: list[DraftState], histories: list[list[int]]) -> None:
        """Eager prefill chunks until every row has at most two tokens left to feed."""
        while True:
            chunks = []
            for row, (request, state, tokens) in enumerate(zip(requests, states, histories)):
                start = state.table.num_tokens
                end = min(len(tokens) - 1, start + PREFILL_CHUNK)
                if len(tokens) - start <= 2 or end <= start:
                    continue
                self._grow(state, tokens[start:end])
                chunks.append(PrefillChunk(request.request_id, row, start, tuple(tokens[start:end]),
                                           tuple(state.table.slots(end)), is_last=False))
            if not chunks:
                return
            self.worker.forward(StepPlan((), None, tuple(chunks)))

    def _step(self, requests: list[Request], fed: list[tuple[int, int, list[int], tuple[int, ...]]]) -> torch.Tensor:
        """One draft forward: row i feeds ``fed[i]`` = (token, position, its slots, the tokens after
        it); returns the logits at each row's last fed token."""
        n = len(fed)
        extra = [tuple(f[3]) for f in fed]
        most = max(map(len, extra))
        rows, width, queries = step_shape(self.buckets, n, max(position + len(more) for _, position, _, more in fed) + 1,
                                          1 + most)
        verify = queries > 1
        batch = DecodeBatch(tuple(r.request_id for r in requests), tuple(range(n)), tuple(f[0] for f in fed),
                            tuple(f[1] for f in fed), tuple(f[2][0] for f in fed), rows, width,
                            tuple(extra) if verify else (), tuple(tuple(f[2][1:]) for f in fed) if verify else (),
                            queries)
        start = time.perf_counter()
        logits = self.worker.forward(StepPlan((), batch, ())).logits
        self.step_seconds += time.perf_counter() - start
        self.steps += 1
        if queries == 1:
            return logits
        last = torch.tensor([len(more) for more in extra]).add(1).cumsum(0).sub(1)
        return logits.index_select(0, last.to(logits.device))

    def _choose(self, logits: torch.Tensor, requests: list[Request], drafted: list[list[int]], wanted: list[bool]
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """The draft's next token per row: the argmax for a greedy row, else a draw from its own
        distribution (returned as q: what acceptance divides by). A row past its own k (another
        row drafts further) takes the argmax: it draws nothing, so a seeded row's generator
        advances by its own proposals alone, whatever shares the batch."""
        logits = logits.float()
        if all(r.params.greedy for r in requests):
            return logits.argmax(dim=-1).tolist(), None
        histories = [(r.prompt_token_ids, r.output_token_ids + d) for r, d in zip(requests, drafted)] \
            if any(r.params.uses_penalties for r in requests) else None
        params = [r.params for r in requests]
        _, probs = self.distribution(logits, params, histories)
        tokens, q = [], []
        for i, request in enumerate(requests):
            if request.params.greedy or not wanted[i]:
                tokens.append(int(logits[i].argmax()))
                q.append(None)
                continue
            tokens.append(int(torch.multinomial(probs[i], 1, generator=request.generator)))
            q.append(probs[i].cpu())
        return tokens, q


def build_draft(config: SpeculativeConfig, source, plan: WeightPlan | None, dtype: torch.dtype,
                target_spec: WorkerConfig, target_vocab: int, distribution: Distribution) -> DraftProposer:
    """A draft proposer for the speculative ``config``: ``source`` (a path, or a LlamaModel used
    as it is where ``plan`` is None) held in ``plan`` / ``dtype``, beside a target built with
    ``target_spec``: a pool of the target's size in tokens, rows for the steps that speculate,
    and a grid of 1- and 2-token steps."""
    rows = max(1, min(target_spec.max_batch_size, config.disable_by_batch_size - 1))
    buckets = None
    if target_spec.buckets is not None:
        row_buckets = tuple(r for r in target_spec.buckets.rows if r < rows) + (rows,)
        widths = target_spec.buckets.widths
        tier = plan.tier if plan is not None else None
        head_dim = source.config.head_dim if not isinstance(source, str) else None
        if head_dim is None:
            from nanoserve.model.formats.loader import load_config  # the file's header only

            head_dim = load_config(source).head_dim
        if decode_attention_kernel(target_spec.device, dtype, head_dim, tier, target_spec.kv_cache_types) is not None:
            widths = (target_spec.max_model_len,)  # the kernel reads each row's own cells: one width
        buckets = Buckets(tuple(sorted(set(row_buckets))), widths, (1, 2), rows)
    spec = dataclasses.replace(target_spec, weights=plan, dtype=dtype, max_batch_size=rows, buckets=buckets,
                               attention_tier=plan.tier if plan is not None else None, max_queries=2,
                               window_ring=None)
    worker = build_worker(source, spec)
    vocab = worker.model.config.vocab_size
    if vocab != target_vocab:
        raise ValueError(f"speculative draft model has a vocabulary of {vocab} tokens, the target {target_vocab}: "
                         "a draft must share the target's tokenizer")
    return DraftProposer(worker, target_spec.num_blocks, target_spec.block_size, rows, target_spec.max_model_len,
                         buckets, distribution)
