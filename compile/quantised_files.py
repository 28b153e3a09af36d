"""The default model in llama.cpp's own file types, for fidelity on a multi-type or low-bit file.

No float SmolLM2 ships with the project, so the unquantised model is the packaged Q4_1 GGUF
dequantised into an F32 GGUF (gguf's writer: the same metadata, tokenizer and tensor layout).
llama.cpp's quantiser (``llama_model_quantize`` through llama-cpp-python) turns that file into
each type with its own tensor mix, as anyone downloading a GGUF would get it. A 256-weight
super-block type cannot hold a row of this model's 576 (every linear but ffn_down, and the
tied embedding), so llama.cpp falls back there to a 32-weight type (IQ4_XS to IQ4_NL, Q3_K to
Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0): its "Q3_K_M" file of this model holds no Q3_K
at all, and ``tensor_type_counts`` says what a file holds. ``padded_file`` lays the model out
768 wide, the same function with every row a multiple of 256, so that a file quantised from it
holds each type where llama.cpp's mix puts it. The files are written once under ``MODELS``
(git-ignored) and reused.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from nanoserve.model_path import default_model_path

MODELS = Path(__file__).resolve().parent.parent / "build" / "models"
STEM = "SmolLM2-135M-Instruct"
PADDED_WIDTH = 768  # the next multiple of 256 above the model's 576 that holds its heads in groups
# llama.cpp's file types this module makes, by their usual names -> llama_cpp's ftype constant.
FILE_TYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
              "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
              "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}


def write_f32(source: Path, target: Path) -> None:
    """``source`` with every tensor dequantised to F32 (metadata copied as it is, but the file type)."""
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields, and the one the writer adds itself
        value = 0 if name == "general.file_type" else field.contents()  # 0: all F32
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        writer.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_padded(source: Path, target: Path, width: int = 768) -> None:
    """``source`` (an F32 llama GGUF) laid out ``width`` wide, computing the same function, so that
    every row holds 256-weight super-blocks: the hidden size padded with zeros (the embedding's,
    every input column, the residual writers' output rows), zero query heads added so each K/V
    head keeps its own query heads (a zero head's output meets zero columns of attn_output), the
    norms' weights scaled by sqrt(hidden / width) and the epsilon by hidden / width (an RMS over
    ``width`` values of which ``hidden`` are nonzero)."""
    reader = GGUFReader(source)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    hidden, heads, kv_heads = (int(meta[f"llama.{k}"]) for k in
                               ("embedding_length", "attention.head_count", "attention.head_count_kv"))
    head_dim, group = hidden // heads, heads // kv_heads
    new_heads = width // head_dim
    if width % head_dim or new_heads % kv_heads or new_heads // kv_heads < group:
        raise ValueError(f"{width} wide cannot hold {heads} heads of {head_dim} in {kv_heads} K/V groups")
    new_group = new_heads // kv_heads
    # Each new query head's old head, or -1 for a zero head: the K/V groups keep their heads in order.
    old_head = [g * group + j if j < group else -1 for g in range(kv_heads) for j in range(new_group)]
    shrink = hidden / width

    def head_rows(w: np.ndarray) -> np.ndarray:  # [heads * head_dim, ...] -> [new_heads * head_dim, ...]
        out = np.zeros((new_heads * head_dim, *w.shape[1:]), dtype=np.float32)
        for new, old in enumerate(old_head):
            if old >= 0:
                out[new * head_dim:(new + 1) * head_dim] = w[old * head_dim:(old + 1) * head_dim]
        return out

    def pad_cols(w: np.ndarray) -> np.ndarray:
        return np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, width - w.shape[-1])])

    writer = GGUFWriter(str(target), "llama")
    changed = {"llama.embedding_length": width, "llama.attention.head_count": new_heads,
               "llama.attention.layer_norm_rms_epsilon": float(meta["llama.attention.layer_norm_rms_epsilon"]) * shrink}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, changed.get(name, field.contents()), field.types[0], sub_type)
    for t in reader.tensors:
        w = np.asarray(t.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("norm.weight"):
            w = pad_cols(w * np.sqrt(shrink, dtype=np.float32))
        elif t.name.endswith(("attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight", "token_embd.weight")):
            w = pad_cols(w)
        elif t.name.endswith("attn_q.weight"):
            w = head_rows(pad_cols(w))
        elif t.name.endswith("attn_output.weight"):
            w = pad_cols(head_rows(w.T).T)  # columns by head, then rows to the residual's width
            w = np.pad(w, [(0, width - hidden), (0, 0)])
        elif t.name.endswith("ffn_down.weight"):
            w = np.pad(w, [(0, width - hidden), (0, 0)])
        elif t.name != "output.weight" or w.shape[-1] != hidden:
            raise ValueError(f"{t.name}: no rule to pad it")
        else:
            w = pad_cols(w)
        writer.add_tensor(t.name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(f32: Path, target: Path, file_type: str, threads: int = 1) -> None:
    """llama.cpp's quantiser turns ``f32`` into ``target`` of ``file_type`` (FILE_TYPES), no imatrix."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[file_type])
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed for {file_type} ({status})")


def float_file(directory: Path = MODELS) -> Path:
    """The unquantised model: the packaged GGUF dequantised to F32, written once in ``directory``."""
    path = directory / f"{STEM}.F32.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_f32(default_model_path(), partial)
        partial.rename(path)
    return path


def llama_quantise(source: Path, target: Path, file_type: str, threads: int = 1) -> Path:
    """``quantize`` in a process of its own, so its log (a line per tensor) stays out of the
    caller's output unless it fails, and its backend out of the caller's process."""
    command = [sys.executable, "-m", "compile.quantised_files", str(source), str(target), file_type, str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"llama.cpp's quantiser could not write {target.name} (exit {done.returncode}):\n{tail}")
    return target


def padded_file(directory: Path = MODELS) -> Path:
    """The unquantised model laid out 768 wide (``write_padded``: the same function, every row a
    multiple of 256), written once in ``directory``."""
    path = directory / f"{STEM}-{PADDED_WIDTH}.F32.gguf"
    if not path.exists():
        partial = path.with_suffix(".partial")
        write_padded(float_file(directory), partial, PADDED_WIDTH)
        partial.rename(path)
    return path


def quantised_file(file_type: str, directory: Path = MODELS, threads: int = 1, padded: bool = False) -> Path:
    """The default model as llama.cpp's quantiser writes ``file_type`` from ``float_file`` (or,
    ``padded``, from ``padded_file``), made once."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown llama.cpp file type {file_type!r}; choose from {sorted(FILE_TYPES)}")
    path = directory / f"{STEM}{f'-{PADDED_WIDTH}' if padded else ''}.{file_type}.gguf"
    if not path.exists():
        source = padded_file(directory) if padded else float_file(directory)
        partial = llama_quantise(source, path.with_suffix(".partial"), file_type, threads)
        partial.rename(path)
    return path


def tensor_type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each GGUF type ``path`` holds, by type name."""
    return dict(sorted(Counter(t.tensor_type.name for t in GGUFReader(path).tensors).items()))


if __name__ == "__main__":  # quantised_file's worker: SOURCE TARGET FILE_TYPE THREADS
    source, target, file_type, threads = sys.argv[1:]
    quantize(Path(source), Path(target), file_type, int(threads))
