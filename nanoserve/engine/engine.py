"""The engine: requests in, tokens out, many requests sharing each decode step.

Follow a token: ``add_request`` tokenizes and validates (inputs.py); ``step`` asks the scheduler
for a plan and the worker to execute it: the worker runs the forward and chooses every sampled
row's tokens (worker/sampling.py), under the masks of the rows a grammar constrains, which a
thread fills beside the forward (structured/decoding.py). The engine commits them: the scheduler
hears what each row kept, and each token goes to output processing (outputs.py: grammar,
detokenize, stop conditions). With speculation (nanoserve/speculative) a decode row also feeds the
tokens its proposer guessed, the worker verifies them (acceptance.py: a prefix accepted, one
token of the target's after it), the row is trimmed to what it kept, and the rows propose again
for the next step. ``generate`` and ``stream`` loop over ``step``. The host side (scheduler,
block manager, requests) and the device side (the worker: model, K/V, slot table, logits) share
nothing: the plan and the rows' sampling inputs go down, tokens come back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from nanoserve.engine.checks import check_applied, check_step
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.inputs import InputProcessor, Prompt, RequestError, as_prompt_list
from nanoserve.engine.outputs import OutputProcessor
from nanoserve.engine.request import Request, RequestOutput
from nanoserve.engine.resolved import ResolvedConfig
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.stats import EngineStats
from nanoserve.engine.threads import apply_threads
from nanoserve.model.formats.chat_templates import with_chat_template
from nanoserve.model.quant.linear import tensor_bytes
from nanoserve.speculative.speculator import Speculator
from nanoserve.structured.compiler import GrammarCompiler
from nanoserve.structured.decoding import StructuredDecoding
from nanoserve.worker.plan import StepPlan
from nanoserve.worker.sampling import RowSampling, StepSampling
from nanoserve.worker.worker import StepOutput, Worker, WorkerStats


class Engine:
    """Built by ``build_engine``: ``config`` is what was asked, ``resolved`` what it resolved
    to. ``checks`` runs the gates on every step (NANOSERVE_CHECKS=1)."""

    def __init__(self, worker: Worker, scheduler: Scheduler, tokenizer, config: EngineConfig,
                 resolved: ResolvedConfig, checks: bool = False, speculator: Speculator | None = None) -> None:
        self.worker = worker
        self.speculator = speculator  # None: no speculation
        self._left: set[str] = set()  # requests finished since the speculator last heard
        self.scheduler = scheduler
        # With chat_template, a copy of the model's tokenizer holding that template instead.
        self.tokenizer = with_chat_template(tokenizer, config.chat_template) if config.chat_template else tokenizer
        self.config = config
        self.resolved = resolved
        self.checks = checks
        # Set here for the steps (the command line sets it before the load as well).
        self.threads = apply_threads(config.threads)
        model_config = worker.model.config
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.inputs = InputProcessor(tokenizer, self.vocab_size, resolved.max_model_len, config.device)
        self.outputs = OutputProcessor(self.eos_token_ids, resolved.max_model_len)
        self.structured = StructuredDecoding(structured_compiler(tokenizer, self.vocab_size, self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []
        self.weight_bytes = tensor_bytes(worker.model)  # resident weights, packed codes and any dense copy
        # How each tensor type runs ({"Q4_K": "packed", "F32": "dense"}: weight_plan.weight_types).
        self.weight_types = dict(getattr(worker.model, "weight_types", {}))
        # The model file's size and how long each stage of loading it took (model/formats/loader.py).
        self.file_bytes = getattr(worker.model, "file_bytes", 0)
        self.load_stages = dict(getattr(worker.model, "load_stages", {}))

    @property
    def model(self):
        """The worker's model (under tensor parallelism, rank 0's shard)."""
        return self.worker.model

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
        if self.speculator is not None:
            self._left.add(request_id)
        self._aborted_outputs.append(self.outputs.output(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute (the worker chooses the tokens), commit, propose; returns the requests
        that moved. A fault of one request's own (its sampling, prompt scoring, detokenizing,
        grammar) fails it alone (``finish_reason="error"``); anything else raising is an engine
        fault and propagates: the engine's state can no longer be trusted."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        plan = self.scheduler.schedule()
        if plan is not None:
            outputs += self._commit(plan, *self._execute(plan))
        if self.speculator is not None and (plan is not None or self._left):
            self._propose()
        return outputs

    def _execute(self, plan: StepPlan) -> tuple[StepOutput, dict[int, str]]:
        """The worker's output, and the sampled rows whose grammar broke (row -> why). Masks
        depend only on tokens already accepted: a thread fills them while the forward runs."""
        if self.checks:
            check_step(plan, self.scheduler.blocks)
        sampled = [self.requests[request_id] for request_id in plan.sampled]
        grammars = [r.grammar for r in sampled]
        pending = self.structured.start_masks(grammars)
        result = self.worker.execute(plan, StepSampling([row_sampling(r) for r in sampled], pending))
        if self.checks:
            check_applied(result, self.worker, self.scheduler.blocks)
        return result, self.structured.finish_masks(pending, grammars)[1]

    def _propose(self) -> None:
        """The rows decoding next step propose their tokens (after this step's tokens joined
        them); what the proposer kept for finished requests goes."""
        if self._left:
            self.speculator.forget(self._left)
            self._left = set()
        self.speculator.propose(self.scheduler.running[:self.scheduler.num_decoding])

    def _commit(self, plan: StepPlan, result: StepOutput, broken: dict[int, str]) -> list[RequestOutput]:
        """Verifying rows keep the K/V of what they accepted; each sampled row's tokens join its
        request (a stop ends it there), and the requests that ended or failed finish."""
        sampled = [self.requests[request_id] for request_id in plan.sampled]
        self.scheduler.update(plan, result)
        if self.speculator is not None:
            self.speculator.update(plan, result, sampled)
        failed = self.outputs.take_chunk_results(plan, result, self.requests)  # request -> why it failed
        failed.update((sampled[row], message) for row, message in broken.items())
        failed.update((r, row.error) for r, row in zip(sampled, result.rows) if row.error is not None)
        for request, row in zip(sampled, result.rows):
            if request in failed:
                self._finish(request, "error", failed.pop(request))
            elif request.params.pooling is not None:
                self._finish_pooled(request, row.ranked)
            elif request.params.max_tokens == 0:
                self._finish(request, "length")  # prefill only: the prompt was the work
            elif (end := self.outputs.append_tokens(request, row.token_ids, row.logprobs)) is not None:
                self._finish(request, *end)
        for request, message in failed.items():  # a chunk that failed before its last one
            self._finish(request, "error", message)
            sampled.append(request)
        return [self.outputs.output(r) for r in sampled]

    def _finish_pooled(self, request: Request, ranked) -> None:
        """A pooled request's prompt is done: its vector (for "rank", the last position's logits)
        is its output, and it finishes ("length": prefill only); its blocks and row go back."""
        pooling = request.params.pooling
        if pooling == "rank":
            request.pooled = ranked
        elif pooling == "mean" and request.pooled is not None:
            if request.pooled_count != len(request.prompt_token_ids):
                request.pooled = None  # some positions were never computed: no mean to give
            else:
                request.pooled = request.pooled / request.pooled_count
        if request.pooled is None:
            self._finish(request, "error", f"pooling {pooling!r}: the worker returned no pooled state")
            return
        self._finish(request, "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(request, reason, error=error)
        self.requests.pop(request.request_id, None)
        if self.speculator is not None:
            self._left.add(request.request_id)
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
        if self.speculator is not None:
            self.speculator.close()
        self.worker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bookkeeping -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, w, blocks = self.scheduler.stats, self.worker.stats(), self.scheduler.blocks
        d, config, resolved = w.decode, self.config, self.resolved
        counts = {k: v for k, v in dataclasses.asdict(s).items() if k != "decode_rows_total"}  # the scheduler's counters
        return EngineStats(
            **counts, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            mean_decode_rows=s.decode_rows_total / max(s.decode_steps, 1), windows=w.windows,
            gathers=w.gathers, blocks_free=blocks.pool.num_free, blocks_total=blocks.pool.num_blocks,
            compiled=resolved.compile, graphs_built=w.graphs_built, graphs_loaded=d.graphs_loaded,
            graphs_ready=w.graphs_ready, graphs_building=w.graphs_building, graphs_pending=w.graphs_pending,
            eager_steps=d.eager_steps,
            recompiles_after_warmup=d.recompiles_after_warmup, warmup_seconds=d.warmup_seconds,
            graph_load_seconds=d.load_seconds, bucket_hits=dict(d.bucket_hits), padding_waste=d.waste.ratio,
            weights=resolved.weights, weight_bytes=self.weight_bytes, weight_types=dict(self.weight_types),
            file_bytes=self.file_bytes, load_stages=dict(self.load_stages),
            cpu_kernels=resolved.cpu_kernels,
            compute_dtype=str(resolved.dtype).removeprefix("torch."), chunked_prefill=config.enable_chunked_prefill,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            prefill_only_budget=self.scheduler.prefill_only_budget, prefix_caching=blocks.enable_prefix_caching,
            prefix_cache_queries=blocks.prefix_queries, prefix_cache_hits=blocks.prefix_hits,
            prefix_cache_blocks=blocks.pool.num_registered, prefix_cache_evictions=blocks.pool.evictions,
            structured_requests=self.structured.requests, mask_steps=self.structured.mask_steps,
            mask_seconds=self.structured.mask_seconds, verify_bucket_hits=dict(d.verify_bucket_hits),
            **self._spec_stats(w.draft))

    def _spec_stats(self, drafted: WorkerStats | None) -> dict:
        """The speculator's counters, and the draft model's graphs and K/V (``drafted``: the worker's
        stats of its draft, None without one)."""
        if self.speculator is None:
            return {}
        s = self.speculator.stats
        graphs = {} if drafted is None else dict(spec_draft_graphs_built=drafted.graphs_built,
                                                 spec_draft_recompiles=drafted.decode.recompiles_after_warmup,
                                                 spec_draft_kv_bytes=drafted.kv_bytes)
        return dict(**graphs, spec_method=self.speculator.config.method, spec_verify_steps=s.verify_steps,
                    spec_proposed_tokens=s.proposed, spec_accepted_tokens=s.accepted,
                    spec_acceptance_rate=s.acceptance_rate, spec_mean_accepted_length=s.mean_accepted_length,
                    spec_draft_seconds=s.draft_seconds, spec_verify_seconds=s.verify_seconds)

    def check_drained(self) -> None:
        """vLLM's 'scheduler is empty' check: nothing queued or running, every block and row
        back. Raises AssertionError naming what leaked."""
        problems = []
        if self.scheduler.waiting or self.scheduler.running:
            problems.append(f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running")
        blocks = self.scheduler.blocks
        held = blocks.pool.num_used - 1  # the scratch block is the manager's own, for good
        if held:
            problems.append(f"{held} blocks still allocated")
        if blocks.live_rows:
            problems.append(f"rows {blocks.live_rows} still claimed")
        if problems:
            raise AssertionError("engine not drained: " + "; ".join(problems))



def row_sampling(request: Request) -> RowSampling:
    """What the worker needs to choose the request's next tokens (and to draft them)."""
    return RowSampling(request.params, request.generator, (request.prompt_token_ids, request.output_token_ids))


def structured_compiler(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler | None:
    """The grammar compiler for this model's vocabulary (None without a `tokenizers` backend)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    return GrammarCompiler(backend, vocab_size, eos_token_ids)
