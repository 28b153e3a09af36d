"""The CPU sampler's op (worker/sample_rows.cpp): the token at a uniform draw u of each row's law
is drawn with exactly that law's probabilities, greedy rows are torch's argmax, and the Sampler
feeds it its draws as the exponential race takes its own (global RNG, then a seeded row's)."""

import ast
import fnmatch
from pathlib import Path

import pytest
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.quant import cpu_kernels
from nanoserve.worker.sampler import Sampler, law_tensors

pytestmark = pytest.mark.skipif(not cpu_kernels.ops_available(), reason="nanoserve's ops library did not build")

N = 4000  # stratified draws: u = (j + 1/2) / N


def _stratified_frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Each token's share of N draws at evenly spaced u: within 1 / N of its probability when
    the op picks the token at u of the law's cumulative distribution (in any token order)."""
    rows = logits.expand(N, -1).contiguous()
    uniform = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    tokens = torch.ops.nanoserve.sample_rows(rows, *law_tensors([params] * N), uniform)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / N


def _logits(kind: str, vocab: int = 3000) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    if kind == "flat":
        return torch.randn(1, vocab, generator=g)
    if kind == "peaked":  # a language model's: a few tokens carry most of the mass
        return torch.randn(1, vocab, generator=g) * 4
    masked = torch.randn(1, vocab, generator=g) * 2
    masked[0, torch.randperm(vocab, generator=g)[: vocab - 50]] = float("-inf")  # a grammar's mask
    return masked


LAWS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9),  # llama.cpp's and Ollama's defaults, near enough
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=1.0, top_k=100, min_p=0.02),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=2999),
    SamplingParams(temperature=1.0, top_k=10**9),
    SamplingParams(temperature=1e30),  # every finite token alike
]


@pytest.mark.parametrize("kind", ["flat", "peaked", "masked"])
@pytest.mark.parametrize("params", LAWS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_sample_rows_draws_each_token_with_its_law_probability(kind, params):
    logits = _logits(kind)
    _, probs = Sampler(cpu_op=False).distribution(logits, [params])
    freq = _stratified_frequencies(logits, params)
    assert (freq - probs[0].double()).abs().max().item() <= 2 / N
    assert freq[probs[0] == 0].sum().item() == 0  # nothing the law excludes (top-k, top-p, min-p, masks)


@pytest.mark.parametrize("kind", ["flat", "peaked", "masked"])
def test_law_probabilities_are_the_sorted_torch_law_without_the_sort(kind):
    # Every law of LAWS, and greedy rows (their law at temperature 1, top-k and all), in one batch.
    logits = _logits(kind)
    params = LAWS + [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=5, top_p=0.5)]
    rows = logits.expand(len(params), -1).contiguous()
    _, expected = Sampler(cpu_op=False).distribution(rows, params)
    _, probs = Sampler(cpu_op=True).distribution(rows, params)
    assert torch.equal(probs > 0, expected > 0)  # the same tokens kept by every filter
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(probs.double().sum(dim=-1), torch.ones(len(params), dtype=torch.float64))


def test_law_probabilities_of_a_row_with_no_finite_logit_are_nan_as_torch_gives_them():
    logits = torch.tensor([[float("-inf")] * 6, [0.0, float("nan"), 1.0, 2.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=2)]
    for cpu_op in (True, False):
        assert Sampler(cpu_op=cpu_op).distribution(logits, params)[1].isnan().all()


def test_sample_rows_greedy_is_torch_argmax_ties_masks_and_nan_included():
    logits = torch.randn(6, 500).bfloat16().float()  # bf16's few values: ties
    logits[1, 7] = logits[1, 300] = logits[1].max() + 1  # a tie for the largest: the first
    logits[2] = float("-inf")  # every token masked
    logits[3, 11] = logits[3, 40] = float("nan")
    logits[4, 99] = float("inf")
    greedy = SamplingParams(temperature=0.0)
    tokens = torch.ops.nanoserve.sample_rows(logits, *law_tensors([greedy] * 6), torch.rand(6, dtype=torch.float64))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[1] == 7 and tokens[2] == 0 and tokens[3] == 11 and tokens[4] == 99


def test_sample_rows_top_k_keeps_the_ties_at_its_edge():
    logits = torch.tensor([[5.0, 4.0, 4.0, 1.0, 4.0, 0.0]])
    freq = _stratified_frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (freq > 0).tolist() == [True, True, True, False, True, False]


def test_sample_rows_top_k_beyond_a_masks_tokens_draws_only_allowed_ones():
    logits = torch.full((1, 128256), float("-inf"))
    logits[0, [3, 70000, 128255]] = torch.tensor([1.0, 2.0, 0.5])
    freq = _stratified_frequencies(logits, SamplingParams(temperature=0.8, top_k=40, top_p=0.95))
    assert set(freq.nonzero().flatten().tolist()) <= {3, 70000, 128255} and freq[70000] > 0.5


def test_sample_rows_takes_any_float_logits_and_checks_its_arguments():
    logits = torch.randn(2, 64)
    params = [SamplingParams(temperature=0.9, top_p=0.9)] * 2
    uniform = torch.tensor([0.25, 0.75], dtype=torch.float64)
    as_fp32 = torch.ops.nanoserve.sample_rows(logits.bfloat16().float(), *law_tensors(params), uniform)
    assert torch.equal(torch.ops.nanoserve.sample_rows(logits.bfloat16(), *law_tensors(params), uniform), as_fp32)
    with pytest.raises(RuntimeError, match="uniform"):
        torch.ops.nanoserve.sample_rows(logits, *law_tensors(params), uniform.float())
    temperature, _, top_p, min_p = law_tensors(params)
    with pytest.raises(RuntimeError, match="top_k"):
        torch.ops.nanoserve.sample_rows(logits, temperature, torch.zeros(3, dtype=torch.long), top_p, min_p, uniform)


def test_the_sampler_draws_u_from_the_global_rng_then_a_seeded_rows_generator():
    logits = torch.randn(3, 1000)
    params = [SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.8, seed=11),
              SamplingParams(top_p=0.9, min_p=0.05)]
    torch.manual_seed(3)
    got = Sampler()(logits, params, [None, torch.Generator().manual_seed(11), None]).token_ids
    torch.manual_seed(3)
    uniform = torch.rand(3, dtype=torch.float64)
    uniform[1] = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    assert torch.equal(got, torch.ops.nanoserve.sample_rows(logits, *law_tensors(params), uniform))


def test_an_all_greedy_batch_draws_nothing_from_the_global_rng():
    logits = torch.randn(4, 100)
    before = torch.get_rng_state()
    Sampler()(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert torch.equal(torch.get_rng_state(), before)


def test_every_source_of_the_ops_library_ships_in_the_package():
    root = Path(cpu_kernels.__file__).parents[3]
    # (read by hand: tomllib is 3.11's, and the project runs on 3.10)
    section = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    line = next(text for text in section.splitlines() if text.startswith("nanoserve ="))
    globs = ast.literal_eval(line.split("=", 1)[1].split("#", 1)[0].strip())
    for source in cpu_kernels.OPS_SOURCES:
        relative = source.relative_to(root / "nanoserve").as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in globs), f"{relative} is not package data"
