"""K/V cells stored as q8_0 (kv_cells): the quantiser is llama.cpp's block format, the kernel tiers
read the cells as the reference reads their values, and an engine with a q8_0 cache gives the
tokens and logprobs of a model whose K/V are rounded to q8_0 wherever they are stored; the pool
holds ~1.9x bf16's tokens in the same bytes and says so at start."""

from __future__ import annotations

import pytest
import torch
from attention_support import paged_attention_reference
from engine_oracle_helpers import assert_greedy_agrees_up_to_near_ties, engine_for, generate, greedy

from nanoserve.engine import EngineConfig
from nanoserve.model.network.reference_attention import DenseCausalAttention
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant import cpu_kernels
from nanoserve.summary import describe_engine
from nanoserve.worker.kv_cells import (
    CellFormat,
    KVLayers,
    dequantize_q8_0,
    quantize_q8_0,
    resolve_cell_format,
)

TIERS = [t for t in cpu_kernels.host_tiers() if t != "torch"]


def rounded(x: torch.Tensor) -> torch.Tensor:
    return dequantize_q8_0(*quantize_q8_0(x), x.dtype)


def test_q8_0_holds_each_run_of_32_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 2, 64)  # runs of very different sizes
    x[0, 0, :32] = 0  # an all-zero run
    codes, steps = quantize_q8_0(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert steps.dtype == torch.float16 and steps.shape == (5, 3, 2)
    runs = x.unflatten(-1, (2, 32))
    # llama.cpp's q8_0: the step is max |x| / 127 (held in fp16); the largest value takes code +-127
    torch.testing.assert_close(steps.float(), (runs.abs().amax(-1) / 127).half().float())
    assert torch.equal(codes.unflatten(-1, (2, 32)).abs().amax(-1)[steps > 0], torch.full_like(steps[steps > 0], 127,
                                                                                               dtype=torch.int8))
    assert torch.equal(codes[0, 0, :32], torch.zeros(32, dtype=torch.int8)) and steps[0, 0, 0] == 0
    error = (rounded(x) - x).abs().unflatten(-1, (2, 32))
    # half a step, and the fp16 rounding of the step over 127 codes
    assert bool((error <= steps.float().unsqueeze(-1) * (0.5 + 127 * 2 ** -11) + 1e-12).all())


def test_formats_resolve_and_refuse_what_cannot_hold_a_head():
    assert resolve_cell_format("auto", torch.bfloat16, 64) == CellFormat("bf16")
    assert resolve_cell_format(None, torch.float32, 16) == CellFormat("fp32")
    q8 = resolve_cell_format("q8_0", torch.bfloat16, 64)
    assert q8.quantized and q8.bytes_per_head(64) == 68 and q8.bytes_per_value == 34 / 32
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        resolve_cell_format("q8_0", torch.float32, 16)
    with pytest.raises(ValueError, match="unknown K/V cache type 'q4_0'"):
        resolve_cell_format("q4_0", torch.float32, 64)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cache_type_v must be one of"):
        EngineConfig(cache_type_v="q4_0")


def test_layers_write_q8_0_and_read_back_the_rounded_values():
    torch.manual_seed(1)
    layers = KVLayers.allocate(2, 40, 2, 64, CellFormat("q8_0"), CellFormat("bf16"), torch.device("cpu"))
    assert [f.name for f in layers.formats] == ["q8_0", "bf16"]
    assert layers.num_bytes == 2 * 40 * 2 * (68 + 128)
    slots = torch.tensor([3, 17, 39])
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    layers.write(1, slots, k, v)
    got_k, got_v = layers.read(1, slots.view(1, 3), torch.float32)
    assert got_k.shape == (1, 3, 2, 64)
    assert torch.equal(got_k[0], rounded(k)) and torch.equal(got_v[0], v.bfloat16().float())
    assert torch.equal(layers.as_stored(k, v)[0], rounded(k))
    assert not layers.k_cells[0].any()  # another layer is untouched


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sides", ["k", "v", "kv"])
@pytest.mark.parametrize("window", [0, 5])
def test_kernel_tiers_read_q8_0_cells_as_the_reference_reads_their_values(tier, dtype, sides, window):
    torch.manual_seed(len(sides) + window)
    n, slots, width, kv_heads, heads, head_dim = 4, 300, 37, 2, 6, 64
    formats = [CellFormat("q8_0" if side in sides else {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype])
               for side in "kv"]
    layers = KVLayers.allocate(1, slots, kv_heads, head_dim, *formats, torch.device("cpu"))
    everything = torch.arange(slots)
    layers.write(0, everything, torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim))
    keys, values = layers.read(0, everything, torch.float64)
    q = torch.randn(n, heads, head_dim).to(dtype)
    table = torch.randint(1, slots, (n, width))
    lengths = torch.tensor([width, 1, 20, 9])
    want = paged_attention_reference(q.double(), keys, values, table, lengths, window=window or None)
    got = layers.attend(0, q, table, lengths, cpu_kernels.handle(tier), window, None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_the_kernel_refuses_q8_0_cells_it_cannot_read():
    handle = cpu_kernels.handle(TIERS[0])
    q, table, lengths = torch.randn(1, 2, 16), torch.zeros(1, 3, dtype=torch.long), torch.tensor([3])
    codes, steps = torch.zeros(8, 1, 16, dtype=torch.int8), torch.zeros(8, 1, 0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        torch.ops.nanoserve.decode_attention(q, codes, torch.zeros(8, 1, 16), table, lengths, 0.25, handle, 0, None,
                                             steps)
    codes = torch.zeros(8, 1, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="scales must be contiguous fp16"):
        torch.ops.nanoserve.decode_attention(torch.randn(1, 2, 32), codes, torch.zeros(8, 1, 32), table, lengths, 0.25,
                                             handle, 0, None, torch.zeros(8, 1, 1))


# 4 heads of 32 over 2 K/V heads: a head q8_0 can hold (runs of 32)
CONFIG = tiny_config(hidden_size=128, head_dim=32)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=3)


def rounded_kv_greedy(model, prompt: list[int], steps: int, round_k: bool = True, round_v: bool = True,
                      with_margins: bool = False):
    """The oracle: the dense forward with each layer's K and V rounded to q8_0 where the cache holds
    them, greedy, with the chosen tokens' logprobs (and each step's top-two margin)."""

    class Rounded(DenseCausalAttention):
        def __call__(self, layer, q, k, v, **kwargs):
            return super().__call__(layer, q, rounded(k) if round_k else k, rounded(v) if round_v else v, **kwargs)

    ids, logprobs, margins = list(prompt), [], []
    for _ in range(steps):
        t = len(ids)
        hidden = model(torch.tensor(ids), torch.arange(t), Rounded(1, t))
        row = torch.log_softmax(model.compute_logits(hidden[-1:])[0].float(), dim=-1)
        top = row.topk(2).values
        ids.append(int(row.argmax()))
        logprobs.append(float(top[0]))
        margins.append(float(top[0] - top[1]))
    if with_margins:
        return ids[len(prompt):], logprobs, margins
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q8_0", "auto"), ("auto", "q8_0")], ids=["kv", "k", "v"])
def test_an_engine_with_q8_0_cells_gives_the_rounded_kv_oracles_tokens(model, chunked, types):
    prompts = [[(7 * i + 3 * j) % 256 for j in range(length)] for i, length in enumerate([5, 23, 14])]
    engine = engine_for(model, max_num_batched_tokens=12, enable_chunked_prefill=chunked,
                        cache_type_k=types[0], cache_type_v=types[1])
    assert [f.name for f in engine.worker.cache.formats] == [("q8_0" if t == "q8_0" else "fp32") for t in types]
    plain = engine_for(model, max_num_batched_tokens=12, enable_chunked_prefill=chunked)
    outs = generate(engine, prompts, greedy(8, logprobs=0))
    plains = generate(plain, prompts, greedy(8, logprobs=0))
    moved = 0.0
    for prompt, out, other in zip(prompts, outs, plains):
        tokens, logprobs = rounded_kv_greedy(model, prompt, 8, types[0] == "q8_0", types[1] == "q8_0")
        assert out.token_ids == tokens
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-4)
        moved = max(moved, max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, other.logprobs)))
    assert moved > 1e-5  # the option is honoured: the rounding shows in the logprobs
    engine.check_drained()


