"""build_engine: load a model, turn a memory budget into a pool plan, and wire the engine."""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from nanoserve.cache.paged_cache import BatchedPagedKVCache
from nanoserve.cache.pool_plan import PoolPlan, kv_bytes_per_token, plan_pool
from nanoserve.engine.bucketing import Buckets
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.decode import DecodeStep
from nanoserve.engine.engine import Engine
from nanoserve.engine.paged_attention import decode_attention_kernel
from nanoserve.model import cpu_kernels
from nanoserve.model.llama import LlamaModel
from nanoserve.model.loader import load_model
from nanoserve.model.quant import DENSE_FROM_ROWS
from nanoserve.model.weight_plan import WeightPlan, pack_model

if TYPE_CHECKING:
    from nanoserve.distributed.launch import Rank

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
    as keywords, or both (the keywords win); ``Engine.config`` holds them resolved.

    ``kv_cache_bytes`` is the K/V budget; the pool plan turns it into blocks and clamps
    ``max_model_len`` to what the pool can hold. Asking for a ``max_model_len`` the pool cannot
    hold for even one request raises ValueError with the arithmetic. ``weights`` "auto" is
    ``auto_cpu_plan()`` on the CPU and bf16 on CUDA; unset, a model named by a string loads as
    "auto" unless ``dtype`` is given (then dense in that dtype), and a ``LlamaModel`` is used in
    its own dtype (given with ``weights``, it is converted in place).
    """
    config = dataclasses.replace(config or EngineConfig(), **options)
    if config.tensor_parallel_size > 1:
        from nanoserve.distributed.launch import build_tensor_parallel  # torch.distributed only when asked
        return build_tensor_parallel(model, tokenizer, config)
    return build_rank(model, tokenizer, config)


def build_rank(model: str | LlamaModel, tokenizer, config: EngineConfig, rank: Rank | None = None) -> Engine:
    """``build_engine`` for one process: the whole model, or with ``rank`` (tensor parallelism,
    its process group joined) that rank's shard and its K/V heads' cache. Every rank builds
    the same pool, buckets and engine from the same config, so one plan drives them all."""
    weight_plan, dtype = resolve_weights(config.weights, config.dtype, config.device, named_model=isinstance(model, str))
    # What the cached K/V depend on besides the tokens: a prefix cache keys its blocks by it.
    source = model if isinstance(model, str) else f"{type(model).__name__}@{id(model):x}"
    if isinstance(model, str):
        model, tokenizer = load_model(model, dtype=dtype, device=config.device, weights=weight_plan,
                                      shard=None if rank is None else rank.shard)
    else:
        if rank is not None:
            model = copy.deepcopy(model)  # the caller's model stays whole
            rank.shard(model, {})
        if weight_plan is not None:
            pack_model(model, weight_plan)
        model = model.to(device=config.device, dtype=dtype)
    if rank is not None:
        rank.parallelize(model)
    model.eval().requires_grad_(False)  # inference only: a cache write must never join a graph
    arch = model.config
    # The pool is planned for the whole model's K/V heads (kv_cache_bytes is the budget over
    # every rank); each rank's cache holds its heads of every block.
    plan = _plan_pool(arch, config, dtype)
    kv_heads = arch.num_kv_heads // (rank.size if rank is not None else 1)
    weights_name = weight_plan.name if weight_plan else _format_name(dtype)
    cache = BatchedPagedKVCache(arch.num_layers, kv_heads, arch.head_dim, plan.num_blocks,
                                config.block_size, config.max_batch_size, plan.max_model_len, dtype=dtype,
                                device=config.device, enable_prefix_caching=config.enable_prefix_caching,
                                prefix_salt=f"{source}|{arch!r}|{dtype}|{weights_name}")
    # The tier running the packed weights; with dense bf16 weights the decode attention still
    # reads through the host's tier (fp32 dense weights are the reference and keep SDPA).
    tier = weight_plan.tier if weight_plan is not None else None
    if tier is None and dtype == torch.bfloat16 and str(config.device) == "cpu":
        tier = cpu_kernels.resolve_tier()
    attention_kernel = decode_attention_kernel(cache.k_caches[0], tier)
    buckets = _buckets(config, cache.max_model_len, attention_kernel is not None)
    step = DecodeStep(model, cache, config.max_batch_size, buckets, compile=config.compile, mode=config.compile_mode,
                      device=config.device, backend=config.compile_backend, attention_kernel=attention_kernel)
    chunked, budget = config.enable_chunked_prefill, config.max_num_batched_tokens
    resolved = dataclasses.replace(
        config, max_model_len=cache.max_model_len, kv_cache_bytes=plan.num_blocks * plan.bytes_per_block,
        max_num_batched_tokens=budget or default_token_budget(chunked, config.max_batch_size, cache.max_model_len,
                                                               config.device),
        # The CPU default budget is sized for the streams a chunk delays; with none decoding it
        # would only slow a lone prompt. A budget the caller sets binds every step.
        prefill_only_budget=config.prefill_only_budget or (None if budget or not chunked else DEFAULT_CHUNKED_BUDGET),
        dtype=dtype, weights=weights_name, bucketing=buckets is not None,
        row_buckets=buckets.rows if buckets else None, width_buckets=buckets.widths if buckets else None)
    engine = Engine(model, tokenizer, cache, resolved, step, cpu_kernels=tier)
    if config.compile and config.warmup == "eager" and buckets is not None:
        step.warmup()
    return engine


def _plan_pool(arch, config: EngineConfig, dtype: torch.dtype) -> PoolPlan:
    """The pool for the K/V budget (unset: what every row at full length needs, plus the scratch
    block, at most DEFAULT_KV_TOKENS tokens' worth)."""
    block_size, rows = config.block_size, config.max_batch_size
    limit = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    per_block = block_size * kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
    blocks = min(rows * -(-limit // block_size), -(-DEFAULT_KV_TOKENS // block_size)) + 1
    budget = config.kv_cache_bytes or blocks * per_block
    try:
        plan = plan_pool(budget, arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype, block_size, rows, limit)
    except ValueError as exc:
        raise ValueError(f"kv_cache_bytes={budget}: {exc}") from None
    wanted = config.max_model_len
    if wanted is not None and plan.max_model_len < wanted:
        needed_blocks = -(-wanted // block_size) + 1  # + the scratch block
        raise ValueError(
            f"kv_cache_bytes={budget} holds {plan.num_blocks} blocks of {plan.bytes_per_block} bytes "
            f"({block_size} tokens each, one reserved as scratch) = {plan.max_model_len} tokens for a "
            f"request, fewer than one max_model_len={wanted} request needs: raise kv_cache_bytes "
            f"to at least {needed_blocks * plan.bytes_per_block} or lower max_model_len")
    return plan


def _buckets(config: EngineConfig, max_model_len: int, decode_kernel: bool) -> Buckets | None:
    """The decode grid (bucketing defaults to on with compile, off without)."""
    if not (config.compile if config.bucketing is None else config.bucketing):
        return None
    default = Buckets.default(config.max_batch_size, config.block_size, max_model_len)
    # The CPU decode kernel reads each row's own cells whatever the window's width, so one
    # width (the longest) steps as fast as a tight one and compiles one graph per row
    # bucket instead of one per width; SDPA's masked read costs the whole window.
    widths = (max_model_len,) if decode_kernel else default.widths
    return Buckets(tuple(config.row_buckets or default.rows), tuple(config.width_buckets or widths))


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


def auto_cpu_plan(tier: str | None = None, dense: bool = False) -> WeightPlan:
    """"auto" on the CPU: the fastest format that passes the fidelity gates against fp32
    (README): int4 codes and the file's Q8_0 LM head (group-wise int8), resident at about the
    file's size: a prompt's many rows dequantise each weight for the call (DEQUANT_FROM_ROWS).
    ``dense`` ("auto+dense") also keeps a dense copy of the linears (and the embedding table as
    the head) from the kernel tier's measured crossover (DENSE_FROM_ROWS) where it has one: about
    5x the memory of int4 codes, for faster steps of many rows. ``tier``:
    cpu_kernels.resolve_tier's choice by default."""
    tier = tier or cpu_kernels.resolve_tier()
    # The crossovers were measured against a bf16 copy; an fp32 one (a CPU without native bf16,
    # such as AVX-512 VNNI before AVX-512 BF16) is 4x the codes and pays only at larger batches.
    bf16 = cpu_kernels.compute_dtype(tier) == torch.bfloat16
    return WeightPlan("int4", dense_from_rows=DENSE_FROM_ROWS[tier] if dense and bf16 else None, int8_head=True)


def resolve_weights(weights: str | WeightPlan | None, dtype: torch.dtype | str | None, device: str,
                    named_model: bool) -> tuple[WeightPlan | None, torch.dtype]:
    """The weight plan (None: dense weights in the model's dtype, no conversion) and the
    activation dtype. Raises ValueError for unknown names, a dtype that contradicts the format,
    or a packed CPU format on another device."""
    cuda = str(device).startswith("cuda")
    if weights is None and (dtype is not None or not named_model):
        # fp32 on the CPU (its bf16 matmuls are not the default anywhere), bf16 on a GPU.
        return None, _as_dtype(dtype) if dtype is not None else (torch.bfloat16 if cuda else torch.float32)
    if weights is None or weights in ("auto", "auto+dense"):
        plan = WeightPlan("bf16") if cuda else auto_cpu_plan(dense=weights == "auto+dense")
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
