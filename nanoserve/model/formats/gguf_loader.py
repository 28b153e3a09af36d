"""GGUF files (llama.cpp's format): metadata into a ModelConfig, tensors dequantised into HF naming."""

from __future__ import annotations

import functools
import mmap
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.network.architectures import (
    ARCHITECTURES,
    DENSE_LAYER_TENSORS,
    GGUF_ARCHITECTURES,
    GLOBAL_TENSORS,
    Architecture,
    architecture,
    gguf_architecture,
)
from nanoserve.model.network.config import ModelConfig
from nanoserve.model.network.llama import hf_norm_offset
from nanoserve.model.quant.gguf_blocks import PACKED_TYPES, BlockTensor, ExpertBlocks
from nanoserve.model.quant.group_codes import GroupCodes

Q = GGMLQuantizationType
# Tensor types we load: the float types (dequantised through gguf.quants, run dense or rounded
# as the weight plan says) and the block types that run packed from their own blocks
# (gguf_blocks, the low-bit Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 among them; their fp32
# dequantisation is the exact reference). The sizes of each are gguf's GGML_QUANT_SIZES: gguf's
# reader refuses a row that is no whole number of blocks, and _check_extents a cut-short tensor.
SUPPORTED_TENSOR_TYPES = frozenset({Q.F32, Q.F16, Q.BF16} | PACKED_TYPES)
# general.architecture values we run (Mistral's files are "llama"; a llama file with experts is
# Mixtral-style): architectures.py holds each one's record.
SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES
# The dense layers' GGUF -> HF names, and the global tensors' (architectures.py).
GGUF_LAYER_TENSORS = DENSE_LAYER_TENSORS
GGUF_GLOBAL_TENSORS = GLOBAL_TENSORS
# gate and up experts in one tensor [experts, 2 * width, hidden]: read as the two HF tensors.
MERGED_GATE_UP = "ffn_gate_up_exps.weight"
MERGED_GATE_UP_BIAS = "ffn_gate_up_exps.bias"  # gpt-oss's biases of it [experts, 2 * width]: gate's, then up's
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Llama 3.x files carry their rope scaling as per-frequency divisors in this tensor.
ROPE_FREQS = "rope_freqs.weight"
# What llama.cpp assumes for Gemma 3 where the file is silent: every sixth layer global, and the
# sliding layers' rope base.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Chat turn ends that stop generation besides the file's eos, as llama.cpp's vocabulary does:
# an instruct Gemma 3 file's eos is <eos>, but its turns end in <end_of_turn>.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|return|>", "<|call|>")  # the last two: harmony (gpt-oss)
CONTROL_TYPES = (3, 4)  # tokenizer.ggml.token_type: control, user-defined


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its map once per metadata item; np.memmap's Python-level __getitem__ and
    __array_finalize__ made that ~5 s for a 49k-token vocabulary. A plain view reads the same
    bytes (the map stays alive as the view's base) about 5x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)
        self._map = getattr(value, "_mmap", None)

    def release_pages(self) -> None:
        """Let the kernel drop the file's pages from this process (they stay in the page cache):
        a tensor read once and packed need not stay resident beside its packed copy."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self._map is not None and advice is not None:
            self._map.madvise(advice)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        # Every read goes through here: a read past the end means the file was cut short.
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > self._plain_data.size:
            raise _Truncated(end, self._plain_data.size)
        return super()._get(offset, dtype, count, override_order)


    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """gguf's parts of a metadata value, an array of scalars or strings read in one pass
        instead of one call per element (a vocabulary's 100k strings took most of a second)."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, itype][:1 + bool(count)]  # gguf names the item type only when there is one
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + values.nbytes, [raw_itype, alen, *(values[i:i + 1] for i in range(count))], \
                list(range(2, 2 + count)), types
        if itype != GGUFValueType.STRING:  # arrays of arrays: gguf's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        data, parts = self._plain_data, [raw_itype, alen]
        raw = memoryview(data)
        for _ in range(count):
            if offs + 8 > data.size:
                raise _Truncated(offs + 8, data.size)
            end = offs + 8 + int.from_bytes(raw[offs:offs + 8], "little")
            if end > data.size:
                raise _Truncated(end, data.size)
            parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:end])
            offs = end
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types