def test_a_cached_prefix_of_q8_0_cells_gives_the_fresh_prompts_tokens(model):
    system = [(5 * j + 1) % 256 for j in range(22)]
    prompts = [system + [9, 8, 7], system + [1, 2], system + [3]]
    cached = engine_for(model, max_num_batched_tokens=12, kv_cache_dtype="q8_0", enable_prefix_caching=True)
    fresh = engine_for(model, max_num_batched_tokens=64, kv_cache_dtype="q8_0", enable_prefix_caching=False,
                       enable_chunked_prefill=False)
    params = greedy(6, logprobs=0)
    first = generate(cached, prompts[:1], params)
    rest = generate(cached, prompts[1:], params)
    assert cached.stats().prefix_cache_hits >= 2 * 20
    for out, want in zip(first + rest, generate(fresh, prompts, params)):
        assert out.token_ids == want.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)


def test_the_q8_0_pool_holds_about_twice_bf16s_tokens_and_says_so():
    bf16 = random_model(CONFIG, seed=3, dtype=torch.bfloat16)
    sizes = dict(kv_cache_bytes=1 << 20, block_size=16, max_model_len=512, max_batch_size=2, dtype="bfloat16")
    plain = engine_for(bf16, max_num_batched_tokens=64, **sizes)
    small = engine_for(bf16, max_num_batched_tokens=64, kv_cache_dtype="q8_0", **sizes)
    assert plain.resolved.kv_cache_types == ("bf16", "bf16")
    assert small.resolved.kv_cache_types == ("q8_0", "q8_0")
    ratio = (small.resolved.num_blocks - 1) / (plain.resolved.num_blocks - 1)
    assert ratio == pytest.approx(16 / 8.5, rel=0.02)
    assert small.worker.cache.kv_bytes <= 1 << 20
    line = next(x for x in describe_engine(small, "tiny", 0.0) if x.startswith("K/V pool"))
    assert "of q8_0 (8.5 bits a value)" in line
    assert f"({(small.resolved.num_blocks - 1) * 16:,} tokens for requests" in line
    mixed = engine_for(bf16, max_num_batched_tokens=64, cache_type_k="q8_0", **sizes)
    assert "K q8_0 (8.5 bits a value), V bfloat16" in describe_engine(mixed, "tiny", 0.0)[2]


