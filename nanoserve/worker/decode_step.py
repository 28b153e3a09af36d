"""The decode step as one fixed-shape function of persistent buffers, eager or compiled.

``decode_forward`` reads everything from buffers that live as long as the engine: the
per-row input tokens, positions, write slots, context lengths, the slot table's buffer and
the per-layer K/V caches. Its only other inputs are two Python ints, the bucketed
``rows`` and ``width``, so under ``torch.compile`` each bucket is one specialised graph
and, on a GPU with ``mode="reduce-overhead"``, one CUDA graph replayed at fixed addresses.
``DecodeStep.load`` fills those buffers from a step's ``DecodePlan``.

Compiled on the CPU, a bucket's graph comes from the ``GraphCache`` (built once per machine,
loaded in a fraction of a second); a bucket whose graph is not there yet runs this same forward
eagerly while a background process builds it, and the graph is swapped in between steps.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from nanoserve.worker.attention import WindowAttention
from nanoserve.worker.bucketing import Buckets, PaddingWaste
from nanoserve.worker.graph_build import (
    BackgroundBuilder,
    BuildJob,
    Shape,
    build_entry,
    cpu_min_chunk,
    inductor_backend,
    load_entry,
)
from nanoserve.worker.graph_cache import GraphCache, GraphKey, model_fingerprint
from nanoserve.worker.kv_cache import DecodePlan, KVCache
from nanoserve.worker.kv_cells import KVLayers
from nanoserve.worker.window_ring import ring_writes


def decode_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                   context_lens: torch.Tensor, slot_buffer: torch.Tensor, kv: tuple[list[torch.Tensor], ...],
                   rows: int, width: int, kernel: int | None = None, queries: int = 1,
                   ring_table: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [rows * queries, vocab] for the first ``rows`` rows, ``queries`` tokens each (a
    verify step's row feeds its token and its proposals; the per-query buffers are row-major).
    ``kv`` is the cache's ``KVLayers.step_args()``; ``ring_table`` its window layers' rings
    (window_ring; None: none). The rectangles are sliced from the tables' own buffers here,
    inside the graph, so a capture reads the tables where they live."""
    n = rows * queries
    slot_mapping = slot_buffer[:rows, :width]
    ring = None
    if ring_table is not None:
        row_of = torch.arange(rows, device=ring_table.device).repeat_interleave(queries)
        ring = ring_writes(ring_table, row_of, positions[:n], context_lens[:n]), ring_table[:rows, :width]
    attention = WindowAttention(KVLayers(*kv), write_slots[:n], slot_mapping, context_lens[:n], kernel, ring)
    hidden = model(input_ids[:n], positions[:n], attention)
    return model.compute_logits(hidden)


@dataclass
class DecodeStats:
    graphs_loaded: int = 0  # graphs loaded from the compile cache
    eager_steps: int = 0  # compiled-engine steps that ran eagerly: their bucket had no graph yet
    recompiles_after_warmup: int = 0
    warmup_seconds: float = 0.0  # building graphs on the caller's time (warmup="eager")
    load_seconds: float = 0.0  # loading graphs from the cache at start
    bucket_hits: Counter = field(default_factory=Counter)  # (rows, width) -> decode steps
    verify_bucket_hits: Counter = field(default_factory=Counter)  # (rows, queries, width) -> verify steps
    waste: PaddingWaste = field(default_factory=PaddingWaste)


