"""Per architecture: tiny random models in transformers' own implementation, saved as Hugging
Face directories, read by nanoserve's loader and compared with transformers in fp32."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from arch_models import (
    ARCHITECTURES,
    VOCAB,
    WINDOW,
    WINDOWED,
    hf_and_ours,
    make_hf_model,
    rel_err,
    save_bpe_tokenizer,
)

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.hf_loader import load_hf_state_dict, read_hf_config
from nanoserve.model.formats.loader import build_model
from nanoserve.model.network.llama import dense_forward, unfuse_hf_weights

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_pair(request, tmp_path_factory):
    """(variant, transformers model, nanoserve model read from the saved directory)."""
    return (request.param, *hf_and_ours(request.param, tmp_path_factory.mktemp(request.param)))


def test_logits_match_transformers_past_the_window(arch_pair):
    _, hf, ours = arch_pair
    ids = torch.randint(3, VOCAB, (2, 5 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(dense_forward(ours, ids), ref) < 1e-4


def test_left_padded_batch_matches_transformers(arch_pair):
    _, hf, ours = arch_pair
    lengths, width = [3 * WINDOW, 5, 2 * WINDOW + 3], 3 * WINDOW
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    logits = dense_forward(ours, ids, attention_mask=mask)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for row, n in enumerate(lengths):
        assert rel_err(logits[row, width - n:], ref[row, width - n:]) < 1e-4


@pytest.mark.parametrize("variant", WINDOWED)
def test_the_sliding_window_changes_logits_only_past_it(variant, tmp_path):
    """The window is honoured, not ignored: with a window too wide to bind (the same layers,
    the same ropes) the logits part after WINDOW tokens."""
    hf = make_hf_model(variant)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, weights = read_hf_config(tmp_path), load_hf_state_dict(tmp_path)
    assert config.sliding_window == WINDOW
    unwindowed = build_model(dataclasses.replace(config, sliding_window=1 << 20), weights)
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
    windowed, full = dense_forward(build_model(config, weights), ids), dense_forward(unwindowed, ids)
    assert rel_err(windowed[:, :WINDOW], full[:, :WINDOW]) < 1e-6
    assert rel_err(windowed[:, WINDOW:], full[:, WINDOW:]) > 1e-3


def test_config_is_read_as_the_architecture_needs(arch_pair):
    variant, _, ours = arch_pair
    c = ours.config
    assert c.qk_norm == (variant in ("qwen3", "gemma3"))
    assert c.sandwich_norms == c.scale_embeddings == (variant == "gemma3")
    assert c.hidden_act == ("gelu_pytorch_tanh" if variant == "gemma3" else "silu")
    assert c.sliding_window == (WINDOW if variant in WINDOWED else None)
    assert [c.layer_window(i) for i in range(c.num_layers)] == {
        "mistral": [WINDOW] * 4, "gemma3": [WINDOW, None, WINDOW, None]}.get(variant, [None] * 4)
    if variant == "gemma3":
        assert (c.rope_theta, c.rope_local_theta, c.rope_type) == (1e6, 1e4, "linear")
        assert c.attention_scale == pytest.approx(24 ** -0.5) and c.final_logit_softcapping == 5.0
    if variant == "llama3":
        assert c.rope_type == "llama3"


def test_hf_weights_round_trip_through_the_model(arch_pair):
    """unfuse_hf_weights gives back the checkpoint's tensors (Gemma's norms in HF's convention)."""
    _, hf, ours = arch_pair
    ours_hf = unfuse_hf_weights(ours)
    for name, tensor in hf.state_dict().items():
        if name in ours_hf:
            torch.testing.assert_close(ours_hf[name], tensor, rtol=0, atol=1e-7)
    assert ours_hf.keys() <= hf.state_dict().keys()


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (the 4B and larger models): the text config
    and the language model's tensors are read; the vision tower's are left out."""
    hf = make_hf_model("gemma3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config_path = tmp_path / "config.json"
    text = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                       "text_config": {**text, "model_type": "gemma3_text"}}))
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in weights.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    save_file(renamed, tmp_path / "model.safetensors")
    ours = build_model(read_hf_config(tmp_path), load_hf_state_dict(tmp_path))
    ids = torch.arange(3, 3 + 3 * WINDOW)[None]
    with torch.no_grad():
        assert rel_err(dense_forward(ours, ids), hf(ids).logits) < 1e-4


# --- configs the model code cannot run are refused at load, saying what is missing -------------

def _write_config(tmp_path, **overrides):
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
           "hidden_activation": "gelu_pytorch_tanh"}
    raw.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(attn_logit_softcapping=50.0), "attention logit soft-capping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "activation 'relu' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}}),
     "rope scaling type 'longrope' is not supported (supported: default, linear, llama3"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding layers' rope type 'linear'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer types ['chunked_attention']"),
    (dict(hidden_size=None), "missing required key 'hidden_size'"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
     "unsupported architecture ['Gemma2ForCausalLM'] (supported: LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM"),
])
def test_a_config_the_model_cannot_run_is_refused_naming_what(tmp_path, overrides, message):
    with pytest.raises(ModelLoadError, match="config.json") as info:
        read_hf_config(_write_config(tmp_path, **overrides))
    assert message in str(info.value)


def test_a_runnable_gemma3_config_is_accepted(tmp_path):
    config = read_hf_config(_write_config(tmp_path))
    # sliding_window_pattern's default: every sixth layer is global.
    assert [config.layer_window(i) for i in range(2)] == [8, 8]


def test_a_multimodal_gemma3_text_config_takes_transformers_defaults_for_what_it_leaves_out(tmp_path):
    """The 4B's text_config names only its sizes, window and rope scaling; the rest are
    Gemma3TextConfig's defaults, as transformers reads them."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "eos_token_id": [1, 106], "text_config": text}))
    ours = read_hf_config(tmp_path)
    reference = transformers.Gemma3TextConfig(**text)
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        reference.vocab_size, reference.num_attention_heads, reference.num_key_value_heads, reference.head_dim)
    assert ours.attention_scale == reference.query_pre_attn_scalar ** -0.5
    assert (ours.rope_theta, ours.rope_local_theta, ours.rope_type) == (1e6, 1e4, "linear")
    assert [ours.layer_window(i) is None for i in range(34)] == [t == "full_attention" for t in reference.layer_types]
    assert ours.eos_token_ids == (1, 106) and ours.tie_word_embeddings


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_qwen_sliding_window_from_max_window_layers_matches_transformers(variant, tmp_path):
    """use_sliding_window: layers from max_window_layers on attend over the window."""
    hf = make_hf_model(variant, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = read_hf_config(tmp_path)
    assert [config.layer_window(i) for i in range(4)] == [None, None, WINDOW, WINDOW]
    ids = torch.randint(3, VOCAB, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(dense_forward(build_model(config, load_hf_state_dict(tmp_path)), ids), ref) < 1e-4


def test_build_engine_takes_a_gemma3_directory_by_path(tmp_path):
    """`build_engine("dir")` on a Gemma 3 Hugging Face directory with its tokenizer.json: the
    default (packed) weights, text in and text out."""
    from nanoserve.engine import SamplingParams, build_engine

    make_hf_model("gemma3", vocab_size=320).save_pretrained(tmp_path, safe_serialization=True)
    save_bpe_tokenizer(tmp_path, "a sliding window over the words", 320, "<bos>", "<eos>")
    engine = build_engine(str(tmp_path), max_batch_size=2, max_model_len=128)
    prompt = "a sliding window over the words " * 3
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4 and engine.model.config.architecture == "gemma3"
    assert len(engine.tokenizer.encode(prompt)) > WINDOW
