"""What an engine reports about itself: one typed snapshot, gathered by ``Engine.stats()`` and
read by attribute (the metrics endpoint, the start-up summary, the tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    # requests and steps
    running: int = 0
    waiting: int = 0
    steps: int = 0
    prefill_steps: int = 0  # steps with at least one prefill chunk
    decode_steps: int = 0  # steps with decode rows
    prefill_tokens: int = 0  # tokens whose K/V a prefill computed (adopted prefixes excluded)
    decode_tokens: int = 0
    preemptions: int = 0
    compactions: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    max_decode_rows: int = 0
    mean_decode_rows: float = 0.0
    # the slot table's reads and the pool
    windows: int = 0
    gathers: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    # the decode step
    compiled: bool = False
    graphs_built: int = 0  # compiled by this engine (in this process or its background builder)
    graphs_loaded: int = 0  # loaded from the compile cache
    graphs_ready: int = 0  # buckets whose graph is in use
    graphs_building: int = 0  # ... being built in the background
    graphs_pending: int = 0  # ... waiting to be built
    eager_steps: int = 0  # decode steps run eagerly for want of their bucket's graph
    recompiles_after_warmup: int = 0
    warmup_seconds: float = 0.0
    graph_load_seconds: float = 0.0  # loading cached graphs at start
    bucket_hits: dict[tuple[int, int], int] = field(default_factory=dict)
    padding_waste: float = 0.0  # padded cells read per real cell
    verify_bucket_hits: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (rows, k + 1, width)
    # what runs
    weights: str = ""
    weight_bytes: int = 0
    file_bytes: int = 0  # the model file's size (0: a model object, no file)
    load_stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of loading the file
    weight_types: dict[str, str] = field(default_factory=dict)  # GGUF tensor type -> packed, dense
    cpu_kernels: str | None = None
    compute_dtype: str = ""
    chunked_prefill: bool = True
    max_num_batched_tokens: int = 0
    prefill_only_budget: int = 0
    # prefix caching (vLLM's names: prompt tokens asked about, of them found cached)
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    # constrained decoding: requests with a grammar, steps that filled masks, time filling them
    structured_requests: int = 0
    mask_steps: int = 0
    mask_seconds: float = 0.0
    # speculative decoding (vLLM's counters): the method, verify steps, tokens proposed and
    # accepted, tokens a verifying row emits per step, and the proposer's and verify steps' time
    spec_method: str | None = None
    spec_verify_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    spec_draft_graphs_built: int = 0  # the draft model's own decode graphs
    spec_draft_recompiles: int = 0  # ... and its recompiles after warm-up (0, as the target's)
    spec_draft_kv_bytes: int = 0  # the draft's layers' share of the one K/V pool (blocks_total counts both)

    @property
    def mean_mask_seconds(self) -> float:
        """Time filling a step's masks, on average over the steps that had any."""
        return self.mask_seconds / max(self.mask_steps, 1)
