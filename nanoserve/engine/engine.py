"""The engine: requests in, tokens out, many requests sharing each decode step.

Follow a token: ``add_request`` tokenizes and validates; ``step`` asks the scheduler for a
batch, the runner for logits, the sampler for one token per row, then appends the tokens,
detokenizes and checks the stop conditions. ``generate`` and ``stream`` loop over ``step``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from nanoserve.engine.decode import DecodeStep
from nanoserve.engine.prompt_logprobs import score_prompt
from nanoserve.engine.request import Request, RequestOutput, RequestStatus
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.sampler import Sampler
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import PrefillChunk, Scheduler
from nanoserve.model.quant import tensor_bytes
from nanoserve.model.tokenizer import IncrementalDetokenizer


class RequestError(ValueError):
    """A request that cannot be served (too long, empty, bad ids). It fails alone."""


def unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone UTF-16 surrogate can be neither tokenized nor
    sent back as UTF-8), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode text ({exc.reason} at character {exc.start})"
    return None


@dataclass
class StepTiming:
    """Wall time of whole steps and of the model forward inside them (host clock; on a GPU the
    forward figure includes waiting for the device, since sampling reads the tokens back)."""

    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    steps: int = 0

    @property
    def outside_forward_share(self) -> float:
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_batch_size: int
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    compile: bool = False
    weights: str = "fp32"  # the weight format in use (WeightPlan.name, or the dense dtype's name)
    cpu_kernels: str | None = None  # the kernel tier running packed weights (cpu_kernels), if any
    enable_chunked_prefill: bool = True
    prefill_only_budget: int | None = None  # a step without decode rows (None: max_num_batched_tokens)


Prompt = str | Sequence[int]


class Engine:
    def __init__(self, model, tokenizer, cache, config: EngineConfig, decode_step: DecodeStep) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self.runner = ModelRunner(model, cache, decode_step, config.device)
        self.scheduler = Scheduler(cache, config.max_batch_size, config.max_num_batched_tokens,
                                   on_row_move=self.runner.move_row, chunked=config.enable_chunked_prefill,
                                   prefill_only_budget=config.prefill_only_budget)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []
        self.decode_timing = StepTiming()
        self.weight_bytes = tensor_bytes(model)  # resident weights, packed codes and any dense copy
        # How each tensor type runs ({"Q4_K": "packed", "F32": "dense"}: quant.weight_types).
        self.weight_types = dict(getattr(model, "weight_types", {}))

    @classmethod
    def build(cls, **kwargs) -> Engine:
        """Same as :func:`build_engine`: load the model, size the pool, build the engine."""
        from nanoserve.engine.build import build_engine
        return build_engine(**kwargs)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises RequestError if it cannot be served."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, prompt=text)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks and row go back to the pool. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        self.scheduler.finish(request, "abort")
        self._aborted_outputs.append(self._output(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (decode rows, prefill chunks, or both); return the requests that
        moved (or finished).

        What belongs to one request (its sampling, its prompt scoring, its detokenizing) fails
        that request alone, with ``finish_reason="error"``. Anything else raising (the model,
        the cache, the scheduler) is an engine fault: it propagates, since the engine's state
        can no longer be trusted."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        failed: dict[Request, str] = {}  # request -> why it failed
        logits = []
        folded = len(step.decode) if step.prefill and self.runner.folds_decode else 0  # one forward for both
        if step.decode and not folded:
            logits.append(self.runner.decode(step.decode))
        if step.prefill:
            logits.append(self._prefill(step.prefill, failed, decode=folded))
        requests = step.sampled
        if requests:
            token_ids, logprobs = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0],
                                               requests, failed)
            self.runner.record_tokens(requests[0].row, token_ids)
            for request, token_id, logprob in zip(requests, token_ids.tolist(), logprobs):
                if request in failed:
                    self._fail(request, failed.pop(request))
                elif request.params.max_tokens == 0:
                    self._finish(request, "length")  # prefill only: the prompt was the work
                else:
                    self._append_token(request, token_id, logprob)
        for request, message in failed.items():  # a chunk that failed before its last one
            self._fail(request, message)
            requests = requests + [request]
        if step.decode and not step.prefill:  # a pure decode step: the host-overhead figure's sample
            self.decode_timing.steps += 1
            self.decode_timing.forward_seconds += self.runner.last_forward_seconds
            self.decode_timing.step_seconds += time.perf_counter() - started
        return outputs + [self._output(r) for r in requests]

    def _prefill(self, chunks: list[PrefillChunk], failed: dict[Request, str], decode: int = 0) -> torch.Tensor:
        """Run the chunks (and, folded into the same forward, ``decode`` decode rows); score the
        prompt tokens they cover for requests that ask. Returns the decode rows' logits, then
        the last chunks'. (The scheduler registered the chunks' full blocks with the prefix cache.)"""
        to_score = frozenset(i for i, c in enumerate(chunks) if self._scores(c))
        logits, hidden = self.runner.prefill(chunks, to_score, decode)
        for index in sorted(to_score):
            self._score_prompt(chunks[index], hidden[index], failed)
        return logits

    @staticmethod
    def _scores(chunk: PrefillChunk) -> bool:
        """Whether this chunk covers prompt positions still to be scored (the first prefill
        scores; a recompute after preemption finds the scores already made)."""
        request = chunk.request
        if request.params.prompt_logprobs is None:
            return False
        scored = 0 if request.prompt_logprobs is None else len(request.prompt_logprobs)
        return scored < len(request.prompt_token_ids) and chunk.start < len(request.prompt_token_ids)

    def _score_prompt(self, chunk: PrefillChunk, hidden: torch.Tensor, failed: dict[Request, str]) -> None:
        # Position p's logits score prompt token p + 1: this chunk scores tokens start + 1 ..
        request, prompt = chunk.request, chunk.request.prompt_token_ids
        targets = prompt[chunk.start + 1:min(chunk.end, len(prompt) - 1) + 1]
        # A prefill restarted by preemption rescores from its start: the same positions, the same values.
        scored = (request.prompt_logprobs or [None])[:chunk.start + 1]
        try:
            request.prompt_logprobs = scored + score_prompt(self.model, hidden, targets,
                                                            request.params.prompt_logprobs)
        except Exception as exc:  # this request's own work: it fails alone
            failed[request] = f"prompt scoring failed: {type(exc).__name__}: {exc}"

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                failed: dict[Request, str]) -> tuple[torch.Tensor, list]:
        """One token per row. If sampling the batch raises, every row is sampled alone (a seeded
        row's generator rewound first), so only a row that fails on its own fails."""
        params = [r.params for r in requests]
        generators = [r.generator for r in requests]
        histories = None
        if any(p.uses_penalties for p in params):
            histories = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            sampled = self.sampler(logits, params, generators, histories)
            return sampled.token_ids, sampled.logprobs
        except Exception:  # find the rows at fault below
            pass
        token_ids = torch.zeros(len(requests), dtype=torch.long, device=logits.device)
        logprobs: list = [None] * len(requests)
        for row, (p, generator, state) in enumerate(zip(params, generators, states)):
            if generator is not None:
                generator.set_state(state)
            try:
                one = self.sampler(logits[row:row + 1], [p], [generator],
                                   None if histories is None else [histories[row]])
            except Exception as exc:
                failed[requests[row]] = f"sampling failed: {type(exc).__name__}: {exc}"
                continue
            token_ids[row], logprobs[row] = one.token_ids[0], one.logprobs[0]
        return token_ids, logprobs

    def _append_token(self, request: Request, token_id: int, logprob) -> None:
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.perf_counter()
        params = request.params
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        ends = is_eos or token_id in params.stop_token_ids
        if request.detokenizer is not None and not ends \
                and not self._detokenize(request, lambda: request.detokenizer.add(token_id)):
            return
        if not ends and self._hit_stop_string(request):
            reason = "stop"  # the text is cut before the stop string; nothing held back matters
        elif ends or len(request.output_token_ids) >= params.max_tokens \
                or request.num_tokens >= self.config.max_model_len:
            reason = "stop" if ends else "length"
            if request.detokenizer is not None and not self._detokenize(request, request.detokenizer.flush):
                return
        else:
            return
        self._finish(request, reason)

    def _detokenize(self, request: Request, produce) -> bool:
        """Append ``produce()``'s text; a detokenizer that raises fails this request alone."""
        try:
            request.output_text += produce()
        except Exception as exc:
            self._fail(request, f"detokenizing failed: {type(exc).__name__}: {exc}")
            return False
        return True

    @staticmethod
    def _hit_stop_string(request: Request) -> bool:
        text = request.output_text
        for stop in request.params.stop:
            # Only the tail can hold a new match; search from where a match could start.
            start = text.find(stop, max(0, request.emitted_chars - len(stop)))
            if start >= 0:
                request.output_text = text[:start]
                return True
        return False

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(request, reason, error=error)
        self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, message: str) -> None:
        self._finish(request, "error", message)

    def _output(self, request: Request) -> RequestOutput:
        text = request.output_text
        if not request.finished and request.params.stop:
            # Hold back a tail that could still become a stop string.
            text = text[: max(request.emitted_chars, len(text) - max(map(len, request.params.stop)) + 1)]
        new_text = text[request.emitted_chars:]
        new_ids = request.output_token_ids[request.emitted_tokens:]
        request.emitted_chars = len(text)
        request.emitted_tokens = len(request.output_token_ids)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, text,
            list(request.output_token_ids), request.finished, request.finish_reason, new_text,
            new_ids, list(request.logprobs) if request.params.logprobs is not None else None,
            request.metrics, request.error, request.prompt_logprobs)

    # -- loops -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order. A prompt that cannot be
        served gets an output with ``finish_reason="error"`` and the others still run."""
        prompts = _as_prompt_list(prompts)
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        results: dict[int, RequestOutput] = {}
        pending: dict[str, int] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params_list)):
            try:
                pending[self.add_request(prompt, p)] = index
            except RequestError as exc:
                results[index] = self._rejected_output(prompt, p, str(exc))
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

    # -- bookkeeping -----------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer; pass token ids instead")
            if (problem := unicode_problem(prompt)) is not None:
                raise RequestError(f"prompt: {problem}")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {limit}, "
                               f"so a prompt may have at most {limit - 1} (one slot for the reply)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:8]}")

    def _rejected_output(self, prompt: Prompt, params, message: str) -> RequestOutput:
        request = Request(f"rejected-{next(self._ids)}", [] if isinstance(prompt, str) else list(prompt),
                          params or SamplingParams(), prompt=prompt if isinstance(prompt, str) else None)
        request.finish_reason, request.error = "error", message
        request.status = RequestStatus.FINISHED
        return self._output(request)

    def stats(self) -> dict:
        s = self.scheduler.stats
        d = self.runner.decode_step.stats
        table = self.cache.slot_table
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "steps": s.steps, "prefill_steps": s.prefill_steps,
            "decode_steps": s.decode_steps, "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens, "preemptions": s.preemptions,
            "compactions": s.compactions, "finished": s.finished, "aborted": s.aborted,
            "failed": s.failed, "max_decode_rows": s.max_decode_rows,
            "mean_decode_rows": s.decode_rows_total / max(s.decode_steps, 1),
            "windows": table.windows, "gathers": table.gathers,
            "blocks_free": self.cache.pool.num_free, "blocks_total": self.cache.pool.num_blocks,
            "compiled": self.config.compile, "graphs_built": d.graphs_built,
            "recompiles_after_warmup": d.recompiles_after_warmup, "warmup_seconds": d.warmup_seconds,
            "bucket_hits": dict(d.bucket_hits), "padding_waste": d.waste.ratio,
            "decode_outside_forward_share": self.decode_timing.outside_forward_share,
            "weights": self.config.weights, "weight_bytes": self.weight_bytes, "weight_types": self.weight_types,
            "cpu_kernels": self.config.cpu_kernels, "compute_dtype": str(self.config.dtype).removeprefix("torch."),
            "chunked_prefill": self.config.enable_chunked_prefill,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "prefill_only_budget": self.scheduler.prefill_only_budget,
            "prefix_caching": self.cache.enable_prefix_caching, **self.cache.prefix_cache_stats(),
        }

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


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # one prompt given as token ids
        return [prompts]
    return prompts
