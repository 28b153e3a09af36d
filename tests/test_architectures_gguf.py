"""Per architecture, GGUF files as llama.cpp's converter writes them (gguf's tensor names, Q/K
permuted for "llama", Gemma's 1 + w norms, Llama 3's rope_freqs factors) from tiny random
transformers models: nanoserve reads them back to transformers' logits (fp32, 1e-4), eager
and through the engine."""

from __future__ import annotations

import gguf
import pytest
import torch
from arch_models import ARCHITECTURES, VOCAB, WINDOW, make_hf_model, rel_err, write_converted_gguf
from engine_oracle_helpers import dequantised_logits_bound, engine_for, generate, greedy

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.gguf_loader import GGUFCheckpoint
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.quant.linear import GroupLinear
from nanoserve.model.quant.weight_plan import WeightPlan

transformers = pytest.importorskip("transformers")

# llama.cpp's "llama" architecture has no sliding window (Mistral's files run without one), and
# its Gemma 3 takes the score scale from head_dim (hidden / heads for the 27B) and makes every
# sixth layer global: the GGUF variants are the models those files can describe.
GGUF_OVERRIDES = {"mistral": dict(sliding_window=None),
                  "gemma3": dict(query_pre_attn_scalar=32, num_hidden_layers=6, layer_types=None)}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def gguf_pair(request, tmp_path_factory):
    """(variant, transformers model, path of its converted GGUF)."""
    hf = make_hf_model(request.param, **GGUF_OVERRIDES.get(request.param, {}))
    path = write_converted_gguf(tmp_path_factory.mktemp(request.param) / "model.gguf", hf, request.param)
    return request.param, hf, path


def test_gguf_logits_match_transformers_past_the_window(gguf_pair):
    _, hf, path = gguf_pair
    model, tokenizer = load_model(str(path))
    ids = torch.randint(3, VOCAB, (2, 5 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(dense_forward(model, ids), ref) < 1e-4
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"


def test_gguf_config_equals_the_directory_config(gguf_pair, tmp_path):
    """The file's metadata describes the same network as transformers' config.json."""
    from nanoserve.model.formats.hf_loader import read_hf_config

    variant, hf, path = gguf_pair
    hf.save_pretrained(tmp_path, safe_serialization=True)
    from_dir, from_gguf = read_hf_config(tmp_path), GGUFCheckpoint.open(path).config()
    same = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "sandwich_norms", "hidden_act",
            "scale_embeddings", "sliding_window", "rope_theta", "rope_local_theta", "attention_bias",
            "tie_word_embeddings", "final_logit_softcapping")
    assert {k: getattr(from_gguf, k) for k in same} == {k: getattr(from_dir, k) for k in same}
    windows = [from_dir.layer_window(i) for i in range(from_dir.num_layers)]
    assert [from_gguf.layer_window(i) for i in range(from_gguf.num_layers)] == windows
    assert from_gguf.attention_scale == pytest.approx(from_dir.attention_scale)


def test_gguf_model_through_the_engine_equals_transformers(gguf_pair):
    """Batched, chunked and prefix-cached, eager: the engine's greedy tokens are transformers'."""
    _, hf, path = gguf_pair
    model, _ = load_model(str(path))
    engine = engine_for(model, max_num_batched_tokens=11, max_model_len=64)
    prompts = [list(range(3, 3 + 4 * WINDOW)), list(range(3, 3 + 2 * WINDOW)) + [9, 9], [5, 6, 7]]
    outputs = generate(engine, prompts, greedy(8))
    for output, prompt in zip(outputs, prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours, want = output.token_ids, ref[0, len(prompt):].tolist()
        split = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        if split is not None:  # two correct fp32 runs may only part at a near-tie
            top2 = dense_forward(model, torch.tensor([prompt + ours[:split]]))[0, -1].topk(2).values
            assert (top2[0] - top2[1]).item() < 2e-4, f"parted at token {split}"
        assert len(ours) == 8
    engine.check_drained()


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_1])
def test_a_block_quantised_file_runs_packed_with_its_fp32_dequantised_logits(gguf_pair, tmp_path, qtype):
    """Every architecture's linears (and tied head) stored in a block type run from their blocks,
    as close to the same file dequantised to fp32 as the compute dtype allows."""
    variant, hf, _ = gguf_pair
    path = write_converted_gguf(tmp_path / "q.gguf", hf, variant, quantize=qtype)
    reference, _ = load_model(str(path), weights=WeightPlan("fp32"))
    plan = WeightPlan("int4", int8_head=True)
    model, _ = load_model(str(path), weights=plan)
    packed = {name for name, m in model.named_modules() if isinstance(m, GroupLinear)}
    assert {f"layers.{i}.{p}" for i in range(len(model.layers))
            for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj")} <= packed
    assert "packed" in model.weight_types[qtype.name].split("+")  # an untied embedding is read dense
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dense_forward(reference, ids)[0].float()
        got = dense_forward(model, ids)[0].float()
        bound = dequantised_logits_bound(path, plan, want, ids)
    assert (got - want).abs().max() <= bound


# --- files the model code cannot run are refused at load, saying what is missing ---------------

@pytest.mark.parametrize(("edit", "message"), [
    (lambda w: w.add_attn_logit_softcapping(50.0), "attention logit soft-capping (gemma3.attn_logit_softcapping)"),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), w.add_rope_scaling_factor(4.0)),
     "rope scaling type 'longrope' is not supported"),
])
def test_a_gemma3_file_the_model_cannot_run_is_refused(tmp_path, edit, message):
    hf = make_hf_model("gemma3", **GGUF_OVERRIDES["gemma3"])
    path = write_converted_gguf(tmp_path / "bad.gguf", hf, "gemma3", edit=edit)
    with pytest.raises(ModelLoadError, match="bad.gguf") as info:
        load_model(str(path))
    assert message in str(info.value)


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gemma2.gguf"), "gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gemma2' \(supported: llama, qwen2, qwen3, "
                                             r"gemma3, qwen3moe, qwen2moe, gpt-oss\)"):
        load_model(str(tmp_path / "gemma2.gguf"))


