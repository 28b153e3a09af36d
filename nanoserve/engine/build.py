"""build_engine: load a model, turn a memory budget into a pool plan, and wire the engine."""

from __future__ import annotations

import torch

from nanoserve.cache.paged_cache import BatchedPagedKVCache
from nanoserve.cache.pool_plan import plan_pool
from nanoserve.engine.bucketing import Buckets
from nanoserve.engine.decode import DecodeStep
from nanoserve.engine.engine import Engine, EngineConfig
from nanoserve.engine.paged_attention import decode_attention_kernel
from nanoserve.model import cpu_kernels
from nanoserve.model.llama import LlamaModel
from nanoserve.model.loader import load_model
from nanoserve.model.quant import DENSE_FROM_ROWS, WEIGHT_FORMATS, WeightPlan, pack_model

DEFAULT_KV_CACHE_BYTES = 1 << 30
# A chunked step's default token budget on a GPU: decode rows plus prefill chunks of a few
# hundred tokens, which a GPU runs in about the time of the decode step itself.
DEFAULT_CHUNKED_BUDGET = 512
# On the CPU an eager step runs its decode rows and its prefill chunk as one forward, so a chunk
# costs its tokens' compute and their attention over the context, not a second pass over the
# weights; at 32 rows the step is already compute-bound, so each chunk token adds about 1/32 of
# a decode step, and the last chunks also attend over the whole prompt. With 32 streams decoding
# and a 2,000-token prompt arriving (two threads, `auto`, three runs each), chunks of 33 / 49 / 65
# tokens kept the streams' p99 inter-token latency at 1.8-2.3x / 2.1-3.0x / 2.6-3.4x the
# undisturbed p50 and gave the prompt its first token after 7.3-9.8 / 6.0-7.9 / 6.0-6.3 s;
# 161 tokens went to 5.1x. The budget leaves a chunk of half a decode batch, at least
# CPU_MIN_CHUNK tokens. A compiled decode step runs the chunk as a forward of its own: there the
# streams' p50 was 2.5x at 17 tokens and 2.7x at 65. On a GPU the chunk is cheap next to the
# decode step, so it keeps DEFAULT_CHUNKED_BUDGET.
CPU_MIN_CHUNK = 48


