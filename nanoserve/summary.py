"""What a built engine runs, in a few lines: `nanoserve generate` and `nanoserve serve` print it
at start (as llama-server and vLLM do), so that the weight format, the kernels, the K/V pool
and its memory are never a surprise."""

from __future__ import annotations


def describe_engine(engine, model: str, load_seconds: float) -> list[str]:
    """Lines naming the model and load time; the weight format, resident weight bytes, compute
    dtype and CPU kernel tier; the K/V pool's bytes, blocks and tokens; the length and batch limits."""
    stats, config, resolved, cache = engine.stats(), engine.config, engine.resolved, engine.worker.cache
    kv_bytes = cache.kv_bytes + stats.spec_draft_kv_bytes  # a draft model's K/V layers share the pool's blocks
    kv_dtype = describe_kv_formats(*cache.formats)
    compute = stats.compute_dtype or _dtype_name(resolved.dtype)
    blocks, block_size = resolved.num_blocks, config.block_size
    model_limit = engine.model.config.max_position_embeddings
    limit_note = f" (the model takes up to {model_limit:,})" if resolved.max_model_len < model_limit else ""
    decode = describe_graphs(stats) if resolved.compile else "eager decode"
    rows = f"{config.max_batch_size} row{'s' if config.max_batch_size != 1 else ''}"
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in stats.load_stages.items())
    rest = load_seconds - sum(stats.load_stages.values())
    if stages and rest >= 0.05:  # the engine's own build (K/V pool, worker, graphs' start) adds up the line
        stages += f", engine {rest:.1f} s"
    file_note = f" (the file: {format_bytes(stats.file_bytes)})" if stats.file_bytes else ""
    lines = [
        f"model {model}: loaded in {load_seconds:.1f} s on {config.device}" + (f" ({stages})" if stages else ""),
        f"weights {stats.weights}, {format_bytes(stats.weight_bytes)} resident{file_note}; "
        f"compute dtype {compute}; CPU kernels: {kernel_tier(stats.cpu_kernels)}; threads {engine.threads}",
        f"K/V pool {format_bytes(kv_bytes)} of {kv_dtype}: {blocks:,} blocks of {block_size} tokens "
        f"({(blocks - 1) * block_size:,} tokens for requests, one block is scratch)",
        *describe_rings(cache),
        f"max_model_len {resolved.max_model_len:,}{limit_note}; up to {rows} and "
        f"{stats.max_num_batched_tokens} tokens per step; {decode}",
    ]
    if stats.weight_types:
        lines.append(describe_tensor_types(stats.weight_types))
    if engine.speculator is not None:
        lines.append(describe_speculation(engine.speculator, engine.worker.draft, stats.spec_draft_kv_bytes))
    size = config.tensor_parallel_size
    if size > 1:
        lines.append(f"tensor parallel over {size} ranks: the weights and K/V pool above are rank 0's shard "
                     f"(each rank holds 1/{size} of the heads, the MLP and the vocabulary)")
    return lines


def describe_rings(cache) -> list[str]:
    """A line on the sliding-window layers' rings (window_ring), where the cache keeps them."""
    if cache.ring is None:
        return []
    saved = cache.ring.snapshots
    kept = f", and {saved} saved rows of rings for cached prefixes" if saved else ""
    return [f"sliding-window layers ({len(cache.ring_layers)} of {len(cache.layers.k_cells)}) keep each row's "
            f"last {cache.ring.ring:,} positions in a ring, not the pool{kept} ({format_bytes(cache.ring_bytes)} "
            "of the K/V above)"]


def describe_kv_formats(k_format, v_format) -> str:
    """K and V's storage in a few words: "bf16", or "q8_0 (8.5 bits a value)", or each side's."""
    def one(fmt) -> str:
        return f"{fmt.name} ({8 * fmt.bytes_per_value:g} bits a value)" if fmt.quantized else _dtype_name(fmt.dtype)

    return one(k_format) if k_format == v_format else f"K {one(k_format)}, V {one(v_format)}"


def describe_tensor_types(types: dict[str, str]) -> str:
    """The file's tensor types and how each runs (engine.stats().weight_types); a low-bit type
    run packed in wider codes than the file's says its bits a weight held against the file's."""
    from nanoserve.model.quant.gguf_blocks import WIDENED_BITS

    parts = []
    for name, mode in types.items():
        held = WIDENED_BITS.get(name) if "packed" in mode.split("+") else None
        parts.append(f"{name} {mode}" + (f" ({held[0]:.2f} bits a weight held, the file's {held[1]:.2f})"
                                         if held else ""))
    return "tensor types: " + ", ".join(parts)


def describe_graphs(stats) -> str:
    """The compiled decode's graphs: how many buckets are ready (loaded from the compile cache or
    built) and how many still run eagerly while theirs build."""
    ready, waiting = stats.graphs_ready, stats.graphs_building + stats.graphs_pending
    line = f"compiled decode: {ready} graph{'s' if ready != 1 else ''} ready"
    if stats.graphs_loaded:
        line += f" ({stats.graphs_loaded} loaded from the compile cache in {stats.graph_load_seconds:.1f} s)"
    if waiting:
        line += f", {waiting} building in the background (those buckets run eagerly meanwhile)"
    return line


def describe_speculation(speculator, draft=None, draft_kv_bytes: int = 0) -> str:
    """One line: the proposer (``draft``: the worker's draft model, its K/V in the pool above),
    how many tokens a row proposes, and when it does not."""
    config = speculator.config
    k = config.num_speculative_tokens
    how = "adapting per row from its acceptance" if config.adaptive else "every step"
    if config.method == "ngram":
        source = f"n-gram lookup of the last {config.prompt_lookup_max}..{config.prompt_lookup_min} tokens"
    else:
        from nanoserve.model.quant.linear import tensor_bytes  # torch: only once a draft is built

        name = config.model if isinstance(config.model, str) else "the target's own weights" if config.model is None \
            else type(config.model).__name__
        source = (f"draft model {name} ({config.draft_weights}, {format_bytes(tensor_bytes(draft.worker.model))} "
                  f"resident; its K/V layers are {format_bytes(draft_kv_bytes)} of the pool's blocks)")
    return (f"speculative decoding: {source}; up to {k} token{'s' if k != 1 else ''} a row, {how}; "
            f"off in steps of {config.disable_by_batch_size}+ rows and for rows under a grammar")


def kernel_tier(tier: str | None) -> str:
    """The engine's `cpu_kernels` in words: a tier ("avx512-vnni", "avx2", "torch", ...), or
    None where none of nanoserve's kernels runs (fp32 weights, or a GPU)."""
    return "none (torch's matmuls and attention)" if tier is None else str(tier)


def format_bytes(count: int) -> str:
    """Powers of 1024, as --kv-cache-bytes reads them: '188.5 MiB', '1.00 GiB'."""
    if count >= 1 << 30:
        return f"{count / (1 << 30):.2f} GiB"
    if count >= 1 << 20:
        return f"{count / (1 << 20):.1f} MiB"
    return f"{count / 1024:.1f} KiB"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
