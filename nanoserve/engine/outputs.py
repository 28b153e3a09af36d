"""Output processing: a sampled token joins its request, is detokenized and checked against the
stop conditions; a request's progress becomes a RequestOutput."""

from __future__ import annotations

import time
from collections.abc import Callable

from nanoserve.engine.request import Request, RequestOutput, RequestStatus
from nanoserve.engine.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

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
        ends = (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
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
