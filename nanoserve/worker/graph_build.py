"""Building decode graphs ahead of time, here or in a background process of their own.

``aot_build`` traces and compiles one bucket of a ``DecodeStep``'s forward with torch's
``aot_compile`` and returns the serialised graph. ``BackgroundBuilder`` runs those builds in a
child process (``python -m nanoserve.worker.graph_build``) at the lowest CPU priority with one
thread, so the step loop keeps both cores while graphs compile: the child gets the model hollow
(its modules and each tensor's layout, no weights: they are graph inputs), builds the same buffers, writes each graph to the ``GraphCache`` and says so on its stdout; a
reader thread here loads the finished entry, and the step swaps it in between steps. A child
process rather than a thread because tracing and code generation hold Python's lock for seconds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from nanoserve.worker.graph_cache import CacheEntryError, GraphCache, GraphKey, deserialize, serialize

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (rows, width, queries)


def no_guards(entries) -> list[bool]:
    """A graph's guards are its cache key (every shape, dtype and model attribute it depends
    on), checked before it is loaded; the step picks a graph by its bucket, so none run per call."""
    return [False] * len(entries)


# The least work, in elements, that inductor gives each thread of a CPU kernel it splits over
# threads. At its default (512) a batch-1 step's norms, rotary embedding and SiLU, 2-8 K elements
# each, were each an OpenMP fork and join: ~100 of them in a 1B step, each ~5 us on a 2-core VM
# for about a microsecond of work (a compiled residual add, RMS norm and SiLU at one row: 39 us a
# call split, 23 us whole). From 32 rows (64 K elements a norm) they are split as before.
CPU_MIN_CHUNK = 16384
MIN_CHUNK_ENV = "TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE"  # inductor's own setting


def cpu_min_chunk() -> int:
    """CPU_MIN_CHUNK, or the user's own value of inductor's setting (MIN_CHUNK_ENV) where set: what
    a graph is built with, and so part of its key (DecodeStep.graph_key)."""
    return int(os.environ.get(MIN_CHUNK_ENV, CPU_MIN_CHUNK))


def inductor_backend(mode: str | None, cpp_wrapper: bool) -> torch._TorchCompileInductorWrapper:
    """Inductor in ``mode``; with ``cpp_wrapper`` (a CPU graph: DecodeStep.cpp_wrapper) the graph
    calls its kernels from generated C++ rather than Python. A 1B step makes ~200 calls, on which
    the Python wrapper spent ~2 ms of a 32 ms step. The C++ wrapper is built apart from the
    kernels, which keeps a build 1.5-2x a Python wrapper's rather than 3.5x; CUDA graphs (what
    reduce-overhead means) need the Python wrapper, and a CPU has none to record.
    The C++ wrapper's size asserts are off: each checked an input's (~500 at 135M) or a kernel
    output's sizes and strides on every call, building a std::stringstream each time (~0.2 ms of
    a 6 ms step), and the graph's key already holds every input's shape, stride and dtype."""
    options = {"cpp.min_chunk_size": cpu_min_chunk()}  # (a CUDA graph has no C++ kernels to split)
    if cpp_wrapper:
        options |= {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "triton.cudagraphs": False,
                    "size_asserts": False}
    return torch._TorchCompileInductorWrapper(mode, options, False)


def aot_build(step, shape: Shape) -> bytes:
    """Compile ``step``'s forward for one bucket ahead of time; the serialised graph."""
    from nanoserve.worker.decode_step import decode_forward

    step.mark_static()
    # aot_compile is on by default from torch 2.13, the first release whose results serialise
    # (graph_cache.torch_serialises_graphs: before it, no step is built here).
    compiler = torch.compile(decode_forward, backend=inductor_backend(step.mode, step.cpp_wrapper),
                             fullgraph=True, dynamic=False, options={"guard_filter_fn": no_guards})
    # Inductor keeps fused bf16 intermediates in fp32 unless told to round where eager rounds;
    # rounding alike makes a compiled bf16 step choose eager's tokens.
    with torch.inference_mode(), torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = compiler.aot_compile((step.forward_args(*shape), {}))
    return serialize(compiled)


def build_entry(step, cache: GraphCache, shape: Shape) -> bool:
    """Build ``shape``'s entry unless a valid one is there (another process may have built it
    while this one waited for the lock). True when this call compiled it."""
    key = step.graph_key(shape)
    with cache.building(key):
        if cache.has(key):
            try:
                cache.read(key)
                return False
            except CacheEntryError as error:
                cache.discard(key, str(error))
        with cache.inductor_env():
            payload = aot_build(step, shape)
        cache.store(key, payload)
        return True


