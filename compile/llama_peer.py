"""llama.cpp as a peer: the same GGUF file through llama-cpp-python's low-level API.

An optional extra (``pip install -e '.[peers]'``; it compiles llama.cpp from source for several
minutes). Every suite runs without it and says so. Rows are llama.cpp sequences: a decode
step is one ``llama_decode`` over a batch of one token per sequence, then a greedy argmax
over its logits (or, sampling, llama.cpp's own sampler chain), the same work as the engine's
decode step.
"""

from __future__ import annotations

import ctypes
import functools
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoserve.model.formats.loader import resolve_model_path

NAME = "llama.cpp"
ABSENT = ("llama.cpp: llama-cpp-python is not installed, so its arm is skipped "
          "(pip install -e '.[peers]' adds it; it compiles from source for several minutes)")


def available() -> bool:
    """Whether llama-cpp-python imports (installed, with its dependencies and shared library)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _silent_log():
    import llama_cpp

    return llama_cpp.llama_log_callback(lambda level, text, user_data: None)


# nanoserve's K/V cache types as ggml's type ids (llama.cpp's --cache-type-k/v)
CACHE_TYPES = {"fp32": 0, "bf16": 30, "q8_0": 8}


class LlamaCpp:
    """One llama.cpp model and context: up to ``max_rows`` sequences of ``max_len`` tokens each,
    up to ``max_batch_tokens`` tokens per ``decode`` call, on ``threads`` threads.

    ``repack``: llama.cpp's default, the weights repacked into its extra buffer types
    (interleaved rows for its AVX-512/AVX2/NEON kernels, AMX tiles where the CPU lists AMX).
    On some hosts every ``llama_decode`` over repacked weights segfaults (AMX on this project's
    Sapphire Rapids VM): ``repack_mode`` finds out in a child process before a run relies on it."""

    def __init__(self, path: Path, max_rows: int, max_len: int, threads: int,
                 max_batch_tokens: int = 512, repack: bool = True, cache_type: str | None = None) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        # its load log is pages long; the callback is process-wide in llama.cpp, so it must outlive every peer
        llama_cpp.llama_log_set(_silent_log(), ctypes.c_void_p())
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = repack
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = max_rows
        params.kv_unified = False  # each sequence its own cache stream: attention reads only its own tokens
        params.n_ctx = max_rows * max_len
        params.n_batch = params.n_ubatch = max(max_batch_tokens, max_rows)
        params.n_threads = params.n_threads_batch = threads
        if cache_type is not None:  # --cache-type-k/v (default f16; a quantised V needs flash attention: auto)
            params.type_k = params.type_v = CACHE_TYPES[cache_type]
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        if not self.context:
            raise RuntimeError(f"llama.cpp could not make a context for {max_rows} rows of {max_len} tokens")
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.max_batch_tokens = params.n_batch
        self.batch = llama_cpp.llama_batch_init(self.max_batch_tokens, 0, 1)
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.max_batch_tokens,))
        self._positions = np.ctypeslib.as_array(self.batch.pos, shape=(self.max_batch_tokens,))
        self._wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(self.max_batch_tokens,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.max_batch_tokens,))[:] = 1
        self._seq_ids = [self.batch.seq_id[i] for i in range(self.max_batch_tokens)]

    def clear(self) -> None:
        """Forget every sequence's cache."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.context), True)

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
               wants_logits: np.ndarray) -> np.ndarray:
        """One ``llama_decode`` of ``len(tokens)`` tokens; returns the logits of the flagged
        ones in order, ``[flagged, vocab]``, as a view valid until the next call."""
        n = len(tokens)
        if n > self.max_batch_tokens:
            raise ValueError(f"{n} tokens in one decode; this context takes at most {self.max_batch_tokens}")
        self._tokens[:n] = tokens
        self._positions[:n] = positions
        self._wants_logits[:n] = wants_logits
        for i, seq in enumerate(seq_ids):
            self._seq_ids[i][0] = int(seq)
        self.batch.n_tokens = n
        status = self.lib.llama_decode(self.context, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        flagged = int(np.count_nonzero(wants_logits))
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.context), shape=(flagged, self.vocab_size))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.context)
        self.lib.llama_model_free(self.model)


class LlamaCppSteps:
    """Decoding of one batch of prompts, one step per ``step()`` call, each timed: the first call
    is the prefill (one decode per prompt), every later one a batched decode step. Greedy, or with
    ``law`` (SamplingParams fields: temperature, top_k, top_p, min_p) by llama.cpp's own sampler
    chain in its command line's order (top-k, top-p, min-p, temperature, then the draw)."""

    def __init__(self, peer: LlamaCpp, prompts: list[list[int]], new_tokens: int, law: dict | None = None) -> None:
        peer.clear()
        self.peer = peer
        self.chain = None
        if law is not None and law.get("temperature", 1.0) > 0:
            self.chain = _sampler_chain(peer.lib, law)
        self.prompts = prompts
        self.new_tokens = new_tokens
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.durations: list[float] = []
        self._rows = np.arange(len(prompts))
        self._all_rows = np.ones(len(prompts), dtype=np.int8)

    @property
    def done(self) -> bool:
        return len(self.outputs[0]) >= self.new_tokens

    def step(self) -> None:
        if self.done:
            return
        started = time.perf_counter()
        if not self.durations:
            self._prefill()
        else:
            last = np.array([out[-1] for out in self.outputs])
            positions = np.array([len(p) + len(out) - 1 for p, out in zip(self.prompts, self.outputs)])
            logits = self.peer.decode(last, positions, self._rows, self._all_rows)
            if self.chain is None:
                for out, token in zip(self.outputs, logits.argmax(axis=1).tolist()):
                    out.append(token)
            else:
                for row, out in enumerate(self.outputs):
                    out.append(self._sample(row))
        self.durations.append(time.perf_counter() - started)
        if self.done:
            self.close()

    def _prefill(self) -> None:
        for row, prompt in enumerate(self.prompts):
            logits = prefill_logits(self.peer, prompt, every_position=False, sequence=row)
            self.outputs[row].append(int(logits[-1].argmax()) if self.chain is None else self._sample(-1))

    def _sample(self, output: int) -> int:
        """The chain's token from the last decode's output ``output`` (-1: its last)."""
        return int(self.peer.lib.llama_sampler_sample(self.chain, self.peer.context, output))

    def close(self) -> None:
        """Free the sampler chain (a finished run's)."""
        if self.chain is not None:
            self.peer.lib.llama_sampler_free(self.chain)
            self.chain = None

    @property
    def decode_steps(self) -> list[float]:
        return self.durations[1:]

    @property
    def tokens(self) -> list[list[int]]:
        return self.outputs


