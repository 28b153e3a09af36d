"""Make K-quant GGUF files of the default model, for fidelity and speed on a multi-type file.

    python scripts/make_kquant_gguf.py [--types Q4_K_M Q5_K_M Q6_K] [--out build/models] [--check]

The packaged SmolLM2-135M-Instruct Q4_1 GGUF is dequantised into an F32 GGUF with gguf's writer
(the same metadata, tokenizer and tensor layout), which llama.cpp's own quantiser
(``llama_model_quantize`` through llama-cpp-python) then turns into each type: a Q4_K_M file
mixes Q4_K, Q6_K and, where a row is not a multiple of 256 wide (this model's 576), llama.cpp's
fallbacks Q5_0 / Q8_0. The files go under ``build/models/`` (git-ignored). ``--check`` loads each
file in nanoserve (printing how each tensor type runs) and in llama.cpp and prints both greedy
continuations of a prompt.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

# The llama.cpp file types this script makes, by their usual names.
FILE_TYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
              "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


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


def quantize(f32: Path, target: Path, file_type: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[file_type])
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed for {file_type} ({status})")


def tensor_types(path: Path) -> Counter:
    return Counter(t.tensor_type.name for t in GGUFReader(path).tensors)


def check(path: Path, max_tokens: int = 24) -> None:
    """Greedy continuations of PROMPT by nanoserve (packed) and by llama.cpp (the benchmarks'
    peer arm, compile/llama_peer.py, which keeps llama.cpp off its AMX repacking), printed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: compile/ beside nanoserve/
    from compile.llama_peer import LlamaCpp, LlamaCppSteps
    from nanoserve.engine import SamplingParams, build_engine

    engine = build_engine(str(path), max_batch_size=1, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = engine.generate([PROMPT], params, use_tqdm=False)[0]
    print(f"  nanoserve weight types: {engine.stats()['weight_types']}")
    print(f"  nanoserve: {out.text!r}")
    prompt = engine.tokenizer.encode(PROMPT)
    peer = LlamaCpp(path, max_rows=1, max_len=256, threads=2)
    steps = LlamaCppSteps(peer, [prompt], max_tokens)
    while not steps.done:
        steps.step()
    print(f"  llama.cpp: {engine.tokenizer.decode(steps.outputs[0])!r}")
    peer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=sorted(FILE_TYPES))
    parser.add_argument("--out", type=Path, default=Path("build/models"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="load each file in nanoserve and llama.cpp")
    args = parser.parse_args(argv)
    from nanoserve.model_path import default_model_path

    source = default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    f32 = args.out / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        write_f32(source, f32)
    targets = [args.out / f"SmolLM2-135M-Instruct.{file_type}.gguf" for file_type in args.types]
    for file_type, target in zip(args.types, targets):
        quantize(f32, target, file_type, args.threads)
        print(f"{target}: {dict(sorted(tensor_types(target).items()))}")
    for target in targets if args.check else []:  # after every quantisation: a used llama.cpp backend crashes it
        print(target.name)
        check(target)


if __name__ == "__main__":
    sys.exit(main())
