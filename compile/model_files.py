"""Llama-shaped GGUF files of the sizes people run, with random weights, for measuring load time,
memory and decode speed where the weights no longer fit in a cache.

No such file ships on PyPI, and speed, memory and load time depend on a file's shapes and block
types, not on what its weights learned. So the blocks are written directly: random codes, and
scales drawn so that each weight is small (|w| ~ 0.02, as trained weights are), in llama.cpp's
layouts, with the tensor types llama.cpp's quantiser picks for that file type (``tensor_types``:
Q4_K_M's Q6_K on its "more bits" layers, Q3_K_M's Q4_K / Q5_K, IQ4_XS's Q5_K; a tied embedding
as the output). ``F32`` writes the matrices as random floats instead: the unquantised file
llama.cpp's quantiser starts from, which the tests quantise to check ``tensor_types``.
The vocabulary, tokenizer and chat template are the packaged SmolLM2 file's (49,152 tokens).
Writing one is a pass of random bytes: seconds for a 1B file, about a minute for an 8B one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    RopeScalingType,
)

from nanoserve.model_path import default_model_path

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """A Llama model's shape: hidden width, layers, query and K/V heads, MLP width, and whether the
    LM head is the embedding (tied). A mixture of experts (``experts`` > 0) has in each layer
    ``experts`` experts of width ``expert_ffn``, ``experts_used`` a token, and a router, in place
    of the dense MLP; ``arch`` is its GGUF architecture (a llama file with experts is
    Mixtral-style; qwen3moe adds per-head q/k norms); ``head_dim`` where it is not
    hidden / heads."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    vocab: int = 49152
    context: int = 8192
    arch: str = "llama"
    head_dim: int | None = None
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


# Llama 3.2 1B and 3B, Llama 3.1 8B (with SmolLM2's vocabulary), and the 1B's layers cut to 6
# (a few hundred MB: too big for a test to hide a float copy, small enough to write in seconds).
SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, tied=True),
    "3b": Shape(3072, 28, 24, 8, 8192, tied=True),
    "8b": Shape(4096, 32, 32, 8, 14336, tied=False),
    "mid": Shape(2048, 6, 32, 8, 8192, tied=True),
    # Qwen3-30B-A3B (48 layers, 2048 wide, 32/4 heads of 128, 128 experts of 768, 8 used) with
    # SmolLM2's vocabulary: ~0.3 GB under the real file's 151,936-token embedding and head.
    "30b-a3b": Shape(2048, 48, 32, 4, 6144, tied=False, arch="qwen3moe", head_dim=128, experts=128,
                     experts_used=8, expert_ffn=768, context=40960),
    # gpt-oss-20b (24 layers, 2880 wide, 64/8 heads of 64, 32 experts of 2880, 4 used; sinks,
    # biases, every other layer a 128-token window, YaRN), its experts MXFP4 as every gpt-oss GGUF.
    "gpt-oss-20b": Shape(2880, 24, 64, 8, 2880, tied=False, arch="gpt-oss", head_dim=64, experts=32,
                         experts_used=4, expert_ffn=2880, context=131072),
    # A small Mixtral-style file (a llama GGUF with experts): 8 experts of 5632, 2 used, 8 layers.
    "moe-small": Shape(2048, 8, 32, 8, 5632, tied=True, experts=8, experts_used=2, expert_ffn=5632),
}
# MXFP4_MOE: gpt-oss's experts MXFP4, everything else Q8_0 (as the gpt-oss GGUFs people download).
FILE_TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "MXFP4_MOE", "IQ4_XS", "Q3_K_M")
# Each file type's type for a matrix no rule of llama.cpp's quantiser singles out.
BODY_TYPES = {"Q4_0": Q.Q4_0, "Q4_K_M": Q.Q4_K, "Q8_0": Q.Q8_0, "MXFP4_MOE": Q.Q8_0, "IQ4_XS": Q.IQ4_XS,
              "Q3_K_M": Q.Q3_K, "F32": Q.F32}