def build_engine(model: str | LlamaModel = "smollm2", *, tokenizer=None, max_model_len: int | None = None,
                 max_batch_size: int = 32, kv_cache_bytes: int | None = None, block_size: int = 16,
                 max_num_batched_tokens: int | None = None, dtype: torch.dtype | str | None = None,
                 device: str = "cpu", compile: bool = False, compile_mode: str | None = "reduce-overhead",
                 bucketing: bool | None = None, row_buckets: tuple[int, ...] | None = None,
                 width_buckets: tuple[int, ...] | None = None, warmup: str = "lazy",
                 compile_backend: str = "inductor", weights: str | WeightPlan | None = None,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True) -> Engine:
    """Build an engine.

    ``model`` is "smollm2" (the default GGUF), a path to a .gguf file or a Hugging Face
    directory, or an already built ``LlamaModel`` (then pass ``tokenizer`` for text prompts).
    ``kv_cache_bytes`` is the K/V budget; the pool plan turns it into blocks and clamps
    ``max_model_len`` to what the pool can hold. Asking for a ``max_model_len`` the pool cannot
    hold for even one request raises ValueError with the arithmetic.

    With ``compile=True`` the decode step is ``torch.compile(mode=compile_mode)`` over bucketed
    shapes (``bucketing`` defaults to on with compile, off without); ``warmup="eager"``
    compiles every bucket here, ``"lazy"`` on first use.

    ``weights`` is "auto", "fp32", "bf16", "int8", "int4" or a ``WeightPlan``: how the weights are
    held and executed (activations and the K/V cache are bf16 for all but fp32). "auto" is
    ``auto_cpu_plan()`` on the CPU and bf16 on CUDA. Unset, a model named by a string loads as "auto"
    unless ``dtype`` is given (then dense in that dtype), and a ``LlamaModel`` is used in its
    own dtype; a ``LlamaModel`` given with ``weights`` is converted in place.

    ``max_num_batched_tokens`` is a step's token budget. With ``enable_chunked_prefill`` (the
    default) decode rows take one token each and prefill chunks fill the rest, so a long prompt
    is prefilled over several steps while running streams keep decoding (unset:
    ``default_token_budget``, and a step with no stream decoding may then prefill
    DEFAULT_CHUNKED_BUDGET tokens); without it a step prefills whole prompts (unset:
    max(2048, max_model_len)) or decodes.

    With ``enable_prefix_caching`` (the default) full blocks of K/V stay cached after their
    request leaves, and a new request adopts its longest cached prefix instead of recomputing it.
    """
    weight_plan, dtype = resolve_weights(weights, dtype, device, named_model=isinstance(model, str))
    if warmup not in ("eager", "lazy"):
        raise ValueError(f"warmup must be 'eager' or 'lazy', got {warmup!r}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    # What the cached K/V depend on besides the tokens: a prefix cache keys its blocks by it.
    source = model if isinstance(model, str) else f"{type(model).__name__}@{id(model):x}"
    if isinstance(model, str):
        model, tokenizer = load_model(model, dtype=dtype, device=device, weights=weight_plan)
    else:
        if weight_plan is not None:
            pack_model(model, weight_plan)
        model = model.to(device=device, dtype=dtype)
    model.eval().requires_grad_(False)  # inference only: a cache write must never join a graph
    config = model.config
    limit = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    # Unset, the budget is what every row at full length needs (plus the scratch block), at
    # most DEFAULT_KV_CACHE_BYTES: a tiny model does not get a gigabyte of zeros.
    per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * dtype.itemsize
    full = (max_batch_size * -(-limit // block_size) + 1) * per_block
    budget = kv_cache_bytes or min(DEFAULT_KV_CACHE_BYTES, full)
    try:
        plan = plan_pool(budget, config.num_layers, config.num_kv_heads, config.head_dim, dtype, block_size,
                         max_batch_size, limit)
    except ValueError as exc:
        raise ValueError(f"kv_cache_bytes={budget}: {exc}") from None
    if max_model_len is not None and plan.max_model_len < max_model_len:
        needed_blocks = -(-max_model_len // block_size) + 1  # + the scratch block
        raise ValueError(
            f"kv_cache_bytes={budget} holds {plan.num_blocks} blocks of {plan.bytes_per_block} bytes "
            f"({block_size} tokens each, one reserved as scratch) = {plan.max_model_len} tokens for a "
            f"request, fewer than one max_model_len={max_model_len} request needs: raise kv_cache_bytes "
            f"to at least {needed_blocks * plan.bytes_per_block} or lower max_model_len")
    weights_name = weight_plan.name if weight_plan else _format_name(dtype)
    cache = BatchedPagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim, plan.num_blocks,
                                block_size, max_batch_size, plan.max_model_len, dtype=dtype, device=device,
                                enable_prefix_caching=enable_prefix_caching,
                                prefix_salt=f"{source}|{config!r}|{dtype}|{weights_name}")
    # The tier running the packed weights; with dense bf16 weights the decode attention still
    # reads through the host's tier (fp32 dense weights are the reference and keep SDPA).
    tier = weight_plan.tier if weight_plan is not None else None
    if tier is None and dtype == torch.bfloat16 and str(device) == "cpu":
        tier = cpu_kernels.resolve_tier()
    attention_kernel = decode_attention_kernel(cache.k_caches[0], tier)
    bucketing = compile if bucketing is None else bucketing
    buckets = None
    if bucketing:
        default = Buckets.default(max_batch_size, block_size, cache.max_model_len)
        # The CPU decode kernel reads each row's own cells whatever the window's width, so one
        # width (the longest) steps as fast as a tight one and compiles one graph per row
        # bucket instead of one per width; SDPA's masked read costs the whole window.
        widths = (cache.max_model_len,) if attention_kernel is not None else default.widths
        buckets = Buckets(tuple(row_buckets or default.rows), tuple(width_buckets or widths))
    step = DecodeStep(model, cache, max_batch_size, buckets, compile=compile, mode=compile_mode, device=device,
                      backend=compile_backend, attention_kernel=attention_kernel)
    engine_config = EngineConfig(
        max_model_len=cache.max_model_len, max_batch_size=max_batch_size, block_size=block_size,
        num_blocks=plan.num_blocks,
        max_num_batched_tokens=max_num_batched_tokens or default_token_budget(
            enable_chunked_prefill, max_batch_size, cache.max_model_len, device),
        # The CPU default budget is sized for the streams a chunk delays; with none decoding it
        # would only slow a lone prompt, so such a step may prefill DEFAULT_CHUNKED_BUDGET tokens.
        # A budget the caller sets is a hard limit on every step.
        prefill_only_budget=None if max_num_batched_tokens or not enable_chunked_prefill else DEFAULT_CHUNKED_BUDGET,
        dtype=dtype, device=device, compile=compile, weights=weights_name, cpu_kernels=tier, enable_chunked_prefill=enable_chunked_prefill)
    engine = Engine(model, tokenizer, cache, engine_config, step)
    if compile and warmup == "eager" and buckets is not None:
        step.warmup()
    return engine


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


def auto_cpu_plan(tier: str | None = None) -> WeightPlan:
    """"auto" on the CPU: the fastest format that passes the fidelity gates against fp32
    (README): int4 codes and the file's Q8_0 LM head (group-wise int8), with a dense copy of the
    linears (and the embedding table as the head) from the kernel tier's measured crossover
    (DENSE_FROM_ROWS) where it has one. ``tier``: cpu_kernels.resolve_tier's choice by default."""
    tier = tier or cpu_kernels.resolve_tier()
    # The crossovers were measured against a bf16 copy; an fp32 one (a CPU without native bf16,
    # such as AVX-512 VNNI before AVX-512 BF16) is 4x the codes and pays only at larger batches.
    bf16 = cpu_kernels.compute_dtype(tier) == torch.bfloat16
    return WeightPlan("int4", dense_from_rows=DENSE_FROM_ROWS[tier] if bf16 else None, int8_head=True)


def resolve_weights(weights: str | WeightPlan | None, dtype: torch.dtype | str | None, device: str,
                    named_model: bool) -> tuple[WeightPlan | None, torch.dtype]:
    """The weight plan (None: dense weights in the model's dtype, no conversion) and the
    activation dtype. Raises ValueError for unknown names, a dtype that contradicts the format,
    or a packed CPU format on another device."""
    cuda = str(device).startswith("cuda")
    if weights is None and (dtype is not None or not named_model):
        # fp32 on the CPU (its bf16 matmuls are not the default anywhere), bf16 on a GPU.
        return None, _as_dtype(dtype) if dtype is not None else (torch.bfloat16 if cuda else torch.float32)
    if weights is None or weights == "auto":
        plan = WeightPlan("bf16") if cuda else auto_cpu_plan()
    elif isinstance(weights, WeightPlan):
        plan = weights
    elif weights in WEIGHT_FORMATS:
        plan = WeightPlan(weights)
    else:
        raise ValueError(f"weights must be one of auto, {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
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
