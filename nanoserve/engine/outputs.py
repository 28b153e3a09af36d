"""Output processing: a sampled token advances its request's grammar, joins the request, is
detokenized and checked against the stop conditions; a request's progress becomes a RequestOutput."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanoserve.engine.request import Request, RequestOutput, RequestStatus
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.structured.decoding import GrammarViolation

if TYPE_CHECKING:
    from nanoserve.worker.plan import StepPlan
    from nanoserve.worker.worker import StepOutput


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def append_tokens(self, request: Request, token_ids: list[int], logprobs: list
                      ) -> tuple[str, str | None] | None:
        """Add a row's tokens in order, each first advancing the request's grammar (if any: a
        token that completes it ends the reply, one outside it fails the request), then joining
        as ``append_token`` does. Stops at the first token that ends the request: (reason, error)."""
        for token_id, logprob in zip(token_ids, logprobs):
            complete = False
            if request.grammar is not None:
                try:
                    complete = request.grammar.accept(token_id, self.ends_reply(request, token_id))
                except GrammarViolation as exc:
                    return "error", str(exc)
            if (end := self.append_token(request, token_id, logprob, complete)) is not None:
                return end
        return None

    def ends_reply(self, request: Request, token_id: int) -> bool:
        """An EOS token (unless the request ignores EOS) or one of its stop tokens."""
        return (token_id in self.eos_token_ids and not request.params.ignore_eos) \
            or token_id in request.params.stop_token_ids

    def append_token(self, request: Request, token_id: int, logprob,
                     complete: bool = False) -> tuple[str, str | None] | None:
        """Add a sampled token (and its logprob) to the request's output and text. Returns
        (finish reason, error) when the request ends here ("stop", "length", or "error" when its
        detokenizer raised: that fails this request alone), else None. ``complete``: the token
        completes the request's grammar, so nothing may follow it ("stop", the token kept)."""
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.perf_counter()
        params = request.params
        ends = self.ends_reply(request, token_id)
        if request.detokenizer is not None and not ends:
            if (error := _detokenize(request, lambda: request.detokenizer.add(token_id))) is not None:
                return "error", error
        if not ends and _hit_stop_string(request):
            return "stop", None  # the text is cut before the stop string; nothing held back matters
        if ends or complete or len(request.output_token_ids) >= params.max_tokens \
                or request.num_tokens >= self.max_model_len:
            if request.detokenizer is not None and (error := _detokenize(request, request.detokenizer.flush)):
                return "error", error
            return ("stop" if ends or complete else "length"), None
        return None

    @staticmethod
    def take_chunk_results(plan: StepPlan, result: StepOutput, requests: dict[str, Request]) -> dict[Request, str]:
        """Each prefill chunk's share of the step's output joins its request: its scored prompt
        logprobs (a prefill restarted by preemption rescores from its start: the same positions,
        the same values) and its pooled part (a mean's sum restarts with a chunk from position 0:
        a recompute after preemption). Returns the requests whose scoring failed (-> why)."""
        for index, part in result.pooled.items():
            chunk = plan.prefill[index]
            request = requests.get(chunk.request_id)
            if request is None:
                continue
            if chunk.pool != "mean":
                request.pooled = part
            elif chunk.start == 0 or request.pooled is None:
                request.pooled, request.pooled_count = part, chunk.length
            else:
                request.pooled, request.pooled_count = request.pooled + part, request.pooled_count + chunk.length
        for index, scored in result.prompt_logprobs.items():
            chunk = plan.prefill[index]
            request = requests[chunk.request_id]
            request.prompt_logprobs = (request.prompt_logprobs or [None])[:chunk.start + 1] + scored
        return {requests[plan.prefill[index].request_id]: error for index, error in result.prompt_errors.items()}

    @staticmethod
    def output(request: Request) -> RequestOutput:
        """Everything so far and what is new since the last output of this request."""
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
            request.metrics, request.error, request.prompt_logprobs, request.stop_string,
            request.pooled if request.finished and request.finish_reason != "error" else None)

    def rejected(self, request_id: str, prompt, params: SamplingParams | None, message: str) -> RequestOutput:
        """The output of a prompt that was refused before it became a request."""
        request = Request(request_id, [] if isinstance(prompt, str) else list(prompt), params or SamplingParams(),
                          prompt=prompt if isinstance(prompt, str) else None)
        request.finish_reason, request.error = "error", message
        request.status = RequestStatus.FINISHED
        return self.output(request)


def _detokenize(request: Request, produce: Callable[[], str]) -> str | None:
    """Append ``produce()``'s text; a detokenizer that raises gives the error message."""
    try:
        request.output_text += produce()
    except Exception as exc:
        return f"detokenizing failed: {type(exc).__name__}: {exc}"
    return None


def _hit_stop_string(request: Request) -> bool:
    text = request.output_text
    for stop in request.params.stop:
        # Only the tail can hold a new match; search from where a match could start.
        start = text.find(stop, max(0, request.emitted_chars - len(stop)))
        if start >= 0:
            request.output_text = text[:start]
            request.stop_string = stop
            return True
    return False