class _Truncated(Exception):
    def __init__(self, needed: int, size: int) -> None:
        super().__init__(f"truncated: the file needs at least {needed} bytes but has {size}")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of architecture ``arch`` (ModelConfig.architecture), or None
    when we do not know it."""
    if gguf_name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[gguf_name]
    layer_tensors = ARCHITECTURES.get(arch, ARCHITECTURES["llama"]).layer_tensors
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in layer_tensors:
        return f"model.layers.{m.group(1)}.{layer_tensors[m.group(2)]}"
    return None


def _hf_names(gguf_name: str, arch: str) -> list[tuple[str, slice | None]]:
    """The HF tensors one GGUF tensor holds, each with the rows (within an expert) it takes: a
    merged gate-up expert tensor is two."""
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) == MERGED_GATE_UP and ARCHITECTURES.get(arch, ARCHITECTURES["llama"]).experts:
        return [(f"model.layers.{m.group(1)}.mlp.experts.{part}_proj", None) for part in ("gate", "up")]
    if m and m.group(2) == MERGED_GATE_UP_BIAS and ARCHITECTURES.get(arch, ARCHITECTURES["llama"]).expert_bias:
        return [(f"model.layers.{m.group(1)}.mlp.experts.{part}_bias", None) for part in ("gate", "up")]
    name = hf_tensor_name(gguf_name, arch)
    return [] if name is None else [(name, None)]


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the half-split rotary layout (HF) to
    interleaved pairs, i.e. row (h, j, r) -> (h, r, j) for r in {0, 1}; this swaps them back.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its metadata and tensor table (the tensors stay memory-mapped)."""

    path: Path
    reader: GGUFReader
    metadata: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """Open and validate a GGUF file; FileNotFoundError if absent, ModelLoadError if unusable."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: GGUF file not found")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(path, "not a GGUF file (the first 4 bytes are not 'GGUF')")
        try:
            reader = _PlainArrayReader(path, "r")
            metadata = _read_metadata(reader)  # strings are decoded here: bad UTF-8 fails here
        except _Truncated as e:
            raise ModelLoadError(path, str(e)) from e
        except Exception as e:  # the reader has no error type of its own
            raise ModelLoadError(path, f"corrupt GGUF file, the reader failed: {e}") from e
        ckpt = cls(path, reader, metadata)
        ckpt._check_extents()
        return ckpt

    def _check_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = t.data_offset + t.n_bytes
            if end > size or t.data.nbytes != t.n_bytes:
                raise ModelLoadError(
                    self.path, f"truncated: tensor {t.name} needs bytes up to {end} but the file has {size}"
                )

    @property
    def architecture(self) -> str:
        """general.architecture as the file says it (the metadata keys' prefix)."""
        return str(self.metadata.get("general.architecture", "<missing>"))

    @functools.cached_property
    def record(self) -> Architecture | None:
        """The architecture record the file is run as (None: not one nanoserve runs)."""
        experts = self.metadata.get(f"{self.architecture}.expert_count", 0)
        return gguf_architecture(self.architecture, int(experts) if isinstance(experts, (int, np.integer)) else 0)

    @property
    def model_architecture(self) -> str:
        """ModelConfig.architecture of the file ("mixtral" for a llama file with experts)."""
        return self.record.name if self.record is not None else self.architecture

    def config(self) -> ModelConfig:
        """The ModelConfig the metadata describes; ModelLoadError when unsupported or incomplete."""
        arch = self.architecture
        if self.record is None:
            raise ModelLoadError(
                self.path,
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
            )
        try:
            return self._config(arch)
        except KeyError as e:
            raise ModelLoadError(self.path, f"missing metadata key {e.args[0]!r}") from e
        except ValueError as e:
            raise ModelLoadError(self.path, str(e)) from e

    def _expert_fields(self, arch: str) -> dict[str, Any]:
        """llama.cpp's expert keys: the count, how many a token uses, their width (Mixtral's is
        the feed-forward length), the shared expert's, and whether the top-k weights are
        renormalised (expert_weights_norm; where the file is silent, the record's default)."""
        md, record = self.metadata, self.record
        names = {t.name for t in self.reader.tensors}
        sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(int(md[f"{arch}.block_count"])))
        width = md.get(f"{arch}.expert_feed_forward_length", md.get(f"{arch}.feed_forward_length"))
        if width is None:
            raise KeyError(f"{arch}.expert_feed_forward_length")
        return dict(
            num_experts=int(md[f"{arch}.expert_count"]),
            num_experts_per_tok=int(md[f"{arch}.expert_used_count"]),
            moe_intermediate_size=int(width),
            norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", record.norm_topk_prob)),
            shared_expert_intermediate_size=int(md.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0)
            if record.shared_expert else 0,
            sparse_layers=() if all(sparse) else sparse,
        )

    def _config(self, arch: str) -> ModelConfig:
        md = self.metadata
        names = {t.name for t in self.reader.tensors}
        heads = int(md[f"{arch}.attention.head_count"])
        hidden = int(md[f"{arch}.embedding_length"])
        head_dim = int(md.get(f"{arch}.attention.key_length", md.get(f"{arch}.rope.dimension_count", hidden // heads)))
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
        if md.get(f"{arch}.attn_logit_softcapping") is not None:
            raise ValueError(f"attention logit soft-capping ({arch}.attn_logit_softcapping) is not supported")
        fields = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(md[f"{arch}.feed_forward_length"]),
            num_layers=int(md[f"{arch}.block_count"]),
            num_heads=heads,
            num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(arch),
            rms_norm_eps=float(md[f"{arch}.attention.layer_norm_rms_epsilon"]),
            max_position_embeddings=int(md.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            attention_out_bias="blk.0.attn_output.bias" in names,
            bos_token_id=_optional_int(md.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_optional_int(md.get("tokenizer.ggml.eos_token_id")),
            pad_token_id=_optional_int(md.get("tokenizer.ggml.padding_token_id")),
            architecture=self.record.name,
            extra_eos_token_ids=self._end_of_turn_ids(),
            qk_norm="blk.0.attn_q_norm.weight" in names,
            final_logit_softcapping=_optional_float(md.get(f"{arch}.final_logit_softcapping")),
        )
        if arch == "gemma3":
            fields.update(self._gemma3_fields(fields["num_layers"], hidden, heads, head_dim))
        if self.record.experts:
            fields.update(self._expert_fields(arch))
        if self.record.name == "gptoss":
            fields.update(self._gpt_oss_fields(arch, fields["num_layers"], names))
        return ModelConfig(**fields)

    def _gpt_oss_fields(self, arch: str, layers: int, names: set[str]) -> dict[str, Any]:
        """What llama.cpp reads or assumes for gpt-oss: the window on every other layer from the
        first, each head's sink, biased router and experts, the experts' clamped SwiGLU."""
        md = self.metadata
        return dict(
            sliding_window=int(md[f"{arch}.attention.sliding_window"]),
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)),
            attention_sinks="blk.0.attn_sinks.weight" in names,
            expert_bias=self.record.expert_bias,
            swiglu_limit=self.record.swiglu_limit,
        )

    def _end_of_turn_ids(self) -> tuple[int, ...]:
        """tokenizer.ggml.eot_token_id, and the END_OF_TURN_TOKENS the vocabulary marks control."""
        md = self.metadata
        ids = [] if md.get("tokenizer.ggml.eot_token_id") is None else [int(md["tokenizer.ggml.eot_token_id"])]
        tokens, types = md.get("tokenizer.ggml.tokens", ()), md.get("tokenizer.ggml.token_type", ())
        ids += [i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in CONTROL_TYPES and tok in END_OF_TURN_TOKENS]
        return tuple(dict.fromkeys(ids))

    def _gemma3_fields(self, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        """What llama.cpp's Gemma 3 reads or assumes: the window and its layer pattern, the
        local rope base, and the score scale (1/sqrt(hidden / heads) for the 62-layer 27B, whose
        query_pre_attn_scalar that is; 1/sqrt(head_dim), the others', elsewhere)."""
        md = self.metadata
        pattern = md.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, (list, tuple)):
            sliding = [bool(x) for x in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
        scale = md.get("gemma3.attention.scale")
        scalar = scale ** -2 if scale is not None else (hidden / heads if layers == 62 else head_dim)
        return dict(
            hidden_act="gelu_pytorch_tanh", sandwich_norms=True, scale_embeddings=True,
            query_pre_attn_scalar=float(scalar), sliding_window=int(md["gemma3.attention.sliding_window"]),
            layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
            rope_local_theta=float(md.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        )

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        kind = self.metadata.get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.metadata[f"{arch}.rope.scaling.factor"])}
        if kind == "yarn":  # transformers' parameters; truncation as the record says (the file is silent)
            md = self.metadata
            return {"rope_type": "yarn", "factor": float(md[f"{arch}.rope.scaling.factor"]),
                    "original_max_position_embeddings": int(md[f"{arch}.rope.scaling.original_context_length"]),
                    "beta_fast": float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    "beta_slow": float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                    "truncate": self.record.yarn_truncate}
        if kind not in ("none", ""):
            raise ModelLoadError(self.path, f"rope scaling type {kind!r} is not supported")
        freqs = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is not None:
            factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
            return {"rope_type": "freq_factors", "factors": tuple(float(x) for x in factors)}
        return None

    def state_dict(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every weight, dequantised and converted to `dtype`, in HF naming and HF row order."""
        return {name: self.read(name, config, dtype) for name in self._weights}

    def group_codes(self, config: ModelConfig) -> dict[str, GroupCodes]:
        """Every block-quantised 2-D tensor as its own codes, scales and minimums (gguf_blocks),
        in HF naming and row order: nothing rounded."""
        return {name: blocks.group_codes() for name, blocks in self.block_tensors(config).items()
                if isinstance(blocks, BlockTensor)}

    def block_tensors(self, config: ModelConfig) -> dict[str, BlockTensor | ExpertBlocks]:
        """Every block-quantised tensor as it lies in the file (views of the map, nothing read
        yet), in HF naming, its rows in HF order (``row_order`` undoes llama's Q/K permutation);
        an expert tensor as one BlockTensor per expert."""
        out: dict[str, BlockTensor | ExpertBlocks] = {}
        for name, (t, rows) in self._weights.items():
            if t.tensor_type not in PACKED_TYPES:
                continue
            shape = self._shape(t, rows)
            if len(shape) == 3:
                data = t.data if rows is None else t.data[:, rows]
                out[name] = ExpertBlocks(tuple(BlockTensor(t.tensor_type, data[e], *shape[1:])
                                               for e in range(shape[0])))
                continue
            n, k = shape
            order = None
            if _permuted(config, t.name):
                heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
                order = np.ascontiguousarray(unpermute_rotary_rows(np.arange(n), heads))
            out[name] = BlockTensor(t.tensor_type, t.data, n, k, order)
        return out

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape by HF name: [out, in], an expert tensor [experts, out, in]."""
        return {name: self._shape(t, rows) for name, (t, rows) in self._weights.items()}

    @staticmethod
    def _shape(t: Any, rows: slice | None) -> tuple[int, ...]:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        if rows is not None and t.name.endswith(MERGED_GATE_UP_BIAS):
            return (*shape[:-1], len(range(shape[-1])[rows]))
        if rows is not None:
            shape = (*shape[:-2], len(range(shape[-2])[rows]), shape[-1])
        if t.name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:
            shape = (1, *shape)  # the shared expert's gate: HF's [1, hidden] linear
        return shape

    def read(self, name: str, config: ModelConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor by HF name, dequantised to ``dtype`` in HF row order (a norm as HF holds it)."""
        t, rows = self._weights[name]
        weight = torch.from_numpy(self._dequantize(t, config))
        if rows is not None and t.name.endswith(MERGED_GATE_UP_BIAS):
            weight = weight[..., rows].contiguous()
        elif rows is not None:
            weight = weight[..., rows, :].contiguous()
        weight = weight.reshape(self._shape(t, rows))
        if name.endswith("norm.weight"):
            weight -= hf_norm_offset(config)  # the file holds the multiplier itself (1 + w for Gemma)
        return weight.to(dtype)

    @functools.cached_property
    def _weights(self) -> dict[str, tuple[Any, slice | None]]:
        """The file's weight tensors by HF name, each with the rows within an expert it takes (a
        merged gate-up expert tensor serves two names; the rope frequencies are config)."""
        by_name = {}
        arch = self.model_architecture
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:
                continue
            names = _hf_names(t.name, arch)
            if not names:
                raise ModelLoadError(self.path, f"unexpected tensor {t.name!r} for architecture {self.architecture}")
            self._check_type(t)
            if len(names) == 2:  # [experts, 2 * width, hidden]: gate's rows, then up's (a bias: its columns)
                width = int(t.shape[0 if t.name.endswith(MERGED_GATE_UP_BIAS) else 1]) // 2
                names = [(names[0][0], slice(0, width)), (names[1][0], slice(width, 2 * width))]
            by_name.update({name: (t, rows) for name, rows in names})
        return by_name

    def tensor_types(self) -> dict[str, str]:
        """Each tensor's type name ("Q4_K", "F32"...) by HF name."""
        return {name: t.tensor_type.name for name, (t, _) in self._weights.items()}

    def _check_type(self, t: Any) -> None:
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                self.path, f"tensor {t.name} has unsupported quantisation type {t.tensor_type.name} "
                           f"(supported: {supported})"
            )

    def _dequantize(self, t: Any, config: ModelConfig) -> np.ndarray:
        self._check_type(t)
        shape = self._shape(t, None)
        # np.array copies: F32 tensors would otherwise alias the read-only memory map.
        weight = np.array(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32)
        if _permuted(config, t.name):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            weight = unpermute_rotary_rows(weight, heads)
        return weight


def _permuted(config: ModelConfig, gguf_name: str) -> bool:
    """Only the llama converter permutes Q/K rows (for its interleaved rope; Architecture.permuted_qk);
    the others' files are in HF order."""
    return architecture(config.architecture).permuted_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name)


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