def _sampler_chain(lib, law: dict):
    """llama.cpp's sampler chain for a law: the filters it sets, the temperature, a seeded draw."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if law.get("top_k", 0) > 0:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(law["top_k"]))
    if law.get("top_p", 1.0) < 1.0:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(law["top_p"], 1))
    if law.get("min_p", 0.0) > 0.0:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(law["min_p"], 1))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(law["temperature"]))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(0))
    return chain


def prefill_logits(peer: LlamaCpp, token_ids: list[int], every_position: bool, sequence: int = 0) -> np.ndarray:
    """One sequence (id ``sequence``, empty before: the caller's to clear) prefilled in chunks of
    the context's batch: the logits of every position ``[T, vocab]``, or of the last one
    ``[1, vocab]``, float32."""
    chunks = []
    for start in range(0, len(token_ids), peer.max_batch_tokens):
        chunk = np.array(token_ids[start:start + peer.max_batch_tokens])
        n = len(chunk)
        wants_logits = np.full(n, every_position, dtype=np.int8)
        wants_logits[-1] |= start + n == len(token_ids)
        logits = peer.decode(chunk, np.arange(start, start + n), np.full(n, sequence, dtype=np.int32), wants_logits)
        if wants_logits.any():
            chunks.append(logits.copy())
    return np.concatenate(chunks)


def teacher_forced_logits(peer: LlamaCpp, token_ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``token_ids`` as one sequence, ``[T, vocab]``."""
    peer.clear()
    return prefill_logits(peer, token_ids, every_position=True)


def gguf_of(model: str) -> Path | None:
    """The GGUF file llama.cpp would run for ``model``; None, saying why, when it is not one."""
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return path
    print(f"llama.cpp: {path} is not a GGUF file, so its arm is skipped")
    return None


@dataclass(frozen=True)
class RepackMode:
    """How a run's llama.cpp holds its weights, and what to print beside its figures."""

    repack: bool
    label: str  # "defaults (repacking on)", or why it is off


def repack_crash(path: Path, threads: int, timeout_s: float = 300.0) -> str | None:
    """Whether llama.cpp's default (repacked weights) decodes ``path`` on this host: None if a
    child process loads it and decodes a prompt and a step, else how the child died."""
    command = [sys.executable, "-m", "compile.llama_peer", "--probe", str(path), str(threads)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
    return f"exit {done.returncode}" + (f": {tail[0]}" if tail else "")


def repack_mode(path: Path, wanted: str, threads: int) -> RepackMode:
    """``wanted``: "auto" (llama.cpp's default where it runs here, else off, saying why), "on" or "off"."""
    if wanted == "off":
        return RepackMode(False, "repacking off (asked)")
    crash = repack_crash(path, threads)
    if crash is None:
        return RepackMode(True, "defaults (repacking on)")
    if wanted == "on":
        raise RuntimeError(f"llama.cpp with repacked weights fails on this host ({crash})")
    return RepackMode(False, f"repacking off: its default crashes here ({crash})")


def load_as_run(path: Path, max_rows: int, max_len: int, threads: int, wanted: str = "auto",
                max_batch_tokens: int = 512, cache_type: str | None = None) -> tuple[LlamaCpp, RepackMode]:
    """llama.cpp as its users run it (``repack_mode``), and the label its figures carry;
    ``cache_type`` its K/V cells' type (None: its default, f16)."""
    mode = repack_mode(path, wanted, threads)
    print(f"llama.cpp: {mode.label}" + (f", K/V {cache_type}" if cache_type else ""))
    return LlamaCpp(path, max_rows, max_len, threads, max_batch_tokens, repack=mode.repack,
                    cache_type=cache_type), mode


def _probe(path: Path, threads: int) -> None:
    peer = LlamaCpp(path, 1, 64, threads, max_batch_tokens=32, repack=True)
    n = 8
    wants_logits = np.zeros(n, dtype=np.int8)
    wants_logits[-1] = 1
    peer.decode(np.arange(1, n + 1), np.arange(n), np.zeros(n, dtype=np.int32), wants_logits)
    peer.decode(np.array([1]), np.array([n]), np.zeros(1, dtype=np.int32), np.ones(1, dtype=np.int8))
    peer.close()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--probe":
    _probe(Path(sys.argv[2]), int(sys.argv[3]))