def load_entry(cache: GraphCache, key: GraphKey):
    """The entry's compiled function, or None when there is none or it is refused (named in one
    line and removed, so it is rebuilt)."""
    try:
        payload = cache.read(key)
    except FileNotFoundError:
        return None
    except CacheEntryError as error:
        cache.discard(key, str(error))
        return None
    try:
        with cache.inductor_env():
            return deserialize(payload)
    except Exception as error:  # torch refused the bytes: a stale or damaged entry
        cache.discard(key, f"{cache.path(key)}: torch could not load it ({type(error).__name__}: {error})")
        return None


def _hollow_tensor(parameter: bool, shape: tuple, stride: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    tensor = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return torch.nn.Parameter(tensor, requires_grad=False) if parameter else tensor


class _HollowPickler(pickle.Pickler):
    """Pickles every tensor as its shape, stride, dtype and device only: a graph takes the
    weights as inputs and is keyed by their layout, so the builder needs the model's structure
    and never its values. Unpickled, each is an uninitialised tensor whose pages are never
    touched (a hollow 18 GB model costs the child no memory)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _hollow_tensor, (isinstance(obj, torch.nn.Parameter), tuple(obj.shape), tuple(obj.stride()),
                                    obj.dtype, str(obj.device))
        return NotImplemented


@dataclass
class BuildJob:
    """What the child needs to rebuild the parent's step: the model object (sent hollow: its
    modules and every tensor's layout, no values), the worker's spec, the cache, and the key
    the parent expects per shape. ``threads``: the parent's torch threads, the team inductor's
    generated loops are written for (the child itself runs on one), so a graph built here is the
    one an eager warmup in the parent builds."""

    model: object
    spec: object
    cache_root: str
    keys: dict[Shape, GraphKey]
    threads: int = dataclasses.field(default_factory=torch.get_num_threads)


JOIN_SECONDS = 30.0  # how long close waits for the reader to finish the graph it is loading


class BackgroundBuilder:
    """The parent's side: ``request`` a shape (first come, first built; a repeated request moves
    it to the front), ``ready`` the graphs loaded since the last call. ``close`` ends the child."""

    def __init__(self, job: BuildJob, cache: GraphCache, shapes: list[Shape]) -> None:
        self.cache, self.keys = cache, job.keys
        self.pending: list[Shape] = list(shapes)
        self.failed: dict[Shape, str] = {}
        self.built = 0
        self.build_seconds: dict[Shape, float] = {}  # per bucket the child built (or found built)
        self._ready: queue.Queue = queue.Queue()
        self._asked: set[Shape] = set()
        with tempfile.NamedTemporaryFile(dir=cache.root, prefix=".job-", suffix=".pkl", delete=False) as out:
            _HollowPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(job)
        self._job_path = out.name
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   NANOSERVE_BUILDER_PARENT=str(os.getpid()))
        # The child lowers its own priority before it imports torch (no preexec_fn: the engine's
        # process is then spawned from, not forked with its page tables).
        # Its stderr goes to a file: the last lines name the cause if it dies before it says "failed".
        self._errors = tempfile.TemporaryFile(mode="w+", dir=cache.root, prefix=".builder-")
        self._closing = False
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self._job_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._errors, text=True, env=env, bufsize=1)
        for shape in shapes:
            self._send("add", shape)
        self._reader = threading.Thread(target=self._read, name="nanoserve-graph-loader", daemon=True)
        self._reader.start()

    @property
    def building(self) -> int:
        return len(self.pending) if self._child.poll() is None else 0

    def request(self, shape: Shape) -> None:
        """Build ``shape`` next (a step just met it); said once per shape."""
        if shape in self.pending and shape not in self._asked:
            self._asked.add(shape)
            self._send("next", shape)

    def ready(self) -> list[tuple[Shape, object]]:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._ready.get_nowait())
        return out

    def _send(self, word: str, shape: Shape) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self._child.stdin.write(f"{word} {' '.join(map(str, shape))}\n")
            self._child.stdin.flush()

    def _read(self) -> None:
        """Load each graph the child reports built (off the step loop), until it exits."""
        for line in self._child.stdout:
            word, *rest = line.split(maxsplit=4)
            if word not in ("built", "found", "failed") or len(rest) < 3:
                continue
            shape = tuple(int(x) for x in rest[:3])
            if word == "failed":
                self.failed[shape] = rest[3] if len(rest) > 3 else "unknown"
                log.warning("nanoserve: the graph for rows=%d width=%d queries=%d did not build (%s); that "
                            "bucket stays eager", *shape, self.failed[shape].strip())
            else:
                self.built += word == "built"
                self.build_seconds[shape] = float(rest[3]) if len(rest) > 3 else 0.0
                compiled = load_entry(self.cache, self.keys[shape])
                if compiled is not None:
                    self._ready.put((shape, compiled))
            with contextlib.suppress(ValueError):
                self.pending.remove(shape)
        code = self._child.wait()
        if self.pending and not self._closing:  # it died (a crash, the OOM killer) with buckets to build
            self._errors.seek(0)
            said = [line.strip() for line in self._errors.read().splitlines() if line.strip()]
            why = f"the graph builder exited with code {code}" + (f": {said[-1][:300]}" if said else "")
            for shape in self.pending:
                self.failed[shape] = why
            log.warning("nanoserve: %s; %d bucket(s) stay eager", why, len(self.pending))
            self.pending = []

    def close(self) -> None:
        self._closing = True
        if self._child.poll() is None:
            self._child.kill()
        self._child.wait()
        # The reader ends at the child's end of output (after any graph it is loading): joined, so
        # no thread of the engine's is still inside torch when the process exits.
        if self._reader is not threading.current_thread():
            self._reader.join(JOIN_SECONDS)
        for stream in (self._child.stdin, self._child.stdout, self._errors):
            with contextlib.suppress(OSError, ValueError):
                stream.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._job_path)


# The builder runs only on CPU time nothing else wants (Linux's idle class, else nice 19), from
# before it imports torch: a time slice taken from one of the step's OpenMP threads stalls them all.
# It ends with the engine's process (the parent-death signal): starved of CPU, it might otherwise
# notice its closed stdin only minutes later, holding its memory all the while.
_CHILD = """import os, runpy, signal
parent = int(os.environ.pop("NANOSERVE_BUILDER_PARENT", os.getppid()))
try:  # Linux: end with the engine's process (SIGKILL: a starved child may never run a handler)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent died before the signal was armed
    raise SystemExit(0)
