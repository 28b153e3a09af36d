"""Tiny random models of every supported architecture in transformers' own implementation,
shared by the per-architecture suites (HF directories, GGUF files, the engine)."""

from __future__ import annotations

import torch

VOCAB = 256
WINDOW = 8  # sliding_window of the windowed variants: prompts run well past it
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}

# variant -> (transformers class, config class, config kwargs)
ARCHITECTURES = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(TINY, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(TINY, sliding_window=WINDOW)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(TINY, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})),
    # head_dim 32 while hidden / heads is 16: the head size comes from the config, not the ratio.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(TINY, head_dim=32, tie_word_embeddings=True)),
    # Sliding and full layers interleaved, a global rope with linear scaling beside the local
    # base, a query_pre_attn_scalar that is not head_dim, and a final soft-cap.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        TINY, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=GEMMA3_ROPE, final_logit_softcapping=5.0)),
}
WINDOWED = ("mistral", "gemma3")


def make_hf_model(variant: str, seed: int = 0, **overrides):
    """The variant's transformers model, fp32, eval mode; norms and biases randomised (HF
    initialises them to constants) so that they are tested."""
    import transformers

    model_cls, config_cls, kwargs = ARCHITECTURES[variant]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# --- GGUF files as llama.cpp's converter writes them ---------------------------------------------

GGUF_ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def llama3_rope_factors(rope: dict, head_dim: int) -> list[float]:
    """The per-frequency divisors a Llama 3.x GGUF stores as rope_freqs.weight: 1 for short
    wavelengths, `factor` for long ones, and the smooth interpolation's divisor between."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_converted_gguf(path, hf_model, variant: str, chat_template: str | None = None,
                         vocabulary: dict | None = None, edit=None, quantize=None):
    """`hf_model` as an F32 GGUF the way llama.cpp's converter writes it: gguf's own tensor-name
    map, Q/K rows permuted for the "llama" architecture (its interleaved rope), Gemma's norms
    stored as 1 + w, a Llama 3 rope as rope_freqs factors, and a byte-level vocabulary (or the
    SentencePiece one `vocabulary` describes, see spm_metadata). `edit(writer)` may add keys.
    `quantize` (a gguf block type) stores every matrix whose rows split into its blocks in it,
    through gguf's own quantiser."""
    import gguf
    import numpy as np

    arch = GGUF_ARCH[variant]
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if vocabulary is None:
        _write_byte_vocabulary(writer, c.vocab_size, chat_template)
    else:
        write_spm_vocabulary(writer, vocabulary, chat_template)
    if edit is not None:
        edit(writer)

    names = gguf.get_tensor_name_map(_arch_id(arch), c.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
            data = data.reshape(tensor.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1
        data = data.astype(np.float32)
        block = gguf.GGML_QUANT_SIZES[quantize][0] if quantize is not None else 0
        if block and data.ndim == 2 and data.shape[1] % block == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(name, data)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", np.array(llama3_rope_factors(rope, head_dim), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _arch_id(arch: str):
    import gguf

    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _write_byte_vocabulary(writer, vocab_size: int, chat_template: str | None) -> None:
    from nanoserve.model.formats.tokenizer import _bytes_to_unicode

    tokens = list(_bytes_to_unicode().values())[:vocab_size]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


SPACE = "\u2581"
SPM_PIECES = [SPACE, "e", "t", "h", "a", "o", "l", "r", "s", "n", "w", "d", SPACE + "t", "he", SPACE + "the",
              SPACE + "a", "ll", "ell", "hell", "hello", SPACE + "w", "or", "wor", "ld", "world", SPACE + "world",
              "er", SPACE + "s", "st", SPACE + SPACE, "in", "ing", SPACE + "st"]


def spm_metadata(add_space_prefix: bool) -> dict:
    """A SentencePiece vocabulary laid out as llama.cpp's converter writes one: <unk>, <s>, </s>,
    Gemma's turn markers (control), 256 byte tokens, then pieces best-scored first."""
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def write_spm_vocabulary(writer, metadata: dict, chat_template: str | None = None) -> None:
    """The SentencePiece vocabulary `metadata` describes (spm_metadata), as a GGUF's keys."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(metadata["tokenizer.ggml.add_space_prefix"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def hf_and_ours(variant: str, directory):
    """(transformers model, nanoserve model read back from its saved directory) for `variant`."""
    from nanoserve.model.formats.hf_loader import load_hf_state_dict, read_hf_config
    from nanoserve.model.formats.loader import build_model

    hf = make_hf_model(variant)
    hf.save_pretrained(directory, safe_serialization=True)
    return hf, build_model(read_hf_config(directory), load_hf_state_dict(directory))


def save_bpe_tokenizer(directory, text: str, vocab_size: int, bos: str, eos: str) -> None:
    """A byte-level BPE tokenizer trained on `text`, saved into a HF directory beside its config
    (`tokenizer.json`, and `tokenizer_config.json` naming `bos` and `eos`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator([text] * 10, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[bos, eos]))
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(f'{{"bos_token": "{bos}", "eos_token": "{eos}"}}')
