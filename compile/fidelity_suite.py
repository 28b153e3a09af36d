"""fidelity: how close each weight format's logits stay to the fp32 reference, beside llama.cpp
on the same token ids (`python compilebench.py fidelity`).

Teacher-forced over a fixed English text (compile/texts/fidelity.txt; the forward and the
metrics are nanoserve.model.network.fidelity): every position's logits of the format against those of
the fp32 dequantisation of the same file, as top-1 agreement, mean and p99 KL divergence per
token, and the perplexity ratio. With llama-cpp-python installed, llama.cpp's own logits for
every position of the same ids (the GGUF as the file stores it) get the same metrics, and each
format is marked at least as faithful when it is no worse on all three: top-1 agreement, mean KL,
and the perplexity ratio's distance from 1. ``--model`` reads another GGUF file (a
multi-type K-quant file, say) in place of the default, in ``auto`` weights unless ``--weights``
says otherwise; ``--chunk-rows 8`` measures the path a decode step of a few rows takes (one
forward of the whole text is a prompt's path, which may run a dense copy). ``--reference``
measures against another model's fp32 logits (the unquantised file a quantised one was made
from), and ``--llama-quantise IQ4_XS`` runs the default model as llama.cpp's quantiser writes
that file type from the model's F32 file (compile/quantised_files.py), against that F32 file;
with ``--padded``, from that model laid out 768 wide, where every row takes the type.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compile import llama_peer, quantised_files
from compile.common import (
    FIDELITY_TEXT,
    WEIGHT_CHOICES,
    add_output_options,
    format_table,
    formats_for,
    name_list,
    result_stem,
    write_results,
)
from nanoserve.engine import build_engine
from nanoserve.engine.config import KV_CACHE_TYPES
from nanoserve.model.formats.loader import DEFAULT_MODEL, resolve_model_path
from nanoserve.model.network.fidelity import fidelity_metrics, teacher_forced_logits
from nanoserve.worker.kv_cells import resolve_cell_format, round_trip

FORMATS = ("bf16", "int8", "int4", "auto")
COLUMNS = ["system", "kv_cache", "tokens", "top1", "mean_kl", "p99_kl", "ppl", "ppl_ratio", "at_least_llama", "seconds"]


def engine_in(model: str, weights: str):
    """A one-row engine in one weight format: its model is the network as the engine runs it."""
    return build_engine(model, max_batch_size=1, max_model_len=64, weights=weights, compile=False)


def metrics_row(system: str, reference: torch.Tensor, logits: torch.Tensor, token_ids: list[int],
                seconds: float) -> dict:
    m = fidelity_metrics(reference[:-1], logits[:-1], torch.tensor(token_ids[1:]))
    return dict(system=system, tokens=len(token_ids) - 1, top1=m.top1_agreement, mean_kl=m.mean_kl,
                p99_kl=m.p99_kl, ppl=m.test_perplexity, ref_ppl=m.ref_perplexity, ppl_ratio=m.perplexity_ratio,
                seconds=seconds)


def at_least_as_faithful(row: dict, bar: dict) -> bool:
    return (row["top1"] >= bar["top1"] and row["mean_kl"] <= bar["mean_kl"]
            and abs(row["ppl_ratio"] - 1) <= abs(bar["ppl_ratio"] - 1))


def llama_cpp_logits(model: str, token_ids: list[int], threads: int, cache_type: str | None = None) -> torch.Tensor:
    peer, _ = llama_peer.load_as_run(resolve_model_path(model), 1, len(token_ids), threads, cache_type=cache_type)
    try:
        return torch.from_numpy(llama_peer.teacher_forced_logits(peer, token_ids))
    finally:
        peer.close()


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


def text_ids(tokenizer, text: Path, max_tokens: int | None, limit: int) -> list[int]:
    """The text's token ids, cut to ``max_tokens``; refused when the model cannot read them all."""
    token_ids = tokenizer.encode(text.read_text())[:max_tokens]
    if len(token_ids) > limit:
        raise ValueError(f"{text} is {len(token_ids)} tokens; the model reads at most {limit} positions "
                         "(--max-tokens cuts the text)")
    return token_ids


def same_vocabulary(reference: torch.Tensor, logits: torch.Tensor, model: str, against: str) -> torch.Tensor:
    """``logits``, refused unless they are over the reference's vocabulary."""
    if logits.shape != reference.shape:
        raise ValueError(f"{model} gives logits {tuple(logits.shape)}, its reference {against} "
                         f"{tuple(reference.shape)}: a reference must share the model's vocabulary")
    return logits


