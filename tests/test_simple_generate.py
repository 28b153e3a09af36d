"""The engine-less generation loop: its cache agrees with the dense oracle; sampling is sane."""

from __future__ import annotations

import pytest
import torch

from nanoserve.model.llama import dense_forward
from nanoserve.model.simple_generate import SimpleSampling, generate_tokens, sample_next
from nanoserve.model.synthetic import random_model, tiny_config


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(max_position_embeddings=64), seed=3)


def dense_greedy(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(dense_forward(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_cached_greedy_equals_dense_oracle(model):
    prompt = [5, 17, 99, 3, 42]
    assert list(generate_tokens(model, prompt, SimpleSampling(max_tokens=20))) == dense_greedy(model, prompt, 20)


def test_single_token_prompt(model):
    assert list(generate_tokens(model, [7], SimpleSampling(max_tokens=5))) == dense_greedy(model, [7], 5)


def test_stop_token_is_yielded_then_generation_ends(model):
    prompt = [5, 17, 99]
    first = dense_greedy(model, prompt, 1)[0]
    assert list(generate_tokens(model, prompt, SimpleSampling(max_tokens=10), stop_ids=[first])) == [first]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    prompt = [1, 2, 3]
    params = SimpleSampling(max_tokens=12, temperature=1.0, seed=7)
    assert list(generate_tokens(model, prompt, params)) == list(generate_tokens(model, prompt, params))
    top1 = SimpleSampling(max_tokens=12, temperature=0.8, top_k=1, seed=1)
    assert list(generate_tokens(model, prompt, top1)) == dense_greedy(model, prompt, 12)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([3.0, 2.9, -5.0, -6.0])
    params = SimpleSampling(temperature=1.0, top_p=0.5)
    gen = torch.Generator().manual_seed(0)
    assert {sample_next(logits, params, gen) for _ in range(50)} <= {0, 1}


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_k=-1),
                                    dict(top_p=0.0), dict(top_p=1.5)])
def test_impossible_sampling_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SimpleSampling(**kwargs)


def test_bad_prompts_are_refused(model):
    with pytest.raises(ValueError, match="empty"):
        list(generate_tokens(model, [], SimpleSampling()))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(generate_tokens(model, [256], SimpleSampling()))
    with pytest.raises(ValueError, match="exceeds"):
        list(generate_tokens(model, [1] * 60, SimpleSampling(max_tokens=10)))
