"""nanoserve's Llama network against transformers on tiny random models saved as safetensors."""

from __future__ import annotations

import pytest
import torch
from arch_models import save_bpe_tokenizer

from nanoserve.model.formats.hf_loader import load_hf_state_dict, read_hf_config
from nanoserve.model.formats.loader import build_model, load_model
from nanoserve.model.network.llama import dense_forward, unfuse_hf_weights
from nanoserve.model.network.reference_attention import DenseCausalAttention

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
VARIANTS = {
    "llama": ("LlamaForCausalLM", dict(TINY)),
    "llama-tied": ("LlamaForCausalLM", dict(TINY, tie_word_embeddings=True)),
    "llama-bias": ("LlamaForCausalLM", dict(TINY, attention_bias=True)),
    "llama3-rope": ("LlamaForCausalLM", dict(TINY, rope_parameters=LLAMA3_ROPE)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
# Lengths chosen to cross the llama3 band edges (wavelengths 8..32 at original length 32).
PROMPT_LENGTHS = (1, 7, 40, 130)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def make_hf_model(arch: str, kwargs: dict, seed: int = 0):
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_cls(**kwargs)).eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms; randomise so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_pair(request, tmp_path_factory):
    """(variant, transformers model, nanoserve model) sharing weights via a safetensors dir."""
    arch, kwargs = VARIANTS[request.param]
    hf = make_hf_model(arch, kwargs)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours = build_model(read_hf_config(path), load_hf_state_dict(path))
    return request.param, hf, ours


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_match_transformers(tiny_pair, length):
    _, hf, ours = tiny_pair
    ids = torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(dense_forward(ours, ids), ref) < 1e-4


def test_left_padded_batch_matches_transformers_and_single_rows(tiny_pair):
    _, hf, ours = tiny_pair
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 3, 6]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, TINY["vocab_size"], (n,), generator=gen)
        mask[row, width - n:] = 1
    logits = dense_forward(ours, ids, attention_mask=mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=positions).logits
    for row, n in enumerate(lengths):
        real = slice(width - n, width)
        assert rel_err(logits[row, real], ref[row, real]) < 1e-4
        alone = dense_forward(ours, ids[row:row + 1, real])[0]
        assert rel_err(logits[row, real], alone) < 1e-5


def test_hf_config_is_read_faithfully(tiny_pair):
    variant, hf, ours = tiny_pair
    c, r = ours.config, hf.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.tie_word_embeddings == r.tie_word_embeddings
    assert c.attention_bias == (variant in ("qwen2-bias", "llama-bias"))
    assert c.attention_out_bias == (variant == "llama-bias")
    assert c.rope_type == ("llama3" if variant == "llama3-rope" else "default")
    assert (ours.lm_head is None) == (variant == "llama-tied")


def test_load_model_reads_hf_directory_with_tokenizer(tmp_path):
    # Rows for every id the tokenizer has (its byte alphabet and two specials: 258 tokens).
    hf = make_hf_model("LlamaForCausalLM", dict(TINY, vocab_size=264))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    save_bpe_tokenizer(tmp_path, "hello world", 258, "<s>", "</s>")
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer.eos_token_id == 1 and tokenizer.bos_token_id == 0
    ids = torch.tensor([tokenizer.encode("hello world")])
    with torch.no_grad():
        assert rel_err(dense_forward(model, ids), hf(ids).logits) < 1e-4


def test_sharded_safetensors_directory_loads(tmp_path):
    hf = make_hf_model(*VARIANTS["llama"])
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = build_model(read_hf_config(tmp_path), load_hf_state_dict(tmp_path))
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        assert rel_err(dense_forward(ours, ids), hf(ids).logits) < 1e-4


def test_attention_is_called_per_layer_with_flat_rotated_tokens(tiny_pair):
    _, _, ours = tiny_pair
    calls = []

    def attention(layer_idx, q, k, v):
        calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return DenseCausalAttention(1, 5)(layer_idx, q, k, v)

    hidden = ours(torch.arange(5), torch.arange(5), attention)
    assert hidden.shape == (5, 64)
    assert calls == [(i, (5, 4, 16), (5, 2, 16), (5, 2, 16)) for i in range(2)]
    assert ours.compute_logits(hidden[-1:]).shape == (1, 256)


def test_flat_forward_over_two_sequences_matches_separate_runs(tiny_pair):
    """Two sequences packed flat with their own positions: what a paged backend will see."""
    _, _, ours = tiny_pair
    a, b = torch.arange(3, 10), torch.arange(20, 24)

    def per_sequence(layer_idx, q, k, v):
        n = len(a)
        first = DenseCausalAttention(1, n)(layer_idx, q[:n], k[:n], v[:n])
        second = DenseCausalAttention(1, len(b))(layer_idx, q[n:], k[n:], v[n:])
        return torch.cat([first, second])

    with torch.no_grad():
        hidden = ours(torch.cat([a, b]), torch.cat([torch.arange(len(a)), torch.arange(len(b))]), per_sequence)
        logits = ours.compute_logits(hidden)
    assert rel_err(logits[:len(a)], dense_forward(ours, a[None])[0]) < 1e-5
    assert rel_err(logits[len(a):], dense_forward(ours, b[None])[0]) < 1e-5


def test_forward_compiles_as_one_graph():
    """Rotary lookup and layers trace without graph breaks (the decode graph depends on it)."""
    from nanoserve.model.network.synthetic import random_model, tiny_config

    model = random_model(tiny_config())
    attention = DenseCausalAttention(2, 6)

    def step(ids, positions):
        return model.compute_logits(model(ids, positions, attention))

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    ids, positions = torch.arange(12), torch.arange(6).repeat(2)
    with torch.no_grad():
        assert torch.allclose(compiled(ids, positions), step(ids, positions))


def test_bf16_forward_stays_close_to_fp32(tiny_pair):
    _, _, ours = tiny_pair
    ids = torch.arange(3, 40)[None]
    ref = dense_forward(ours, ids)
    low = build_model(ours.config, unfuse_hf_weights(ours), dtype=torch.bfloat16)
    assert low.embed_tokens.weight.dtype == torch.bfloat16
    assert rel_err(dense_forward(low, ids).float(), ref) < 5e-2
