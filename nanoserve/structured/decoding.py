"""The engine's side of constrained decoding: each request's matcher, the step's masks computed
on a worker thread while the forward runs, and the matcher advanced on each accepted token.

A step's masks depend only on tokens already accepted, so they are started before the forward
and collected after it: llguidance fills them with the GIL released, beside the model.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence

import llguidance
import torch

from nanoserve.structured.compiler import GrammarCompiler
from nanoserve.structured.masks import PendingMasks, TokenMasks
from nanoserve.structured.params import StructuredOutputs
from nanoserve.structured.tools import RepeatGuard


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """`rows` masks of `vocab_size` bits in int32 words, every token allowed (llguidance's layout)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarViolation(RuntimeError):
    """A token the request's grammar cannot take (its matcher says why); fails that request."""


class RequestGrammar:
    """One request's matcher. With ``after`` the constraint starts only once the reply's bytes
    contain it (a thinking model's ``</think>``, however it was tokenized); until then decoding
    is free. ``token_bytes`` gives a token's bytes. ``guard`` (a tool-call envelope's
    RepeatGuard) sees the bytes of every token the matcher takes."""

    def __init__(self, matcher: llguidance.LLMatcher, after: bytes = b"",
                 token_bytes: Callable[[int], bytes] | None = None, guard: RepeatGuard | None = None) -> None:
        self.matcher = matcher
        self.after, self.token_bytes = after, token_bytes
        self.started = not after
        self.guard = guard
        self._tail = b""

    @property
    def closing(self) -> bool:
        """Whether the next token should close the call list where the grammar allows (a repeat)."""
        return self.guard is not None and self.guard.closing

    def accept(self, token_id: int, ends_reply: bool) -> bool:
        """Advance on a sampled token; True when the grammar is complete (nothing can follow).
        A token that ends the reply (EOS, a stop token) is not fed: the mask allowed it only
        where the grammar accepts. Raises GrammarViolation for a token outside the grammar."""
        if not self.started:
            self._tail = (self._tail + self.token_bytes(token_id))[-4 * len(self.after):]
            self.started = self.after in self._tail
            return False
        if ends_reply:
            return False
        if not self.matcher.consume_token(token_id):
            raise GrammarViolation(f"structured output: token {token_id} breaks the grammar "
                                   f"({self.matcher.get_error() or 'not allowed here'})")
        if self.guard is not None:
            self.guard.feed(self.token_bytes(token_id))
        return self.matcher.is_stopped()


class StructuredDecoding:
    """Per engine: the grammar compiler (None without a tokenizer), the worker that fills masks,
    and the counters ``EngineStats`` reports."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.requests = 0  # constrained requests admitted
        self.mask_steps = 0  # steps that computed at least one mask
        self.mask_seconds = 0.0  # time filling masks (on the worker, beside the forward)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._closers: torch.Tensor | None = None  # the bitmask of RepeatGuard.CLOSERS' tokens

    def grammar_for(self, spec: StructuredOutputs) -> RequestGrammar:
        """A new request's grammar. Raises StructuredOutputError (bad grammar) or ValueError
        (no tokenizer to compile against)."""
        if self.compiler is None:
            raise ValueError("structured outputs need the model's tokenizer; this engine has none")
        after = spec.after.encode() if spec.after else b""
        guard = RepeatGuard() if spec.distinct_calls else None
        grammar = RequestGrammar(self.compiler.matcher(spec), after, self.compiler.token_bytes, guard)
        self.requests += 1
        return grammar

    def start_masks(self, grammars: Sequence[RequestGrammar | None]) -> PendingMasks | None:
        """Begin filling the masks of the sampled rows whose constraint applies (None: none does)."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.started]
        if not rows:
            return None
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-masks")
            self._executor = llguidance.LLExecutor()
        matchers = [grammars[row].matcher for row in rows]
        closing = [i for i, row in enumerate(rows) if grammars[row].closing]  # read here: the loop's state
        return PendingMasks(rows, self._worker.submit(self._fill, matchers, closing))

    def finish_masks(self, pending: PendingMasks | None, grammars: Sequence[RequestGrammar | None]
                     ) -> tuple[TokenMasks | None, dict[int, str]]:
        """The step's masks, and the rows whose matcher has failed (row -> why): a grammar that
        ran out of its parser's limits fails its request rather than end it as if complete."""
        if pending is None:
            return None, {}
        bitmask, seconds = pending.future.result()
        self.mask_steps += 1
        self.mask_seconds += seconds
        failed = {row: f"structured output: {grammars[row].matcher.get_error()}"
                  for row in pending.rows if grammars[row].matcher.is_error()}
        return TokenMasks(pending.rows, bitmask), failed

    def _fill(self, matchers: list[llguidance.LLMatcher], closing: Sequence[int] = ()):
        start = time.perf_counter()
        bitmask = token_bitmask(len(matchers), self.compiler.vocab_size)
        # llguidance writes each row's words in parallel with the GIL released (what its torch helper
        # does, without that module's import-time torch.compile, which costs a second of start-up).
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                               bitmask.shape[1] * bitmask.element_size(), len(matchers))
        for i in closing:
            narrowed = bitmask[i] & self.closers()
            if narrowed.any():  # else the list cannot close here (mid-call): the grammar's mask stands
                bitmask[i] = narrowed
        return bitmask, time.perf_counter() - start

    def closers(self) -> torch.Tensor:
        """The bitmask of the tokens that are exactly one of RepeatGuard.CLOSERS (``]``, ``]}``)."""
        if self._closers is None:
            vocabulary = self.compiler.vocabulary
            words = [0] * token_bitmask(1, self.compiler.vocab_size).shape[1]
            for text in RepeatGuard.CLOSERS:
                ids = vocabulary.tokenize_str(text)
                if len(ids) == 1 and vocabulary.decode_bytes(ids) == text.encode():
                    words[ids[0] // 32] |= 1 << (ids[0] % 32)
            mask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
            self._closers = mask
        return self._closers

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