def test_the_kernel_path_with_q8_0_cells_agrees_with_the_oracle_up_to_near_ties():
    # bf16 activations: the decode rows go through the kernel tier's q8_0 read. The oracle rounds
    # in its own order, so the runs may part only where its top two are closer than the tolerance.
    bf16 = random_model(CONFIG, seed=3, dtype=torch.bfloat16)
    engine = engine_for(bf16, max_num_batched_tokens=12, kv_cache_dtype="q8_0", dtype="bfloat16")
    assert engine.worker.decode_step.attention_kernel is not None
    tolerance = 0.05
    for prompt in ([(11 * j + 5) % 256 for j in range(19)], [(3 * j + 2) % 256 for j in range(7)]):
        got = generate(engine, [prompt], greedy(8, logprobs=0))[0]
        tokens, logprobs, margins = rounded_kv_greedy(bf16, prompt, 8, with_margins=True)
        for i, (a, b) in enumerate(zip(got.token_ids, tokens)):
            if a != b:
                assert margins[i] < 2 * tolerance, f"parted at token {i} with a margin of {margins[i]}"
                break
            assert got.logprobs[i].logprob == pytest.approx(logprobs[i], abs=tolerance)
    engine.check_drained()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["sdpa-fp32", "kernel-bf16"])
def test_compiled_q8_0_steps_give_the_eager_q8_0_tokens(dtype):
    # The compiled step writes and reads q8_0 cells in its graph (fp32: the gathered read; bf16:
    # the kernel tier's), and chooses eager's tokens; its graphs are keyed by the K/V format.
    torch._dynamo.reset()
    prompts, params = [[1, 2, 3], list(range(10, 40)), [7] * 5], greedy(24, logprobs=2)
    eager = engine_for(random_model(CONFIG, seed=4), max_num_batched_tokens=64, kv_cache_dtype="q8_0", dtype=dtype)
    compiled = engine_for(random_model(CONFIG, seed=4), max_num_batched_tokens=64, kv_cache_dtype="q8_0", dtype=dtype,
                          compile=True, row_buckets=(4,), width_buckets=(64, 128), warmup="eager")
    step = compiled.worker.decode_step
    assert "q8_0" in step.graph_key(step.shapes[0]).describe()["kv"]
    # Compiled and eager round the values they store differently in the last bit, so a value near
    # the midpoint of two codes may take either: one code step (max |x| / 127) on either side.
    tolerance = 0.01 if dtype == "float32" else 0.05
    for got, ref in zip(generate(compiled, prompts, params), generate(eager, prompts, params)):
        assert_greedy_agrees_up_to_near_ties(got, ref, tolerance)
    assert compiled.stats().recompiles_after_warmup == 0 and compiled.stats().bucket_hits
    torch._dynamo.reset()


def test_the_prefix_cache_is_keyed_by_the_kv_types(model):
    # A block cached with bf16 cells is not a q8_0 block: the hashes' root differs.
    roots = {types: engine_for(model, max_num_batched_tokens=12, cache_type_k=types[0],
                               cache_type_v=types[1]).scheduler.blocks._root_hash
             for types in [("auto", "auto"), ("q8_0", "q8_0"), ("q8_0", "auto")]}
    assert len(set(roots.values())) == 3