def run(args: argparse.Namespace) -> list[dict]:
    against = args.reference or args.model
    fp32 = engine_in(against, "fp32")
    token_ids = text_ids(fp32.tokenizer, args.text, args.max_tokens, fp32.model.config.max_position_embeddings)
    print(f"fidelity: {len(token_ids)} tokens of {args.text.name}, each format of {args.model} against {against} "
          "in fp32" + (f", {args.chunk_rows} rows per forward" if args.chunk_rows else ", one forward"))
    reference = teacher_forced_logits(fp32.model, token_ids)
    del fp32
    reference_name = resolve_model_path(against).name
    rows = []
    for weights in args.weights:
        engine = engine_in(args.model, weights)
        for kv in args.kv_cache_dtype:
            logits, seconds = timed(teacher_forced_logits, engine.model, token_ids, args.chunk_rows,
                                    kv_stored(kv, engine))
            logits = same_vocabulary(reference, logits, args.model, against)
            rows.append(metrics_row(weights, reference, logits, token_ids, seconds)
                        | dict(reference=reference_name, kv_cache=kv))
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    if args.llama_cpp:
        name = resolve_model_path(args.model).name
        for kv in args.kv_cache_dtype:  # llama.cpp's default K/V (auto) is f16
            logits, seconds = timed(llama_cpp_logits, args.model, token_ids, args.threads,
                                    None if kv == "auto" else kv)
            logits = same_vocabulary(reference, logits, args.model, against)
            bar = metrics_row(f"{llama_peer.NAME} ({name})", reference, logits, token_ids, seconds) | dict(
                reference=reference_name, kv_cache="f16" if kv == "auto" else kv)
            for row in rows:
                if row["kv_cache"] == kv and not row["system"].startswith(llama_peer.NAME):
                    row["at_least_llama"] = "yes" if at_least_as_faithful(row, bar) else "no"
            rows.append(bar)
    return rows


def kv_stored(kv: str, engine):
    """What the engine's cache of K/V type ``kv`` keeps of K and V (None: "auto", cells in the
    compute dtype, which hold the activations as they are)."""
    if kv == "auto":
        return None
    fmt = resolve_cell_format(kv, engine.resolved.dtype, engine.model.config.head_dim)
    return lambda k, v: (round_trip(k, fmt), round_trip(v, fmt))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a .gguf file, a Hugging Face directory, or smollm2 (the default); the CSV of "
                             "another model carries its file name")
    parser.add_argument("--weights", type=name_list(WEIGHT_CHOICES), default=None,
                        help=f"comma-separated, from {','.join(WEIGHT_CHOICES)} (default: {','.join(FORMATS)} "
                             "for the default model, auto for another)")
    parser.add_argument("--text", type=Path, default=FIDELITY_TEXT)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="read only the text's first N tokens (a large vocabulary's logits take memory)")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="feed the text this many tokens per forward (the row count packed layers see); "
                             "default: one forward")
    parser.add_argument("--reference", default=None,
                        help="the model whose fp32 logits every row is measured against, sharing the model's "
                             "vocabulary (default: the model's own fp32 dequantisation)")
    parser.add_argument("--llama-quantise", choices=sorted(quantised_files.FILE_TYPES),
                        help="the default model as llama.cpp's quantiser writes this file type from the "
                             "model's F32 file (made once under --models-dir), against that F32 file")
    parser.add_argument("--padded", action="store_true",
                        help="with --llama-quantise: quantise the model laid out 768 wide (the same function, "
                             "every row a multiple of 256), so no tensor falls back from its type")
    parser.add_argument("--models-dir", type=Path, default=quantised_files.MODELS,
                        help="where --llama-quantise keeps its files (default: build/models)")
    parser.add_argument("--kv-cache-dtype", type=name_list(KV_CACHE_TYPES), default=["auto"],
                        help=f"comma-separated K/V cache types, from {','.join(KV_CACHE_TYPES)}: each weight "
                             "format's logits with K and V kept as that type holds them, read in chunks; "
                             "llama.cpp's rows with the same --cache-type-k/v (auto: its default, f16)")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip the llama.cpp row")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's threads")
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    if args.padded and not args.llama_quantise:
        parser.error("--padded lays out the model --llama-quantise quantises; name a file type with it")
    if args.llama_quantise:
        if args.model != DEFAULT_MODEL:
            parser.error("--llama-quantise makes its file from the default model; leave --model out")
        args.model = str(quantised_files.quantised_file(args.llama_quantise, args.models_dir, padded=args.padded))
        unquantised = quantised_files.padded_file if args.padded else quantised_files.float_file
        args.reference = args.reference or str(unquantised(args.models_dir))
        print(f"{Path(args.model).name}: {quantised_files.tensor_type_counts(Path(args.model))}")
    args.weights = formats_for(args.model, args.weights, FORMATS)
    if args.llama_cpp and not llama_peer.available():
        print(llama_peer.ABSENT)
        args.llama_cpp = False
    if args.llama_cpp and llama_peer.gguf_of(args.model) is None:
        args.llama_cpp = False
    torch.set_grad_enabled(False)
    rows = run(args)
    print("\n" + format_table(rows, COLUMNS))
    write_results(rows, args.out, result_stem("fidelity", args.model, args.tag))
    return 0