class DecodeStep:
    """Owns the persistent step buffers and the (optionally compiled) ``decode_forward``.

    ``buckets`` is the grid the graphs cover (the scheduler plans each step's window in it;
    None: exact shapes, the eager engine's default). With ``compile=True`` and a ``graph_cache``
    (inductor on the CPU), each bucket's graph is an ahead-of-time compiled entry of the cache:
    ``prepare_graphs`` loads what is there and builds the rest (now, or in the background while
    those buckets run eagerly). Without a cache (another backend, a GPU, a tensor-parallel rank)
    the forward goes through ``torch.compile(mode=..., fullgraph=True, dynamic=False)`` in this
    process on a bucket's first use, and later calls run under the ``fail_on_recompile``
    stance, so a stray shape is an error instead of a silent rebuild. ``backend`` is inductor's
    name or any torch.compile backend (a callable: a benchmark's own inductor options).
    """

    def __init__(self, model, cache: KVCache, max_batch_size: int, buckets: Buckets | None,
                 compile: bool = False, mode: str | None = "reduce-overhead",
                 device: torch.device | str = "cpu", backend="inductor", cpp_wrapper: bool = True,
                 attention_kernel: int | None = None, max_queries: int = 1,
                 graph_cache: GraphCache | None = None) -> None:
        self.model, self.cache, self.buckets = model, cache, buckets
        self.device = torch.device(device)
        size = max_batch_size * max(max_queries, buckets.queries[-1] if buckets is not None else 1)
        long = dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.write_slots = torch.full((size,), cache.scratch_slot, **long)
        self.context_lens = torch.zeros(size, **long)
        self.attention_kernel = attention_kernel  # decode_attention_kernel's handle, or None: SDPA
        self.stats = DecodeStats()
        self.compiled, self.mode = compile, mode
        self.cpp_wrapper = cpp_wrapper and self.device.type == "cpu"  # graph_build.inductor_backend
        self.graph_cache = graph_cache if compile else None
        self.graphs: dict[Shape, object] = {}  # bucket -> its loaded ahead-of-time graph
        self.builder: BackgroundBuilder | None = None
        self._fingerprint: str | None = None
        self.key_extra: dict[str, object] = {}  # what else a graph depends on (a tensor-parallel rank's place)
        self.build_inline = False  # build a missing graph here on first use (a tensor-parallel rank)
        self._seen: set[tuple[int, int, int]] = set()
        self._graphs_compiled = 0  # graphs this step's in-process backend has compiled
        self._forward = decode_forward
        if compile and graph_cache is None:
            self._prepare_compile(mode, backend)

    # -- graphs from the cache -------------------------------------------------------------
    @property
    def shapes(self) -> list[Shape]:
        """Every (rows, width, queries) bucket a graph is built for."""
        if self.buckets is None:
            return []
        return [(rows, width, 1) for rows, width in self.buckets.grid] + [
            (rows, width, queries) for rows, queries, width in self.buckets.verify_grid]

    def forward_args(self, rows: int, width: int, queries: int = 1) -> tuple:
        return (self.model, self.input_ids, self.positions, self.write_slots, self.context_lens,
                self.cache.slot_table.slots, self.cache.layers.step_args(), rows, width,
                self.attention_kernel, queries, self.cache.ring_table)

    def mark_static(self) -> None:
        """Static addresses: graph capture may then read and write these buffers in place."""
        for tensor in [self.input_ids, self.positions, self.write_slots, self.context_lens,
                       self.cache.slot_table.slots, *self.cache.layers.tensors(),
                       *([self.cache.ring_table] if self.cache.ring_table is not None else [])]:
            torch._dynamo.mark_static_address(tensor)

    def graph_key(self, shape: Shape) -> GraphKey:
        """Everything a bucket's graph depends on (graph_cache: the key)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        layers = self.cache.layers
        kv = layers.k_cells[0]
        return GraphKey.of(
            device=self.device, mode=self.mode, cpp_wrapper=self.cpp_wrapper, attention_kernel=self.attention_kernel,
            model=self._fingerprint,
            kv=(len(layers.k_cells), tuple(kv.shape), *(fmt.name for fmt in layers.formats),
                self.cache.ring.ring if self.cache.ring is not None else None, tuple(self.cache.ring_layers)),
            slots=tuple(self.cache.slot_table.slots.shape),
            buffers=self.input_ids.numel(), scratch_slot=self.cache.scratch_slot, shape=shape,
            min_chunk=cpu_min_chunk(), **self.key_extra)

    def prepare_graphs(self, build: str, source: object = None, spec: object = None) -> None:
        """Load every bucket's cached graph; then build the missing ones: ``build`` "eager" here
        and now, "lazy" in a background process (its buckets run eagerly until each is swapped
        in; ``source`` and ``spec`` are what that process rebuilds this step from), "inline"
        here on a bucket's first use (a tensor-parallel rank), "none" not at all (those buckets
        stay eager)."""
        cache = self.graph_cache
        start = time.perf_counter()
        missing = []
        for shape in self.shapes:
            graph = load_entry(cache, self.graph_key(shape))
            if graph is None:
                missing.append(shape)
            else:
                self.graphs[shape] = graph
                self.stats.graphs_loaded += 1
        self.stats.load_seconds += time.perf_counter() - start
        if not missing:
            return
        if build == "eager":
            self.warmup()
            return
        self.build_inline = build == "inline"
        if build != "lazy":
            return
        keys = {shape: self.graph_key(shape) for shape in missing}
        self.builder = BackgroundBuilder(BuildJob(source, spec, str(cache.root), keys), cache, missing)

    def poll(self) -> None:
        """Swap in the graphs the background builder has finished (between steps)."""
        if self.builder is None:
            return
        for shape, graph in self.builder.ready():
            self.graphs[shape] = graph

    def wait_for_graphs(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until the background builder has nothing left to build,
        swapping in what it built; True when every bucket has its graph."""
        deadline = time.monotonic() + timeout
        while self.builder is not None and self.builder.building and time.monotonic() < deadline:
            time.sleep(0.05)
        self.poll()
        return len(self.graphs) == len(self.shapes)

    def graph_counts(self) -> tuple[int, int, int]:
        """Buckets (ready, building, pending): loaded graphs, the one the builder is on, the rest."""
        if self.graph_cache is None:
            return len(self._seen), 0, 0
        waiting = self.builder.building if self.builder is not None else 0
        return len(self.graphs), min(waiting, 1), max(waiting - 1, 0)

    def runs_graph(self, rows: int, width: int, queries: int = 1) -> bool:
        """Whether a step of this bucket runs a compiled graph (else the eager forward)."""
        return self.compiled and (self.graph_cache is None or (rows, width, queries) in self.graphs)

    @property
    def graphs_built(self) -> int:
        """Graphs compiled for this step: here, or by its background builder."""
        return self._graphs_compiled + (self.builder.built if self.builder is not None else 0)

    def close(self) -> None:
        if self.builder is not None:
            self.builder.close()
            self._graphs_compiled += self.builder.built  # the count outlives the builder
            self.builder = None

    # -- graphs compiled in this process ---------------------------------------------------
    def _prepare_compile(self, mode: str | None, backend) -> None:
        self.mark_static()
        grid = len(self.buckets.grid) + len(self.buckets.verify_grid) if self.buckets is not None else 0
        # Process-wide, because dynamo keeps it per code object: every bucket is a specialisation
        # of decode_forward, and the default limit (8) would silently send the rest of the grid to eager.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 4 * grid + 64)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * grid + 256)
        # mode only means something to inductor; other backends (tests use "eager" to check
        # dynamo's shape discipline without paying for code generation) take none.
        if backend == "inductor":
            compiler = inductor_backend(mode, self.cpp_wrapper)
        elif callable(backend):
            compiler = backend
        else:
            compiler = torch._dynamo.lookup_backend(backend)

        def counted(graph: torch.fx.GraphModule, example_inputs: list) -> object:
            # This step's own count: two engines in one process never see each other's graphs.
            self._graphs_compiled += 1
            return compiler(graph, example_inputs)

        # The model's modules never change under a built step, so their guards (hundreds of
        # attribute and tensor checks, a large share of a small CPU step) are dropped. Still guarded:
        # the bucket's ints, the step's buffers, and the backend, which is this step's own
        # ``counted``, so another engine's graphs are never this one's.
        self._forward = torch.compile(decode_forward, backend=counted, fullgraph=True, dynamic=False,
                                      options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def _build_now(self, shape: Shape):
        """Build (or find built by another process) and load ``shape``'s graph here."""
        compiled = build_entry(self, self.graph_cache, shape)
        self._graphs_compiled += compiled
        self.stats.graphs_loaded += not compiled
        graph = load_entry(self.graph_cache, self.graph_key(shape))
        if graph is None:
            raise RuntimeError(f"the graph for bucket {shape} was built but does not load")
        self.graphs[shape] = graph
        return graph

    @torch.inference_mode()
    def warmup(self, progress=None) -> float:
        """Build every bucket's graph now (into the cache and loaded, or compiled in this process
        and, on a GPU, recorded); returns seconds spent. ``progress(shape, seconds, compiled)``
        hears of each bucket as it is done."""
        start = time.perf_counter()
        self.write_slots.fill_(self.cache.scratch_slot)
        self.context_lens.zero_()
        for shape in self.shapes:
            began, before = time.perf_counter(), self._graphs_compiled
            if self.graph_cache is None:
                for _ in range(3):  # cudagraph trees: warm-up run, record, first replay
                    self._call(*shape)
            elif shape not in self.graphs:
                self._build_now(shape)
            if progress is not None:
                progress(shape, time.perf_counter() - began, self._graphs_compiled > before)
        elapsed = time.perf_counter() - start
        self.stats.warmup_seconds += elapsed
        return elapsed

    def load(self, plan: DecodePlan, rows: int) -> None:
        """Put a step's decode rows in the buffers: their input tokens, positions, write slots
        and lengths (per query in a verify step); the rows past them to the bucket's ``rows``
        are padding (length 0, the scratch slot)."""
        real = len(plan.rows) * plan.queries
        values = plan.query_inputs or (plan.token_ids, plan.positions, plan.write_slots, plan.context_lens)
        for buffer, value in zip((self.input_ids, self.positions, self.write_slots, self.context_lens), values):
            buffer[:real].copy_(value)
        padded = rows * plan.queries
        if padded > real:
            self.write_slots[real:padded].fill_(self.cache.scratch_slot)
            self.positions[real:padded].zero_()
            self.context_lens[real:padded].zero_()

    @torch.inference_mode()
    def run(self, plan: DecodePlan, rows: int) -> torch.Tensor:
        """Run the forward over the loaded buffers in the window [rows, plan.width] (rows >= the
        plan's, padded). Returns logits [plan's rows, vocab] (a verify step: one per real query,
        row-major); on a GPU graph they are overwritten by the next replay, so the caller
        consumes them (the sampler does) before the next step."""
        num_rows, width, queries = len(plan.rows), plan.width, plan.queries
        if queries > 1:
            self.stats.verify_bucket_hits[(rows, queries, width)] += 1
            return self._call(rows, width, queries).index_select(0, plan.real_queries)
        self.stats.bucket_hits[(rows, width)] += 1
        # The masked read covers the whole window; the decode kernel each row's own cells (a
        # padded row's one).
        read = plan.total_context + rows - num_rows if self.attention_kernel is not None else rows * width
        self.stats.waste.add(read, plan.total_context)
        return self._call(rows, width)[:num_rows]

    @torch.inference_mode()  # the same dispatch keys on every call, or the guards would differ
    def _call(self, rows: int, width: int, queries: int = 1) -> torch.Tensor:
        args = self.forward_args(rows, width, queries)
        if not self.compiled:
            return self._forward(*args)
        shape = (rows, width, queries)
        if self.graph_cache is not None:
            self.poll()
            graph = self.graphs.get(shape)
            if graph is None and self.build_inline:
                graph = self._build_now(shape)
            if graph is not None:
                return graph(*args)
            self.stats.eager_steps += 1
            if self.builder is not None:
                self.builder.request(shape)
            return decode_forward(*args)
        before = self._graphs_compiled
        if shape in self._seen:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._forward(*args)
            finally:
                self.stats.recompiles_after_warmup += self._graphs_compiled - before
        self._seen.add(shape)
        # Inductor keeps fused bf16 intermediates in fp32 unless told to round where eager
        # rounds; rounding alike makes a compiled bf16 step choose eager's tokens.
        with torch._inductor.config.patch(emulate_precision_casts=True):
            return self._forward(*args)