# llama.cpp's fallback for a row its type's 256-weight super-blocks cannot hold (llama-quant.cpp's
# tensor_type_fallback): a 32-weight type.
FALLBACK_TYPES = {Q.IQ4_XS: Q.IQ4_NL, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1,
                  Q.Q6_K: Q.Q8_0}


MLP_PARTS = ("ffn_gate", "ffn_up", "ffn_down")
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def tensor_types(shape: Shape, file_type: str) -> dict[str, Q]:
    """Each tensor's type as llama.cpp's quantiser chooses it for ``file_type`` without an
    importance matrix (llama-quant.cpp's llama_tensor_get_type, for a llama-like architecture;
    norms and routers are F32, written apart):

    - the output, or a tied embedding: Q6_K (Q8_0 for Q8_0 and MXFP4_MOE, or a row not a multiple
      of 256); an untied embedding: the body type;
    - Q4_K_M: attn_v and ffn_down Q6_K on the "more bits" layers (the first and last eighth,
      every third between);
    - Q3_K_M: attn_v Q5_K on the first two layers, Q4_K after; attn_output Q4_K; ffn_down Q5_K on
      the first sixteenth of the layers, Q4_K after; attn_q, attn_k, ffn_gate and ffn_up Q3_K;
    - IQ4_XS: attn_v Q5_K when 4 or more query heads share a K/V head; ffn_down Q5_K on the
      first eighth of the layers; the rest IQ4_XS;
    - with 8 experts (Mixtral's rules), in Q3_K_M and IQ4_XS: attn_v and attn_k Q8_0, attn_output
      Q5_K (llama.cpp's Q4_K_M has them too; this module's Q4_K_M files keep the layout their
      recorded figures ran);
    - a row whose width is not a multiple of a 256-weight type's super-block falls back to a
      32-weight type (FALLBACK_TYPES)."""
    body = BODY_TYPES[file_type]
    head = Q.Q8_0 if file_type in ("Q8_0", "MXFP4_MOE") or shape.hidden % 256 else Q.Q6_K
    if file_type == "F32":
        head = Q.F32
    types = {"token_embd.weight": head if shape.tied else body}
    if not shape.tied:
        types["output.weight"] = head
    n = shape.layers
    eight_experts = shape.experts == 8 and file_type in ("Q3_K_M", "IQ4_XS")
    for i in range(n):
        more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", *(EXPERT_PARTS if shape.experts else MLP_PARTS)):
            kind = body
            down = part in ("ffn_down", "ffn_down_exps")
            if file_type == "Q4_K_M" and (part == "attn_v" or down) and more_bits:
                kind = Q.Q6_K
            elif file_type == "Q3_K_M" and part == "attn_v":
                kind = Q.Q5_K if i < 2 else Q.Q4_K
            elif file_type == "Q3_K_M" and part == "attn_output":
                kind = Q.Q4_K
            elif file_type == "Q3_K_M" and down:
                kind = Q.Q5_K if i < n // 16 else Q.Q4_K
            elif file_type == "IQ4_XS" and part == "attn_v" and shape.heads // shape.kv_heads >= 4:
                kind = Q.Q5_K
            elif file_type == "IQ4_XS" and down and i < n // 8:
                kind = Q.Q5_K
            if eight_experts and part in ("attn_v", "attn_k"):
                kind = Q.Q8_0
            elif eight_experts and part == "attn_output":
                kind = Q.Q5_K
            if file_type == "MXFP4_MOE" and part in EXPERT_PARTS:
                kind = Q.MXFP4
            types[f"blk.{i}.{part}.weight"] = kind
    shapes = tensor_shapes(shape)
    for name, kind in types.items():
        if kind in FALLBACK_TYPES and shapes[name][-1] % GGML_QUANT_SIZES[kind][0]:
            types[name] = FALLBACK_TYPES[kind]
    return types


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Each block-quantised weight's [out, in] shape by GGUF name ([experts, out, in] for an
    expert tensor)."""
    head_dim = shape.head_size
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    out = {"token_embd.weight": (shape.vocab, shape.hidden)}
    if not shape.tied:
        out["output.weight"] = (shape.vocab, shape.hidden)
    for i in range(shape.layers):
        out |= {f"blk.{i}.attn_q.weight": (q, shape.hidden), f"blk.{i}.attn_k.weight": (kv, shape.hidden),
                f"blk.{i}.attn_v.weight": (kv, shape.hidden), f"blk.{i}.attn_output.weight": (shape.hidden, q)}
        if shape.experts:
            e, width = shape.experts, shape.expert_ffn
            out |= {f"blk.{i}.ffn_gate_exps.weight": (e, width, shape.hidden),
                    f"blk.{i}.ffn_up_exps.weight": (e, width, shape.hidden),
                    f"blk.{i}.ffn_down_exps.weight": (e, shape.hidden, width)}
        else:
            out |= {f"blk.{i}.ffn_gate.weight": (shape.ffn, shape.hidden),
                    f"blk.{i}.ffn_up.weight": (shape.ffn, shape.hidden),
                    f"blk.{i}.ffn_down.weight": (shape.hidden, shape.ffn)}
    return out


def float_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The F32 tensors by GGUF name: the norms (ones), a qwen3moe file's per-head q/k norms, and
    each expert layer's router [experts, hidden]."""
    out = {"output_norm.weight": (shape.hidden,)}
    q, kv = shape.heads * shape.head_size, shape.kv_heads * shape.head_size
    for i in range(shape.layers):
        if shape.arch == "gpt-oss":  # biases everywhere, a sink per head, the MLP's pre-norm post_attention_norm
            out |= {f"blk.{i}.attn_norm.weight": (shape.hidden,), f"blk.{i}.post_attention_norm.weight": (shape.hidden,),
                    f"blk.{i}.attn_q.bias": (q,), f"blk.{i}.attn_k.bias": (kv,), f"blk.{i}.attn_v.bias": (kv,),
                    f"blk.{i}.attn_output.bias": (shape.hidden,), f"blk.{i}.attn_sinks.weight": (shape.heads,),
                    f"blk.{i}.ffn_gate_inp.weight": (shape.experts, shape.hidden),
                    f"blk.{i}.ffn_gate_inp.bias": (shape.experts,),
                    f"blk.{i}.ffn_gate_exps.bias": (shape.experts, shape.expert_ffn),
                    f"blk.{i}.ffn_up_exps.bias": (shape.experts, shape.expert_ffn),
                    f"blk.{i}.ffn_down_exps.bias": (shape.experts, shape.hidden)}
            continue
        out |= {f"blk.{i}.attn_norm.weight": (shape.hidden,), f"blk.{i}.ffn_norm.weight": (shape.hidden,)}
        if shape.arch == "qwen3moe":
            out |= {f"blk.{i}.attn_q_norm.weight": (shape.head_size,), f"blk.{i}.attn_k_norm.weight": (shape.head_size,)}
        if shape.experts:
            out[f"blk.{i}.ffn_gate_inp.weight"] = (shape.experts, shape.hidden)
    return out


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks [rows, row bytes] of ``qtype`` whose weights are about 0.02 in size: random
    codes, and each block's fp16 scale (and minimum) set so (F32: the weights themselves)."""
    if qtype == Q.F32:
        return rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32).view(np.uint8)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    count = rows * (cols // block_weights)
    blocks = np.frombuffer(rng.bytes(count * block_bytes), dtype=np.uint8).reshape(count, block_bytes).copy()

    def fp16(at: int, scale: float) -> None:
        values = (scale * (0.5 + rng.random(count, dtype=np.float32))).astype(np.float16)
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(count, 2)

    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        fp16(0, 0.004)  # d; codes - 8 in -8..7
        if qtype in (Q.Q4_1, Q.Q5_1):
            fp16(2, -0.03)  # m
    elif qtype == Q.Q8_0:
        fp16(0, 0.0002)  # d times codes in -128..127
    elif qtype in (Q.Q4_K, Q.Q5_K):
        fp16(0, 0.0001)  # d, times 6-bit scales and 4-bit codes
        fp16(2, 0.00075)  # dmin, times 6-bit minimums: centres the weights near zero
    elif qtype == Q.Q6_K:
        blocks[:, 192:208] = (rng.integers(-16, 16, (count, 16))).astype(np.int8).view(np.uint8)
        fp16(208, 0.0001)  # d times int8 scales times codes - 32
    elif qtype == Q.Q2_K:
        fp16(80, 0.002)  # d, times 4-bit scales and 2-bit codes
        fp16(82, 0.003)  # dmin, times 4-bit minimums
    elif qtype == Q.Q3_K:
        fp16(108, 0.0005)  # d times 6-bit scales - 32 times codes - 4
    elif qtype == Q.IQ4_NL:
        fp16(0, 0.0003)  # d times the table's values, -127..113
    elif qtype == Q.IQ4_XS:
        fp16(0, 0.00002)  # d times 6-bit scales - 32 times the table's values
    elif qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(119, 123, count)  # 2^(e - 128) times values up to 12
    return blocks.reshape(rows, -1)


def write_model(path: Path, shape: Shape, file_type: str, seed: int = 0) -> Path:
    """Write a random-weight Llama GGUF of ``shape`` and ``file_type`` (FILE_TYPES) to ``path``,
    one tensor at a time (the writer never holds the whole model)."""
    rng = np.random.default_rng(seed)
    source = GGUFReader(default_model_path())
    writer = GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers} {file_type}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    mixtral = shape.experts and shape.arch == "llama"  # its experts are feed_forward_length wide
    writer.add_feed_forward_length(shape.expert_ffn if mixtral else shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_size)
    writer.add_value_length(shape.head_size)
    writer.add_rope_dimension_count(shape.head_size)
    writer.add_rope_freq_base(150000.0 if shape.arch == "gpt-oss" else 500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        if not mixtral:
            writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.arch == "gpt-oss":
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    _copy_tokenizer(source, writer)
    types, shapes, floats = tensor_types(shape, file_type), tensor_shapes(shape), float_tensors(shape)
    for name, dims in floats.items():
        writer.add_tensor_info(name, list(dims), np.dtype(np.float32), int(np.prod(dims)) * 4)
    for name, dims in shapes.items():
        block_weights, block_bytes = GGML_QUANT_SIZES[types[name]]
        row_bytes = dims[-1] // block_weights * block_bytes  # the writer takes a block tensor's shape in bytes
        writer.add_tensor_info(name, [*dims[:-1], row_bytes], np.dtype(np.uint8), int(np.prod(dims[:-1])) * row_bytes,
                               raw_dtype=types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in floats.items():
        norm = name.endswith("norm.weight")  # ones; routers, biases and sinks small random numbers
        writer.write_tensor_data(np.ones(dims, dtype=np.float32) if norm
                                 else rng.normal(0.0, 0.02, dims).astype(np.float32))
    for name, dims in shapes.items():
        rows = int(np.prod(dims[:-1]))
        writer.write_tensor_data(random_blocks(types[name], rows, dims[-1], rng).reshape(*dims[:-1], -1))
    writer.close()
    return path


def _copy_tokenizer(source: GGUFReader, writer: GGUFWriter) -> None:
    """Every tokenizer.* key of the packaged SmolLM2 file, its vocabulary and chat template."""
    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, kind)


def model_file(directory: Path, size: str, file_type: str) -> Path:
    """The random file of ``size`` (SHAPES) and ``file_type`` in ``directory``, written once."""
    path = directory / f"random-{SHAPES[size].arch}-{size}-{file_type}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_model(partial, SHAPES[size], file_type)
        partial.rename(path)
    return path