try:
    os.nice(19)
except OSError:
    pass
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (OSError, AttributeError):
    pass
runpy.run_module("nanoserve.worker.graph_build", run_name="__main__")
"""


def _child_main(job_path: str) -> int:
    """Build what the parent asks ("add": in turn; "next": before the rest), each once, until its
    stdin closes and nothing is left."""
    torch.set_num_threads(1)
    from nanoserve.worker.build import build_worker

    with open(job_path, "rb") as job_file:
        job: BuildJob = pickle.load(job_file)  # the parent's own file, made for this child
    os.unlink(job_path)
    from torch._inductor import config as inductor_config

    inductor_config.cpp.threads = job.threads
    cache = GraphCache(job.cache_root)
    step = build_worker(job.model, dataclasses.replace(job.spec, compile=False)).decode_step
    todo: collections.deque[Shape] = collections.deque()
    arrived = threading.Condition()
    closed = []

    def read_requests() -> None:
        for line in sys.stdin:
            word, *numbers = line.split()
            with arrived:
                (todo.appendleft if word == "next" else todo.append)(tuple(int(x) for x in numbers))
                arrived.notify()
        with arrived:
            closed.append(True)
            arrived.notify()

    threading.Thread(target=read_requests, daemon=True).start()
    done: set[Shape] = set()
    while True:
        with arrived:
            arrived.wait_for(lambda: todo or closed)
            if closed:  # the engine has gone, and with it the reason to build
                return 0
            shape = todo.popleft()
        if shape in done:
            continue
        done.add(shape)
        named = " ".join(map(str, shape))
        try:
            if step.graph_key(shape) != job.keys.get(shape):
                raise RuntimeError("this process's model or buffers differ from the engine's (their keys differ)")
            began = time.perf_counter()
            word = "built" if build_entry(step, cache, shape) else "found"
            print(f"{word} {named} {time.perf_counter() - began:.3f}", flush=True)
        except Exception as error:  # reported to the parent, which keeps that bucket eager
            print(f"failed {named} {type(error).__name__}: {str(error)[:300]}".replace("\n", " "), flush=True)


def memory_allows_builder(model_bytes: int, kv_bytes: int) -> bool:
    """Whether a second copy of the model and its K/V fits in the memory left now."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return True
    return model_bytes + kv_bytes + (1 << 30) < available


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))

