"""The engine: requests in, tokens out, many requests sharing each decode step.

Follow a token: ``add_request`` tokenizes and validates (inputs.py); ``step`` asks the scheduler
for a plan, the runner to execute it (while a worker fills the token masks of the rows a grammar
constrains: structured/decoding.py), the sampler for one token per sampled row, and hands
each token to output processing (outputs.py: detokenize, stop conditions). ``generate`` and
``stream`` loop over ``step``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.decode import DecodeStep
from nanoserve.engine.inputs import InputProcessor, Prompt, RequestError, as_prompt_list
from nanoserve.engine.outputs import OutputProcessor
from nanoserve.engine.plan import StepPlan
from nanoserve.engine.prompt_logprobs import score_chunk
from nanoserve.engine.request import Request, RequestOutput
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.sampler import Sampler, sample_isolated
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.stats import EngineStats
from nanoserve.model.quant import tensor_bytes
from nanoserve.structured.compiler import GrammarCompiler
from nanoserve.structured.decoding import GrammarViolation, StructuredDecoding


class Engine:
    """Built by ``build_engine``; ``config`` is its options, resolved."""

    def __init__(self, model, tokenizer, cache, config: EngineConfig, decode_step: DecodeStep,
                 cpu_kernels: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self.runner = ModelRunner(model, cache, decode_step, config.device)
        # What scores prompt positions (its compute_logits); under tensor parallelism the
        # driver's, which has the other ranks join the LM head's gather.
        self.scoring_model = model
        self.scheduler = Scheduler(cache, config.max_batch_size, config.max_num_batched_tokens,
                                   chunked=config.enable_chunked_prefill,
                                   prefill_only_budget=config.prefill_only_budget, buckets=decode_step.buckets)
        self.inputs = InputProcessor(tokenizer, self.vocab_size, config.max_model_len, config.device)
        self.outputs = OutputProcessor(self.eos_token_ids, config.max_model_len)
        self.sampler = Sampler()
        self.structured = StructuredDecoding(structured_compiler(tokenizer, self.vocab_size, self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []
        self.weight_bytes = tensor_bytes(model)  # resident weights, packed codes and any dense copy
        self.cpu_kernels = cpu_kernels  # the kernel tier running packed weights (cpu_kernels), if any
        # How each tensor type runs ({"Q4_K": "packed", "F32": "dense"}: weight_plan.weight_types).
        self.weight_types = dict(getattr(model, "weight_types", {}))
        self.file_bytes, self.load_stages = getattr(model, "file_bytes", 0), dict(getattr(model, "load_stages", {}))

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises RequestError if it cannot be served."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self.inputs.request(request_id, prompt, params or SamplingParams())
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if request.params.structured is not None:
            try:
                request.grammar = self.structured.grammar_for(request.params.structured)
            except ValueError as exc:  # a bad grammar, or no tokenizer: this request only
                raise RequestError(str(exc)) from exc
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks and row go back to the pool. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        self.scheduler.finish(request, "abort")
        self._aborted_outputs.append(self.outputs.output(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule a plan, execute it, sample and update; return the requests
        that moved (or finished).

        What belongs to one request (its sampling, its prompt scoring, its detokenizing) fails
        that request alone, with ``finish_reason="error"``. Anything else raising (the model,
        the cache, the scheduler) is an engine fault: it propagates, since the engine's state
        can no longer be trusted."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        plan = self.scheduler.schedule()
        if plan is None:
            return outputs
        sampled = [self.requests[request_id] for request_id in plan.sampled]
        # Masks depend only on tokens already accepted: filled on a worker while the forward runs.
        grammars = [r.grammar for r in sampled]
        pending_masks = self.structured.start_masks(grammars)
        result = self.runner.execute(plan)
        masks, broken = self.structured.finish_masks(pending_masks, grammars)
        failed = self._score_prompts(plan, result.hidden)  # request -> why it failed
        failed.update((sampled[row], message) for row, message in broken.items())
        if sampled:
            histories = [(r.prompt_token_ids, r.output_token_ids) for r in sampled] \
                if any(r.params.uses_penalties for r in sampled) else None
            token_ids, logprobs, bad = sample_isolated(self.sampler, result.logits, [r.params for r in sampled],
                                                       [r.generator for r in sampled], histories, masks)
            failed.update((sampled[row], message) for row, message in bad.items())
            for request, token_id, logprob in zip(sampled, token_ids.tolist(), logprobs):
                if request in failed:
                    self._finish(request, "error", failed.pop(request))
                elif request.params.max_tokens == 0:
                    self._finish(request, "length")  # prefill only: the prompt was the work
                elif (end := self._append(request, token_id, logprob)) is not None:
                    self._finish(request, *end)
        for request, message in failed.items():  # a chunk that failed before its last one
            self._finish(request, "error", message)
            sampled.append(request)
        return outputs + [self.outputs.output(r) for r in sampled]

    def _append(self, request: Request, token_id: int, logprob) -> tuple[str, str | None] | None:
        """The token joins the request; its grammar (if any) advances first, and a token that
        completes the grammar ends the reply."""
        complete = False
        if request.grammar is not None:
            ends = (token_id in self.eos_token_ids and not request.params.ignore_eos) \
                or token_id in request.params.stop_token_ids
            try:
                complete = request.grammar.accept(token_id, ends)
            except GrammarViolation as exc:
                return "error", str(exc)
        return self.outputs.append_token(request, token_id, logprob, complete)

    def _score_prompts(self, plan: StepPlan, hidden: dict[int, torch.Tensor]) -> dict[Request, str]:
        failed = {}
        for index, states in hidden.items():
            chunk = plan.prefill[index]
            request = self.requests[chunk.request_id]
            if (error := score_chunk(self.scoring_model, request, chunk, states)) is not None:
                failed[request] = error
        return failed

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(request, reason, error=error)
        self.requests.pop(request.request_id, None)
    # -- loops -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order. A prompt that cannot be
        served gets an output with ``finish_reason="error"`` and the others still run."""
        prompts = as_prompt_list(prompts)
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        results: dict[int, RequestOutput] = {}
        pending: dict[str, int] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params_list)):
            try:
                pending[self.add_request(prompt, p)] = index
            except RequestError as exc:
                results[index] = self.outputs.rejected(f"rejected-{next(self._ids)}", prompt, p, str(exc))
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req")
        bar.update(len(results))
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    results[pending.pop(out.request_id)] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in range(len(prompts))]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text increments of one request as they are decoded (other requests may share
        the steps). Closing the iterator early aborts the request."""
        request_id = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id != request_id:
                        continue
                    if out.new_text:
                        yield out.new_text
                    if out.finished:
                        if out.error:
                            raise RequestError(out.error)
                        return
        finally:
            self.abort(request_id)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             use_tqdm: bool = False) -> RequestOutput:
        """Apply the model's chat template (with the generation prompt) and generate."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer; this engine was built without one")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], params, use_tqdm=use_tqdm)[0]

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the engine started (a tensor-parallel engine's worker processes);
        idempotent. A one-process engine holds nothing else to release."""
        self.structured.close()
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bookkeeping -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, d, cache, config = self.scheduler.stats, self.runner.decode_step.stats, self.cache, self.config
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), steps=s.steps,
            prefill_steps=s.prefill_steps, decode_steps=s.decode_steps, prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens, preemptions=s.preemptions, compactions=s.compactions,
            finished=s.finished, aborted=s.aborted, failed=s.failed, max_decode_rows=s.max_decode_rows,
            mean_decode_rows=s.decode_rows_total / max(s.decode_steps, 1), windows=cache.slot_table.windows,
            gathers=cache.slot_table.gathers, blocks_free=cache.pool.num_free, blocks_total=cache.pool.num_blocks,
            compiled=config.compile, graphs_built=d.graphs_built, recompiles_after_warmup=d.recompiles_after_warmup,
            warmup_seconds=d.warmup_seconds, bucket_hits=dict(d.bucket_hits), padding_waste=d.waste.ratio,
            weights=config.weights, weight_bytes=self.weight_bytes, weight_types=dict(self.weight_types),
            file_bytes=self.file_bytes, load_stages=dict(self.load_stages),
            cpu_kernels=self.cpu_kernels,
            compute_dtype=str(config.dtype).removeprefix("torch."), chunked_prefill=config.enable_chunked_prefill,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            prefill_only_budget=self.scheduler.prefill_only_budget, prefix_caching=cache.enable_prefix_caching,
            prefix_cache_queries=cache.prefix_queries, prefix_cache_hits=cache.prefix_hits,
            prefix_cache_blocks=cache.pool.num_registered, prefix_cache_evictions=cache.pool.evictions,
            structured_requests=self.structured.requests, mask_steps=self.structured.mask_steps,
            mask_seconds=self.structured.mask_seconds)

    def check_drained(self) -> None:
        """vLLM's 'scheduler is empty' check: nothing queued or running, every block and row
        back. Raises AssertionError naming what leaked."""
        problems = []
        if self.scheduler.waiting or self.scheduler.running:
            problems.append(f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running")
        held = self.cache.pool.num_used - 1  # the scratch block is the cache's own, for good
        if held:
            problems.append(f"{held} blocks still allocated")
        if self.cache.live_rows:
            problems.append(f"rows {self.cache.live_rows} still claimed")
        if problems:
            raise AssertionError("engine not drained: " + "; ".join(problems))


def structured_compiler(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler | None:
    """The grammar compiler for this model's vocabulary (None without a `tokenizers` backend)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    return GrammarCompiler(backend, vocab_size, eos_token_ids)
