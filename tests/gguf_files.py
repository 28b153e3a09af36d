"""A tiny GGUF file as an editable description (metadata fields and tensors), for tests that
plant one broken or hostile detail and for the model-file fuzzer.

The model is a 2-layer Llama with a byte-level BPE vocabulary that has real merges, ChatML
control tokens and a ChatML chat template, so the tokenizer, template and merge checks all
have something to check; its weights are small enough that a load takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from nanoserve.model.formats.gguf_loader import GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS
from nanoserve.model.network.architectures import EXPERT_LAYER_TENSORS

V = gguf.GGUFValueType
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 2, 1


def _byte_alphabet() -> list[str]:
    from nanoserve.model.formats.tokenizer import _bytes_to_unicode

    return list(_bytes_to_unicode().values())


@dataclass
class GGUFDescription:
    """What a GGUF file holds: its metadata fields (key -> (value, type, array item type))
    and tensors (name -> float32 array in torch's dimension order)."""

    fields: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def set(self, key: str, value: Any, vtype: Any, sub_type: Any = None) -> None:
        self.fields[key] = (value, vtype, sub_type)

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), arch="llama")
        writer.kv_data[0].pop("general.architecture", None)  # written from `fields`, as anything else
        for key, (value, vtype, sub_type) in self.fields.items():
            writer.add_key_value(key, value, vtype, sub_type)
        for name, data in self.tensors.items():
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return Path(path)


EXPERTS, EXPERTS_USED = 4, 2


def tiny_chat_gguf(seed: int = 0, experts: bool = False) -> GGUFDescription:
    """The tiny model's description (see the module docstring); with ``experts`` a Mixtral-style
    file (a llama file with expert_count: a router and 3-D expert tensors in each layer)."""
    rng = np.random.default_rng(seed)
    tokens = _byte_alphabet() + [a + b for a, b in (m.split(" ") for m in MERGES)] + SPECIALS
    vocab = len(tokens)
    d = GGUFDescription()
    arch = "llama"
    d.set("general.architecture", arch, V.STRING)
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("rope.dimension_count", HIDDEN // HEADS)):
        d.set(f"{arch}.{key}", value, V.UINT32)
    d.set(f"{arch}.rope.freq_base", 10000.0, V.FLOAT32)
    d.set(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32)
    d.set("tokenizer.ggml.model", "gpt2", V.STRING)
    d.set("tokenizer.ggml.pre", "default", V.STRING)
    d.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    d.set("tokenizer.ggml.token_type", [1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS), V.ARRAY, V.INT32)
    d.set("tokenizer.ggml.scores", [0.0] * vocab, V.ARRAY, V.FLOAT32)
    d.set("tokenizer.ggml.merges", MERGES, V.ARRAY, V.STRING)
    d.set("tokenizer.ggml.bos_token_id", vocab - 3, V.UINT32)
    d.set("tokenizer.ggml.eos_token_id", vocab - 1, V.UINT32)
    d.set("tokenizer.chat_template", CHATML, V.STRING)
    if experts:
        d.set(f"{arch}.expert_count", EXPERTS, V.UINT32)
        d.set(f"{arch}.expert_used_count", EXPERTS_USED, V.UINT32)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32)

    head_dim = HIDDEN // HEADS
    shapes = {"attn_q.weight": (HIDDEN, HIDDEN), "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "attn_v.weight": (KV_HEADS * head_dim, HIDDEN), "attn_output.weight": (HIDDEN, HIDDEN),
              "ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN), "ffn_down.weight": (HIDDEN, FFN)}
    d.tensors["token_embd.weight"] = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)
    for i in range(LAYERS):
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            d.tensors[f"blk.{i}.{name}"] = np.ones(HIDDEN, dtype=np.float32)
        for name, (rows, cols) in shapes.items():
            if experts and name.startswith("ffn_"):
                d.tensors[f"blk.{i}.{name.replace('.weight', '_exps.weight')}"] = np.stack(
                    [matrix(rows, cols) for _ in range(EXPERTS)])
            else:
                d.tensors[f"blk.{i}.{name}"] = matrix(rows, cols)
        if experts:
            d.tensors[f"blk.{i}.ffn_gate_inp.weight"] = matrix(EXPERTS, HIDDEN)
    d.tensors["output_norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    d.tensors["output.weight"] = matrix(vocab, HIDDEN)
    assert set(GGUF_GLOBAL_TENSORS) >= {"token_embd.weight", "output.weight"}
    known = {**GGUF_LAYER_TENSORS, **EXPERT_LAYER_TENSORS}
    assert all(name.split(".", 2)[2] in known for name in d.tensors if name.startswith("blk."))
    return d