def test_the_cli_generates_from_a_gemma3_file_with_a_sentencepiece_vocabulary(tmp_path, capsys):
    """`nanoserve generate --model file.gguf --chat` on a Gemma 3 file as published: a
    SentencePiece vocabulary, a chat template, the default (packed) weights."""
    from arch_models import spm_metadata

    from nanoserve.launch import main

    vocabulary = spm_metadata(add_space_prefix=False)
    hf = make_hf_model("gemma3", vocab_size=len(vocabulary["tokenizer.ggml.tokens"]), **GGUF_OVERRIDES["gemma3"])
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
                "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    path = write_converted_gguf(tmp_path / "gemma3.gguf", hf, "gemma3", chat_template=template, vocabulary=vocabulary)
    assert main(["generate", "--model", str(path), "--chat", "--max-tokens", "5", "hello world"]) == 0
    assert "new tokens" in capsys.readouterr().err


def test_a_chat_turns_end_token_stops_generation_besides_the_files_eos(tmp_path):
    """An instruct Gemma 3 file's eos is <eos>; its turns end in <end_of_turn>, which stops
    generation too (as in llama.cpp)."""
    from arch_models import spm_metadata

    vocabulary = spm_metadata(add_space_prefix=False)
    hf = make_hf_model("gemma3", vocab_size=len(vocabulary["tokenizer.ggml.tokens"]), **GGUF_OVERRIDES["gemma3"])
    path = write_converted_gguf(tmp_path / "gemma3.gguf", hf, "gemma3", vocabulary=vocabulary)
    config = GGUFCheckpoint.open(path).config()
    end_of_turn = vocabulary["tokenizer.ggml.tokens"].index("<end_of_turn>")
    assert config.eos_token_ids == (2, end_of_turn)
