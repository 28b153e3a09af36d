"""Make the default model's GGUF files in llama.cpp's own file types, for fidelity and speed on
a multi-type or low-bit file.

    python scripts/make_kquant_gguf.py [--types Q4_K_M IQ4_XS Q3_K_M] [--out build/models] [--check]

compile/quantised_files.py does the work: the packaged SmolLM2-135M-Instruct Q4_1 GGUF
dequantised into an F32 GGUF, which llama.cpp's own quantiser (``llama_model_quantize``
through llama-cpp-python) turns into each type. A Q4_K_M file mixes Q4_K, Q6_K and, where a
row is not a multiple of 256 wide (this model's 576), llama.cpp's fallbacks Q5_0 / Q8_0; the
script prints each file's tensor types. The files go under ``build/models/`` (git-ignored) and
are made once. ``--check`` loads each file in nanoserve (printing how each tensor type runs)
and in llama.cpp and prints both greedy continuations of a prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: compile/ beside nanoserve/
from compile.quantised_files import FILE_TYPES, MODELS, quantised_file, tensor_type_counts  # noqa: E402

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def check(path: Path, max_tokens: int = 24) -> None:
    """Greedy continuations of PROMPT by nanoserve (packed) and by llama.cpp (the benchmarks'
    peer arm, compile/llama_peer.py, which keeps llama.cpp off its AMX repacking), printed."""
    from compile.llama_peer import LlamaCppSteps, load_as_run
    from nanoserve.engine import SamplingParams, build_engine

    engine = build_engine(str(path), max_batch_size=1, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = engine.generate([PROMPT], params, use_tqdm=False)[0]
    print(f"  nanoserve weight types: {engine.stats().weight_types}")
    print(f"  nanoserve: {out.text!r}")
    prompt = engine.tokenizer.encode(PROMPT)
    peer, _ = load_as_run(path, max_rows=1, max_len=256, threads=2)
    steps = LlamaCppSteps(peer, [prompt], max_tokens)
    while not steps.done:
        steps.step()
    print(f"  llama.cpp: {engine.tokenizer.decode(steps.outputs[0])!r}")
    peer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=sorted(FILE_TYPES))
    parser.add_argument("--out", type=Path, default=MODELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="load each file in nanoserve and llama.cpp")
    args = parser.parse_args(argv)
    targets = [quantised_file(file_type, args.out, args.threads) for file_type in args.types]
    for target in targets:
        print(f"{target}: {tensor_type_counts(target)}")
    for target in targets if args.check else []:
        print(target.name)
        check(target)


if __name__ == "__main__":
    sys.exit(main())
