"""build_worker: a model (loaded here when named) and a resolved ``WorkerConfig`` in, a Worker out.

The spec is plain, picklable data that the engine's build resolves once from what was asked;
every tensor-parallel rank builds its worker from the same spec, with its shard.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.cache.gates import check_table_fits
from nanoserve.model.formats.loader import ModelHeader, load_model
from nanoserve.model.network.llama import LlamaModel
from nanoserve.model.quant.weight_plan import WeightPlan, pack_model
from nanoserve.worker.attention import decode_attention_kernel
from nanoserve.worker.bucketing import Buckets
from nanoserve.worker.decode_step import DecodeStep
from nanoserve.worker.graph_build import memory_allows_builder
from nanoserve.worker.graph_cache import GraphCache, torch_serialises_graphs
from nanoserve.worker.huge_pages import move_to_huge_pages
from nanoserve.worker.kv_cache import KVCache
from nanoserve.worker.kv_cells import resolve_cell_format
from nanoserve.worker.slot_table import SlotTable
from nanoserve.worker.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker is built from, resolved: the weights' plan (None: dense in ``dtype``), the
    activations' and K/V dtype, the device, the pool's shape (``num_kv_heads`` is the whole
    model's; a rank holds its share), the decode grid and compile options, the kernel tier that
    reads K/V in decode steps (None: SDPA), whether the graphs are built up front and whether
    the device-side gates run."""

    weights: WeightPlan | None
    dtype: torch.dtype
    device: str
    num_blocks: int
    block_size: int
    max_batch_size: int
    max_model_len: int
    scratch_slot: int
    buckets: Buckets | None = None
    compile: bool = False
    compile_mode: str | None = "reduce-overhead"
    compile_backend: str = "inductor"
    attention_tier: str | None = None
    warmup: str = "lazy"  # when missing graphs are built: "eager" at build (every rank at once), "lazy", "none"
    checks: bool = False
    compile_cache: str | None = None  # the graph cache's directory (None: $NANOSERVE_CACHE_DIR or its default)
    max_queries: int = 1  # tokens a decode row may feed in one step (1 + the speculative tokens)
    kv_cache_types: tuple[str, str] = ("auto", "auto")  # K's and V's storage (kv_cells)
    window_ring: int | None = None  # sliding-window layers' ring cells a row (window_ring; None: the pool's)
    huge_pages: bool = True  # the CPU weights and K/V pool on transparent huge pages (huge_pages.py)
    ring_snapshots: int = 0  # saved rows of rings, for prefix caching beside them (cache/ring_snapshots.py)
    cpp_wrapper: bool = True  # on a CPU, the graphs' calls in generated C++ (graph_build.inductor_backend)


class Shard(Protocol):
    """A tensor-parallel rank's part of the model (nanoserve.distributed.launch.Rank)."""

    size: int

    def shard(self, model: LlamaModel, sources: dict) -> dict: ...

    def parallelize(self, model: LlamaModel) -> None: ...


def build_worker(model: str | ModelHeader | LlamaModel, spec: WorkerConfig, shard: Shard | None = None,
                 slot_table: SlotTable | None = None) -> Worker:
    """A worker over ``model`` (a name or path, or a file the host already opened, loaded here
    without its tokenizer; or a built ``LlamaModel``: packed per ``spec.weights`` in place, or
    copied first when ``shard`` cuts it), and a K/V cache of its K/V heads (over ``slot_table``'s
    rows and slots where given: a draft model's, over the target's)."""
    if isinstance(model, (str, ModelHeader)):
        model, _ = load_model(model, dtype=spec.dtype, device=spec.device, weights=spec.weights,
                              shard=None if shard is None else shard.shard, with_tokenizer=False)
    else:
        if shard is not None:
            model = copy.deepcopy(model)  # the caller's model stays whole
            shard.shard(model, {})
        if spec.weights is not None:
            pack_model(model, spec.weights)
        model = model.to(device=spec.device, dtype=spec.dtype)
    if shard is not None:
        shard.parallelize(model)
    if spec.huge_pages and torch.device(spec.device).type == "cpu":
        move_to_huge_pages(model)
    model.eval().requires_grad_(False)  # inference only: a cache write must never join a graph
    arch = model.config
    kv_heads = arch.num_kv_heads // (shard.size if shard is not None else 1)
    k_format, v_format = (resolve_cell_format(name, spec.dtype, arch.head_dim) for name in spec.kv_cache_types)
    cache = KVCache(arch.num_layers, kv_heads, arch.head_dim, spec.num_blocks, spec.block_size, spec.max_batch_size,
                    spec.max_model_len, spec.scratch_slot, dtype=spec.dtype, device=spec.device, k_format=k_format,
                    v_format=v_format, windows=[arch.layer_window(i) for i in range(arch.num_layers)],
                    ring=spec.window_ring, slot_table=slot_table, ring_snapshots=spec.ring_snapshots,
                    huge_pages=spec.huge_pages)
    kernel = decode_attention_kernel(spec.device, spec.dtype, arch.head_dim, spec.attention_tier,
                                     spec.kv_cache_types)
    # Graphs from the cache: inductor on the CPU, on a torch that serialises them (before that,
    # compiled in process on first use). A tensor-parallel rank's graphs hold its collectives,
    # which no other process can trace, so a rank builds its missing graphs itself.
    cached = (spec.compile and spec.compile_backend == "inductor" and torch.device(spec.device).type == "cpu"
              and spec.buckets is not None and torch_serialises_graphs())
    step = DecodeStep(model, cache, spec.max_batch_size, spec.buckets, compile=spec.compile, mode=spec.compile_mode,
                      device=spec.device, backend=spec.compile_backend,
                      # a rank's collectives take arguments (a process group) the C++ wrapper cannot pass
                      cpp_wrapper=spec.cpp_wrapper and shard is None,
                      attention_kernel=kernel,
                      max_queries=spec.max_queries, graph_cache=GraphCache(spec.compile_cache) if cached else None)
    if spec.checks:  # the slot table's reservation against this worker's K/V
        check_table_fits(spec.max_batch_size, spec.max_model_len, spec.block_size, cache.kv_bytes)
    if cached and shard is not None:
        step.key_extra = dict(rank=shard.rank, ranks=shard.size)
        step.prepare_graphs("eager" if spec.warmup == "eager" else "inline")
    elif cached:
        _prepare_graphs(step, model, spec, cache.kv_bytes)
    elif spec.compile and spec.warmup == "eager" and spec.buckets is not None:
        step.warmup()
    return Worker(model, cache, step, checks=spec.checks)


def _prepare_graphs(step: DecodeStep, model: LlamaModel, spec: WorkerConfig, kv_bytes: int) -> None:
    """Load the cached graphs; build the rest now (warmup) or in a background process, which
    rebuilds this worker from the model as it is now (packed; sent hollow: no weights)."""
    spec = dataclasses.replace(spec, weights=None)
    build = spec.warmup
    if build == "lazy" and not memory_allows_builder(0, kv_bytes):
        log.warning("nanoserve: too little memory for a background graph builder; buckets without a cached graph "
                    "run eagerly: `nanoserve warmup` builds them ahead")
        build = "none"
    step.prepare_graphs(build, model, dataclasses.replace(spec, warmup="none", checks=False))
