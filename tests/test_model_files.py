"""compile/model_files' random files in the low-bit mixes (IQ4_XS, Q3_K_M): each tensor gets the
type llama.cpp's own quantiser gives it, and a file of each mix loads packed in nanoserve and in
llama.cpp and gives finite logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from compile.model_files import Shape, tensor_types, write_model
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.fidelity import teacher_forced_logits

LOW_BIT = ("IQ4_XS", "Q3_K_M")
# 16 layers: the rules that single out the first sixteenth and eighth of the layers each pick a
# layer; 4 query heads a K/V head: IQ4_XS's attn_v rule. 320 wide: every 256-weight type's
# fallback, and a tied embedding's.
# A 1,024-token vocabulary keeps the quantiser's work small (it reads no tokenizer).
UNTIED_GQA4 = Shape(hidden=256, layers=16, heads=4, kv_heads=1, ffn=512, tied=False, vocab=1024)
TIED_320 = Shape(hidden=320, layers=8, heads=5, kv_heads=5, ffn=512, tied=True, vocab=1024)
TINY = Shape(hidden=256, layers=2, heads=4, kv_heads=1, ffn=512, tied=True)


def file_types(path) -> dict[str, Q]:
    return {t.name: Q(t.tensor_type) for t in GGUFReader(path).tensors if len(t.shape) > 1}


def test_the_mixes_give_the_tensors_llama_cpps_types_by_layer():
    types = tensor_types(UNTIED_GQA4, "Q3_K_M")
    assert (types["output.weight"], types["token_embd.weight"]) == (Q.Q6_K, Q.Q3_K)
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)] == [Q.Q5_K, Q.Q4_K]
    assert types["blk.3.attn_output.weight"] == Q.Q4_K and types["blk.3.ffn_up.weight"] == Q.Q3_K
    types = tensor_types(UNTIED_GQA4, "IQ4_XS")
    assert types["token_embd.weight"] == Q.IQ4_XS and types["blk.5.attn_v.weight"] == Q.Q5_K
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (1, 2)] == [Q.Q5_K, Q.IQ4_XS]
    # Fewer than 4 query heads a K/V head: attn_v stays IQ4_XS; a 320-wide row falls back.
    assert tensor_types(Shape(256, 2, 4, 2, 512, tied=True), "IQ4_XS")["blk.1.attn_v.weight"] == Q.IQ4_XS
    types = tensor_types(TIED_320, "Q3_K_M")
    assert types["token_embd.weight"] == Q.Q8_0 and types["blk.0.attn_q.weight"] == Q.Q4_0
    assert types["blk.0.ffn_down.weight"] == Q.Q4_K  # 512 wide: no fallback


@pytest.fixture(scope="module", params=[UNTIED_GQA4, TIED_320], ids=["untied-gqa4", "tied-320"])
def float_file(request, tmp_path_factory):
    """An unquantised random file of the shape, and the shape."""
    return write_model(tmp_path_factory.mktemp("f32") / "f32.gguf", request.param, "F32"), request.param


@pytest.mark.slow
def test_the_mixes_are_what_llama_cpps_quantiser_writes(float_file, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[peers]')")
    from compile.quantised_files import llama_quantise

    source, shape = float_file
    for file_type in LOW_BIT:
        theirs = file_types(llama_quantise(source, tmp_path / f"{file_type}.gguf", file_type))
        assert {name: kind for name, kind in theirs.items() if kind != Q.F32} == tensor_types(shape, file_type)


@pytest.fixture(scope="module", params=LOW_BIT)
def tiny_file(request, tmp_path_factory):
    """A tiny random file of the mix (2 layers, 4 query heads a K/V head), and the mix's name."""
    return write_model(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", TINY, request.param), request.param


def test_a_random_file_of_each_mix_loads_packed_and_gives_finite_logits(tiny_file):
    path, file_type = tiny_file
    body = {"IQ4_XS": Q.IQ4_XS, "Q3_K_M": Q.Q3_K}[file_type]
    assert Counter(file_types(path).values())[body] > 0
    engine = build_engine(str(path), max_batch_size=2, max_model_len=64, kv_cache_bytes=1 << 22)
    runs = engine.stats().weight_types  # {type: how it runs}: every linear's type from its own blocks
    assert runs[body.name] == runs["Q5_K"] == "packed", runs
    logits = teacher_forced_logits(engine.model, list(range(3, 40)), 8)
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_llama_cpp_runs_a_random_file_of_each_mix(tiny_file):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[peers]')")
    from compile.llama_peer import LlamaCpp
    from compile.llama_peer import teacher_forced_logits as llama_logits

    peer = LlamaCpp(tiny_file[0], max_rows=1, max_len=64, threads=1, repack=False)  # runs on every host
    try:
        logits = llama_logits(peer, list(range(3, 40)))
    finally:
        peer.close()
    assert logits.shape == (37, TINY.vocab) and np.isfinite(logits).all() and np.abs(logits).max() > 0
