"""build_engine: resolve what was asked into a pool, a block manager and a worker spec; build
the worker (here, or over tensor-parallel ranks) and wire the engine around it."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from nanoserve.cache.block_manager import SCRATCH_BLOCK, BlockManager
from nanoserve.cache.pool_plan import PoolPlan, kv_bytes_per_token, plan_pool
from nanoserve.distributed.launch import build_tensor_parallel
from nanoserve.engine.config import EngineConfig, default_compile, kv_cache_types
from nanoserve.engine.engine import Engine
from nanoserve.engine.resolved import ResolvedConfig
from nanoserve.engine.scheduler import Scheduler, check_token_budget
from nanoserve.engine.threads import apply_threads
from nanoserve.model.formats.loader import read_header
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.llama import LlamaModel
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.linear import A8_FROM_ROWS, DENSE_FROM_ROWS
from nanoserve.model.quant.weight_plan import WeightPlan
from nanoserve.speculative.speculator import NgramProposals, Speculator
from nanoserve.worker.attention import decode_attention_kernel
from nanoserve.worker.bucketing import Buckets, bucket_for, default_query_buckets
from nanoserve.worker.build import WorkerConfig, build_worker
from nanoserve.worker.kv_cells import CellFormat, resolve_cell_format
from nanoserve.worker.window_ring import ring_size

# The K/V pool's default size in tokens of context, so that its bytes follow the model (its layers,
# K/V heads and head size): a 135M model's 16k tokens are ~0.75 GB in fp32, an 8B's ~2 GB in bf16.
DEFAULT_KV_TOKENS = 16384
# A chunked step's default token budget on a GPU, and a CPU step's with no row decoding: a
# chunk of a few hundred tokens costs a GPU about a decode step.
DEFAULT_CHUNKED_BUDGET = 512
# On the CPU an eager step runs its decode rows and its chunk as one forward, so a chunk token
# costs its compute and attention, not a pass over the weights; the default chunk is half a
# decode batch, at least this many tokens (the figures behind it: compile/results/).
CPU_MIN_CHUNK = 48


def build_engine(model: str | LlamaModel = "smollm2", *, tokenizer=None, config: EngineConfig | None = None,
                 **options) -> Engine:
    """Build an engine.

    ``model`` is "smollm2" (the default GGUF), a path to a .gguf file or a Hugging Face
    directory, or an already built ``LlamaModel`` (then pass ``tokenizer`` for text prompts).
    The options are ``EngineConfig``'s fields (README: the options table), given as ``config``,
    as keywords, or both (the keywords win). ``Engine.config`` holds them as asked (so
    ``build_engine(model, config=engine.config)`` builds the same engine again) and
    ``Engine.resolved`` what they resolved to.

    ``kv_cache_bytes`` is the K/V budget; the pool plan turns it into blocks and clamps
    ``max_model_len`` to what the pool can hold. Asking for a ``max_model_len`` the pool cannot
    hold for even one request raises ValueError with the arithmetic. ``weights`` "auto" is
    ``auto_cpu_plan()`` on the CPU and bf16 on CUDA; unset, a model named by a string loads as
    "auto" unless ``dtype`` is given (then dense in that dtype), and a ``LlamaModel`` is used in
    its own dtype (given with ``weights``, it is converted in place). With
    ``tensor_parallel_size`` > 1 the worker spans that many ranks (nanoserve.distributed.launch).
    NANOSERVE_CHECKS=1 in the environment runs the gates on every step (README: debug runs).
    """
    config = dataclasses.replace(config or EngineConfig(), **options)
    apply_threads(config.threads)  # before the load, whose packing runs on them too
    named = isinstance(model, str)
    weight_plan, dtype = resolve_weights(config.weights, config.dtype, config.device, named_model=named)
    started = time.perf_counter()
    header = read_header(model) if named else None  # the host side's one read of the file
    header_seconds = time.perf_counter() - started
    arch = header.config if header is not None else model.config
    kv_formats = tuple(resolve_cell_format(name, dtype, arch.head_dim) for name in kv_cache_types(config))
    draft = _draft_source(config, model, arch, dtype)
    saved = _ring_snapshots(config)
    pool, ring, ring_bytes = _plan_pool(arch, config, dtype, kv_formats, saved,
                                        draft_token_bytes=draft.token_bytes if draft is not None else 0)
    snapshots = saved if ring is not None else None  # None: no rings to save
    compile = config.compile if config.compile is not None else default_compile()
    spec = dataclasses.replace(_worker_spec(config, arch, pool, weight_plan, dtype, compile,
                                            tuple(fmt.name for fmt in kv_formats)), window_ring=ring,
                               ring_snapshots=snapshots or 0)
    resolved = _resolve(config, pool, spec, ring_bytes)
    check_token_budget(config.max_batch_size, resolved.max_num_batched_tokens, config.enable_chunked_prefill)
    # The worker first: a tensor-parallel rank other than 0 serves plans from here and never
    # returns (under torchrun), so it builds nothing of the host side.
    if config.tensor_parallel_size > 1:
        worker = build_tensor_parallel(model, spec, config.tensor_parallel_size, config.tensor_parallel_timeout)
    else:
        worker = build_worker(header if header is not None else model, spec)  # the file opened once
    # What the cached K/V depend on besides the tokens: a prefix cache keys its blocks by it.
    source = model if named else f"{type(model).__name__}@{id(model):x}"
    blocks = BlockManager(pool.num_blocks, config.block_size, config.max_batch_size, pool.max_model_len,
                          enable_prefix_caching=config.enable_prefix_caching,
                          prefix_salt=f"{source}|{arch!r}|{dtype}|{resolved.weights}|kv {resolved.kv_cache_types}",
                          ring_snapshots=snapshots)
    scheduler = Scheduler(blocks, config.max_batch_size, resolved.max_num_batched_tokens,
                          chunked=config.enable_chunked_prefill, prefill_only_budget=resolved.prefill_only_budget,
                          buckets=spec.buckets)
    started = time.perf_counter()
    if tokenizer is None and header is not None:
        tokenizer = header.tokenizer()
    tokenizer_seconds = time.perf_counter() - started
    speculator = None
    if config.speculative is not None:
        speculator = _speculator(config, draft, spec, arch.vocab_size, worker)
    engine = Engine(worker, scheduler, tokenizer, config, resolved, checks=spec.checks, speculator=speculator)
    if named:  # the load line's stages: the file's (its metadata read once, here), then the tokenizer's build
        stages = engine.load_stages
        engine.load_stages = {"metadata": header_seconds + stages.pop("metadata", 0.0), **stages,
                              "tokenizer": tokenizer_seconds}
    return engine


@dataclasses.dataclass(frozen=True)
class _DraftSource:
    """The draft model a speculative config names: its ``source`` (a path or a model object),
    weight plan and dtype, its architecture, and its K/V bytes a token (its layers are in the
    target's pool)."""

    source: object
    plan: WeightPlan | None
    dtype: torch.dtype
    arch: ModelConfig
    token_bytes: int


def _draft_source(config: EngineConfig, target, arch: ModelConfig, dtype: torch.dtype) -> _DraftSource | None:
    """The draft model of a ``method="draft"`` config (its own ``model``, else the target's file
    or model object) in ``draft_weights``; a model object drafts as it is unless draft weights
    other than "auto" are asked for (the target's object as the target's build leaves it, in
    ``dtype``). None without one."""
    speculative = config.speculative
    if speculative is None or speculative.method != "draft":
        return None
    source = speculative.model if speculative.model is not None else target
    if isinstance(source, str) or speculative.draft_weights != "auto":
        plan, dtype = resolve_weights(speculative.draft_weights, None, config.device, named_model=True)
    else:
        plan, dtype = None, dtype if source is target else next(source.parameters()).dtype
    if source is target:
        draft_arch = arch
    elif isinstance(source, str):
        from nanoserve.model.formats.loader import load_config  # the file's header only

        draft_arch = load_config(source)
    else:
        draft_arch = source.config
    k_format, v_format = (resolve_cell_format(name, dtype, draft_arch.head_dim) for name in kv_cache_types(config))
    token_bytes = kv_bytes_per_token(draft_arch.num_layers, draft_arch.num_kv_heads, draft_arch.head_dim,
                                     k_format.bytes_per_value, v_format.bytes_per_value)
    return _DraftSource(source, plan, dtype, draft_arch, token_bytes)


def _speculator(config: EngineConfig, draft: _DraftSource | None, spec: WorkerConfig, vocab_size: int,
                worker) -> Speculator:
    """The proposer the speculative config names: an n-gram lookup on the host, or a draft
    model on the worker (rank 0's), its K/V layers over the worker's pool and slot table."""
    speculative = config.speculative
    if draft is None:
        return Speculator(speculative, NgramProposals(speculative))
    from nanoserve.speculative.draft import build_draft  # a second model: only when asked for

    worker.draft = build_draft(speculative, draft.source, draft.plan, draft.dtype, draft.arch.head_dim, spec,
                               vocab_size, worker)
    return Speculator(speculative, None)


def _worker_spec(config: EngineConfig, arch: ModelConfig, pool: PoolPlan, weight_plan: WeightPlan | None,
                 dtype: torch.dtype, compile: bool, kv_types: tuple[str, str]) -> WorkerConfig:
    """What every rank's worker is built from: the pool's shape, the decode grid, the kernel tier."""
    # The tier running the packed weights; with dense bf16 weights the decode attention still
    # reads through the host's tier (fp32 dense weights are the reference and keep SDPA).
    tier = weight_plan.tier if weight_plan is not None else None
    if tier is None and dtype == torch.bfloat16 and str(config.device) == "cpu":
        tier = cpu_kernels.resolve_tier()
    kernel = decode_attention_kernel(config.device, dtype, arch.head_dim, tier, kv_types) is not None
    return WorkerConfig(weight_plan, dtype, config.device, pool.num_blocks, config.block_size, config.max_batch_size,
                      pool.max_model_len, SCRATCH_BLOCK * config.block_size,
                      _buckets(config, pool.max_model_len, kernel, compile), compile, config.compile_mode,
                      config.compile_backend, tier, config.warmup,
                      checks=os.environ.get("NANOSERVE_CHECKS", "") == "1",
                      max_queries=1 + (config.speculative.num_speculative_tokens if config.speculative else 0),
                      kv_cache_types=kv_types, huge_pages=config.huge_pages, cpp_wrapper=config.compile_cpp_wrapper)


def _resolve(config: EngineConfig, pool: PoolPlan, spec: WorkerConfig, ring_bytes: int = 0) -> ResolvedConfig:
    chunked, budget = config.enable_chunked_prefill, config.max_num_batched_tokens
    return ResolvedConfig(
        weights=spec.weights.name if spec.weights else _format_name(spec.dtype), weight_plan=spec.weights,
        dtype=spec.dtype, kv_cache_types=spec.kv_cache_types, cpu_kernels=spec.attention_tier,
        max_model_len=pool.max_model_len,
        kv_cache_bytes=pool.num_blocks * pool.bytes_per_block + ring_bytes, num_blocks=pool.num_blocks,
        window_ring=spec.window_ring,
        max_num_batched_tokens=budget or default_token_budget(chunked, config.max_batch_size, pool.max_model_len,
                                                               config.device),
        # The CPU default budget is sized for the streams a chunk delays; with none decoding it
        # would only slow a lone prompt. A budget the caller sets binds every step.
        prefill_only_budget=config.prefill_only_budget or (None if budget or not chunked else DEFAULT_CHUNKED_BUDGET),
        buckets=spec.buckets, compile=spec.compile)


def _plan_pool(arch: ModelConfig, config: EngineConfig, dtype: torch.dtype,
               kv_formats: tuple[CellFormat, CellFormat], saved: int = 0, rings: bool = True,
               draft_token_bytes: int = 0) -> tuple[PoolPlan, int | None, int]:
    """The pool for the K/V budget (unset: what every row at full length needs, plus the scratch
    block, at most DEFAULT_KV_TOKENS tokens' worth), K and V stored as ``kv_formats`` say, a
    draft model's layers (``draft_token_bytes`` a token) beside the target's in every block; and
    the sliding-window layers' ring cells a row (window_ring; None: they keep the pool's cells)
    with the rings' bytes, which come out of the budget first. With ``saved`` rows of saved rings
    beside them (a cached prefix's window: _ring_snapshots), a ring keeps a block's positions more."""
    block_size, rows = config.block_size, config.max_batch_size
    limit = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    windows = [arch.layer_window(i) for i in range(arch.num_layers)]
    max_queries = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
    rings = rings and not config.swa_full
    ring = ring_size(windows, max_queries, limit, block_size if saved else 1) if rings else None
    ring_layers = sum(w is not None for w in windows) if ring else 0
    cell_bytes = arch.num_kv_heads * sum(fmt.bytes_per_head(arch.head_dim) for fmt in kv_formats)
    ring_bytes = ring_layers * (rows + saved) * (ring + 1) * cell_bytes if ring else 0
    pool_layers = arch.num_layers - ring_layers
    k_bytes, v_bytes = (fmt.bytes_per_value for fmt in kv_formats)
    per_block = block_size * (kv_bytes_per_token(pool_layers, arch.num_kv_heads, arch.head_dim, k_bytes, v_bytes)
                              + draft_token_bytes)
    blocks = min(rows * -(-limit // block_size), -(-DEFAULT_KV_TOKENS // block_size)) + 1
    budget = config.kv_cache_bytes or blocks * per_block + ring_bytes
    try:
        plan = plan_pool(budget - ring_bytes, pool_layers, arch.num_kv_heads, arch.head_dim, k_bytes, block_size,
                         rows, limit, v_bytes, extra_token_bytes=draft_token_bytes)
    except ValueError as exc:
        rings_note = f" ({ring_bytes} of them the sliding-window layers' rings)" if ring_bytes else ""
        raise ValueError(f"kv_cache_bytes={budget}{rings_note}: {exc}") from None
    if ring is not None and ring >= plan.max_model_len:  # a pool too small for rings to save anything
        return _plan_pool(arch, config, dtype, kv_formats, saved, rings=False, draft_token_bytes=draft_token_bytes)
    wanted = config.max_model_len
    if wanted is not None and plan.max_model_len < wanted:
        needed_blocks = -(-wanted // block_size) + 1  # + the scratch block
        raise ValueError(
            f"kv_cache_bytes={budget} holds {plan.num_blocks} blocks of {plan.bytes_per_block} bytes "
            f"({block_size} tokens each, one reserved as scratch) = {plan.max_model_len} tokens for a "
            f"request, fewer than one max_model_len={wanted} request needs: raise kv_cache_bytes "
            f"to at least {needed_blocks * plan.bytes_per_block + ring_bytes} or lower max_model_len")
    return plan, ring, ring_bytes


def _ring_snapshots(config: EngineConfig) -> int:
    """Saved rows of rings a prefix-caching engine keeps for a later row adopting a prefix
    (cache/ring_snapshots.py): two per row by default (a prompt's end and a release each)."""
    if not config.enable_prefix_caching:
        return 0
    if config.ring_snapshots is None:
        return 2 * config.max_batch_size
    if config.ring_snapshots < 0:
        raise ValueError(f"ring_snapshots must be >= 0, got {config.ring_snapshots}")
    return config.ring_snapshots


def _buckets(config: EngineConfig, max_model_len: int, decode_kernel: bool, compile: bool) -> Buckets | None:
    """The decode grid (bucketing defaults to on with compile, off without)."""
    if not (compile if config.bucketing is None else config.bucketing):
        return None
    default = Buckets.default(config.max_batch_size, config.block_size, max_model_len)
    # The CPU decode kernel reads each row's own cells whatever the window's width, so one
    # width (the longest) steps as fast as a tight one and compiles one graph per row
    # bucket instead of one per width; SDPA's masked read costs the whole window.
    widths = (max_model_len,) if decode_kernel else default.widths
    rows = tuple(config.row_buckets or default.rows)
    speculative = config.speculative
    if speculative is None or speculative.disable_by_batch_size < 2:
        return Buckets(rows, tuple(config.width_buckets or widths))
    # Verify graphs for the row buckets a speculating step can land in (fewer rows than
    # disable_by_batch_size), one per query bucket.
    verify_rows = bucket_for(speculative.most_rows(config.max_batch_size), rows)
    return Buckets(rows, tuple(config.width_buckets or widths), default_query_buckets(speculative.num_speculative_tokens),
                   verify_rows)


def default_token_budget(chunked: bool, max_batch_size: int, max_model_len: int, device: str = "cpu") -> int:
    """A step's token budget when none is given: with chunking at least one prefill token
    beyond a full decode batch (on the CPU a chunk of half a decode batch, at least
    CPU_MIN_CHUNK; on a GPU DEFAULT_CHUNKED_BUDGET); without, room for the longest prompt in
    one step."""
    if chunked:
        if str(device).startswith("cuda"):
            return max(DEFAULT_CHUNKED_BUDGET, max_batch_size + 1)
        return max_batch_size + max(CPU_MIN_CHUNK, max_batch_size // 2)
    return max(2048, max_model_len)


def auto_cpu_plan(tier: str | None = None, dense: bool = False, activations: str = "auto") -> WeightPlan:
    """"auto" on the CPU: the fastest format that passes the fidelity gates against fp32
    (README): int4 codes and the file's Q8_0 LM head (group-wise int8), resident at about the
    file's size: a prompt's many rows dequantise each weight for the call, or run the kernels at
    8 bits on a tier that computes in fp32 (linear.dequant_from_rows).
    ``dense`` ("auto+dense") also keeps a dense copy of the linears (and the embedding table as
    the head) from the kernel tier's measured crossover (DENSE_FROM_ROWS) where it has one: about
    5x the memory of int4 codes, for faster steps of many rows. ``activations``: the bits the int4
    products round activations to (WeightPlan.a8_from_rows): "auto", 8 from the tier's
    A8_FROM_ROWS, where the arithmetic sets a step's time; "a8" ("auto+a8"), 8 at every row count;
    "a16" ("auto+a16"), 16 at every row count, so a row's logits do not depend on the batch it
    runs in. ``tier``: cpu_kernels.resolve_tier's choice by default."""
    tier = tier or cpu_kernels.resolve_tier()
    # The crossovers were measured against a bf16 copy; an fp32 one (a CPU without native bf16,
    # such as AVX-512 VNNI before AVX-512 BF16) is 4x the codes and pays only at larger batches.
    bf16 = cpu_kernels.compute_dtype(tier) == torch.bfloat16
    return WeightPlan("int4", dense_from_rows=DENSE_FROM_ROWS[tier] if dense and bf16 else None, int8_head=True,
                      a8_from_rows={"auto": A8_FROM_ROWS[tier], "a8": 1, "a16": None}[activations])


def resolve_weights(weights: str | WeightPlan | None, dtype: torch.dtype | str | None, device: str,
                    named_model: bool) -> tuple[WeightPlan | None, torch.dtype]:
    """The weight plan (None: dense weights in the model's dtype, no conversion) and the
    activation dtype. Raises ValueError for unknown names, a dtype that contradicts the format,
    or a packed CPU format on another device."""
    cuda = str(device).startswith("cuda")
    if weights is None and (dtype is not None or not named_model):
        # fp32 on the CPU (its bf16 matmuls are not the default anywhere), bf16 on a GPU.
        return None, _as_dtype(dtype) if dtype is not None else (torch.bfloat16 if cuda else torch.float32)
    if weights is None or (isinstance(weights, str) and weights.split("+")[0] == "auto"):
        parts = weights.split("+")[1:] if weights else []
        if set(parts) - {"dense", "a8", "a16"} or len(set(parts)) != len(parts):
            raise ValueError(f"weights {weights!r}: auto takes +dense and +a8 (or +a16), once each")
        if cuda and "a8" in parts:
            raise ValueError(f"weights {weights!r}: 8-bit activations are a CPU int4 kernel option; cuda runs bf16")
        activations = "a8" if "a8" in parts else "a16" if "a16" in parts else "auto"
        plan = WeightPlan("bf16") if cuda else auto_cpu_plan(dense="dense" in parts, activations=activations)
    elif isinstance(weights, WeightPlan):
        plan = weights
    else:
        plan = WeightPlan.parse(weights)
    if plan.format in ("int8", "int4") and str(device) != "cpu":
        raise ValueError(f"weights={plan.format!r} runs torch's CPU kernels; on {device} use bf16 or fp32")
    if dtype is not None and _as_dtype(dtype) != plan.dtype:
        raise ValueError(f"weights={plan.format!r} computes in {plan.dtype}, but dtype={dtype!r} was given")
    return plan, plan.dtype


def _format_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
    return names[dtype]
