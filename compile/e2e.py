"""e2e: offline decode throughput of the engine, per weight format, eager and compiled, against
llama.cpp and Hugging Face transformers (`python compilebench.py e2e`).

Every system decodes the same batches of ``--prompt-len``-token prompts, ``--new-tokens``
tokens each (greedy, or with ``--sampling llama.cpp`` by llama.cpp's default law, each system
with its own sampler), EOS ignored: the engine in each weight format and mode, llama.cpp on the
same GGUF file (when llama-cpp-python is installed) and transformers on the dequantised fp32
weights. Each system's decode step time is the median over its steps, prefill left out. They
run interleaved, one step each in a rotating order (compile/interleave.py), and each ratio is
the median over neighbouring pairs of steps. Each step is also quoted against two floors
measured in the same run (compile/floor.py): the step's matrix products in its own format,
and its weight bytes over the machine's read rate, timed by a read that takes its turn among
the steps, so that each step meets a floor from the same moment. ``--model`` runs another GGUF file (or a
Hugging Face directory) in place of the default; its result files carry the file's name.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from compile import llama_peer
from compile.common import (
    MODES,
    SAMPLING_LAWS,
    WEIGHT_CHOICES,
    DecodeWorkload,
    add_output_options,
    format_table,
    formats_for,
    int_list,
    make_prompts,
    name_list,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)
from compile.floor import (
    SAMPLE_BYTES,
    ReadSampler,
    matmul_floor_seconds,
    read_buffer,
    step_cache_bytes,
    step_weight_bytes,
    x_read_floor,
)
from compile.interleave import TRANSFORMERS, EngineSteps, interleaved_run, load_reference
from nanoserve.engine import build_engine
from nanoserve.engine.config import KV_CACHE_TYPES

LLAMA_CPP = llama_peer.NAME
LLAMA_UNREPACKED = f"{llama_peer.NAME} (repacking off)"
READ = "read"  # the timed reads among the steps (compile/floor.py ReadSampler)
COLUMNS = ["weights", "mode", "kv_cache", "batch", "tok_s", "llama_cpp", "llama_tok_s", "vs_llama", "llama_norepack_tok_s",
           "vs_llama_norepack", "vs_llama_p10", "vs_llama_p90",
           "hf_tok_s", "vs_hf", "step_ms", "floor_ms", "bw_floor_ms", "x_floor", "x_bw_floor", "llama_x_bw_floor",
           "outside_forward", "same_as_hf", "same_as_llama"]


@dataclass
class Peers:
    """The systems every pass is compared with; either may be absent."""

    reference: object | None = None  # transformers' model
    llama: llama_peer.LlamaCpp | None = None  # as its users run it (llama_peer.repack_mode)
    llama_mode: llama_peer.RepackMode | None = None
    llama_unrepacked: llama_peer.LlamaCpp | None = None  # beside repacked defaults, where asked
    llama_weight_bytes: int = 0

    @classmethod
    def load(cls, work: DecodeWorkload) -> Peers:
        peers = cls(reference=load_reference(work.model) if work.transformers else None)
        path = llama_peer.gguf_of(work.model) if work.llama_cpp else None
        if path is not None:
            wanted = "auto" if work.llama_repack == "both" else work.llama_repack
            peers.llama, peers.llama_mode = llama_peer.load_as_run(path, max(work.batches), work.max_len,
                                                                   work.threads, wanted)
            if work.llama_repack == "both" and peers.llama_mode.repack:
                peers.llama_unrepacked = llama_peer.LlamaCpp(path, max(work.batches), work.max_len, work.threads,
                                                             repack=False)
            peers.llama_weight_bytes = gguf_tensor_bytes(path)
        return peers

    def close(self) -> None:
        for peer in (self.llama, self.llama_unrepacked):
            if peer is not None:
                peer.close()


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file, as llama.cpp holds and reads them."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


def arm_name(mode: str, kv: str) -> str:
    """An engine arm's name: its mode, and its K/V cache type where that is not the default."""
    return mode if kv == "auto" else f"{mode} kv {kv}"


def build_engines(work: DecodeWorkload, weights: str) -> dict[str, object]:
    # The budget holds the largest batch's prompts, so its prefill is one step (EngineSteps
    # counts every later step as decode).
    return {arm_name(mode, kv): build_engine(
                work.model, max_batch_size=max(work.batches), max_model_len=work.max_len,
                kv_cache_bytes=work.kv_cache_bytes, compile=mode == "compile", warmup="eager", weights=weights,
                max_num_batched_tokens=max(work.batches) * work.prompt_len, kv_cache_dtype=kv)
            for mode in work.modes for kv in work.kv_cache_types}


def one_pass(engines: dict, peers: Peers, prompts: list[list[int]], new_tokens: int,
             read: torch.Tensor | None = None, sampling: str = "greedy"):
    """Every engine and peer decoding ``prompts`` interleaved, each by the law ``sampling`` names
    (common.SAMPLING_LAWS) with its own sampler, with a timed read of ``read`` among them when
    given (its seconds under READ); returns (PassResult, engine arms)."""
    law = SAMPLING_LAWS[sampling]
    arms = {mode: EngineSteps(engine, prompts, new_tokens, law) for mode, engine in engines.items()}
    everyone = dict(arms)
    if read is not None:
        everyone[READ] = ReadSampler(read)
    if peers.llama is not None:
        everyone[LLAMA_CPP] = llama_peer.LlamaCppSteps(peers.llama, prompts, new_tokens, law)
    if peers.llama_unrepacked is not None:
        everyone[LLAMA_UNREPACKED] = llama_peer.LlamaCppSteps(peers.llama_unrepacked, prompts, new_tokens, law)
    return interleaved_run(everyone, prompts, new_tokens, peers.reference), arms


def paired_ratios(theirs: list[float], ours: list[float]) -> list[float]:
    """Their step over ours for each neighbouring pair, sorted (> 1: ours is faster)."""
    return sorted(t / o for t, o in zip(theirs, ours))


def measure_format(work: DecodeWorkload, weights: str, peers: Peers) -> list[dict]:
    engines = build_engines(work, weights)
    any_engine = next(iter(engines.values()))
    warm = make_prompts(max(work.batches), 8, any_engine.vocab_size, seed=99)
    one_pass(engines, peers, warm, 4, sampling=work.sampling)  # first-call costs (and the first compile) out of the measurement
    rows = []
    read = read_buffer(SAMPLE_BYTES)
    for batch in work.batches:
        prompts = make_prompts(batch, work.prompt_len, any_engine.vocab_size)
        result, arms = one_pass(engines, peers, prompts, work.new_tokens, read, work.sampling)
        floor = matmul_floor_seconds(any_engine.model, batch)
        reads = result.decode_steps[READ]
        bandwidth = read.nbytes / statistics.median(reads)
        # What a step reads: the weights, and the K/V cells at the pass's middle context.
        cache_bytes = step_cache_bytes(any_engine, batch, work.prompt_len + work.new_tokens / 2)
        weight_bytes = step_weight_bytes(any_engine.model, batch)
        read_bytes = weight_bytes + cache_bytes
        for name, arm in arms.items():
            mode, _, kv = name.partition(" kv ")
            row = dict(weights=weights, mode=mode, kv_cache=kv or "auto", sampling=work.sampling, batch=batch,
                       **_speed(result, name, batch, work.sampling == "greedy"),
                       floor_ms=floor * 1e3, bw_floor_ms=read_bytes / bandwidth * 1e3,
                       weight_mb=weight_bytes / 1e6, cache_mb=cache_bytes / 1e6,
                       resident_mb=any_engine.weight_bytes / 1e6,
                       read_gb_s=bandwidth / 1e9, outside_forward=arm.outside_forward,
                       x_bw_floor=x_read_floor(result.decode_steps[name], reads, read.nbytes, read_bytes))
            row["x_floor"] = row["step_ms"] / row["floor_ms"]
            if peers.llama_mode is not None:
                row["llama_cpp"] = peers.llama_mode.label
            if LLAMA_CPP in result.decode_steps:
                row["llama_x_bw_floor"] = x_read_floor(result.decode_steps[LLAMA_CPP], reads, read.nbytes,
                                                       peers.llama_weight_bytes + cache_bytes)
            rows.append(row)
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    return rows


def _speed(result, mode: str, batch: int, greedy: bool = True) -> dict:
    """One engine arm's tokens/s and its ratios against each peer in the pass (and, greedy, how
    many rows' tokens are the peer's)."""
    ours = result.decode_steps[mode]
    step = statistics.median(ours)
    row = dict(tok_s=batch / step, step_ms=step * 1e3)
    for peer, key in ((LLAMA_CPP, "llama"), (LLAMA_UNREPACKED, "llama_norepack"), (TRANSFORMERS, "hf")):
        if peer not in result.decode_steps:
            continue
        theirs = result.decode_steps[peer]
        ratios = paired_ratios(theirs, ours)
        same = sum(a == b for a, b in zip(result.tokens[mode], result.tokens[peer]))
        row.update({f"{key}_tok_s": batch / statistics.median(theirs),
                    f"{key}_step_ms": statistics.median(theirs) * 1e3,
                    f"vs_{key}": statistics.median(ratios), f"vs_{key}_p10": ratios[len(ratios) // 10],
                    f"vs_{key}_p90": ratios[len(ratios) * 9 // 10],
                    f"same_as_{key}": f"{same}/{batch}" if greedy else "sampled"})
    return row


def run(work: DecodeWorkload) -> list[dict]:
    if work.llama_cpp and not llama_peer.available():
        print(llama_peer.ABSENT)
        work = replace(work, llama_cpp=False)
    if work.sampling != "greedy" and work.transformers:
        raise ValueError("--sampling: the transformers arm decodes greedily; add --no-transformers")
    peers = Peers.load(work)
    print(f"e2e: {work.prompt_len}-token prompts, {work.new_tokens} tokens ({work.sampling}), torch threads "
          f"{torch.get_num_threads()}" + (f", llama.cpp threads {work.threads}" if peers.llama else ""))
    print(format_table([], COLUMNS))
    try:
        return [row for weights in work.weights for row in measure_format(work, weights, peers)]
    finally:
        peers.close()


def write_plot(results: list[dict], path: Path) -> None:
    """One panel per weight format: tokens/s per batch for every system, and both floors."""
    plt = pyplot()
    formats = list(dict.fromkeys(r["weights"] for r in results))
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4), squeeze=False)
    for ax, weights in zip(axes[0], formats):
        rows = [r for r in results if r["weights"] == weights]
        arms = list(dict.fromkeys(arm_name(r["mode"], r.get("kv_cache", "auto")) for r in rows))
        lines = {f"nanoserve {arm}": [(r["batch"], r["tok_s"]) for r in rows
                                      if arm_name(r["mode"], r.get("kv_cache", "auto")) == arm] for arm in arms}
        base = [r for r in rows if arm_name(r["mode"], r.get("kv_cache", "auto")) == arms[0]]
        for peer, key in ((LLAMA_CPP, "llama_tok_s"), (TRANSFORMERS + " (fp32)", "hf_tok_s")):
            if key in base[0]:
                lines[peer] = [(r["batch"], r[key]) for r in base]
        for label, points in lines.items():
            ax.plot(*zip(*points), marker="o", label=label)
        for key, style, label in (("floor_ms", "--", "bound: matrix products"),
                                  ("bw_floor_ms", ":", "bound: weight bytes / read bandwidth")):
            ax.plot([r["batch"] for r in base], [r["batch"] / (r[key] / 1e3) for r in base],
                    linestyle=style, color="grey", label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s (median step)",
               title=f"e2e decode, nanoserve weights {weights}")
        ax.set_xticks([r["batch"] for r in base], [str(r["batch"]) for r in base])
        ax.minorticks_off()
        ax.legend(fontsize="small")
    save_figure(fig, path)


def add_workload_options(parser: argparse.ArgumentParser, defaults: DecodeWorkload) -> None:
    """The options e2e and the headline share (the headline with its own defaults)."""
    parser.add_argument("--model", default=defaults.model,
                        help="a .gguf file, a Hugging Face directory, or smollm2 (the default); the result "
                             "files of another model carry its file name")
    parser.add_argument("--weights", type=name_list(WEIGHT_CHOICES), default=None,
                        help=f"comma-separated, from {','.join(WEIGHT_CHOICES)} (default: "
                             f"{','.join(defaults.weights)} for the default model, auto for another)")
    parser.add_argument("--modes", type=name_list(MODES), default=defaults.modes, help="eager,compile or one of them")
    parser.add_argument("--batches", type=int_list, default=defaults.batches)
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers arm")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp arm")
    parser.add_argument("--kv-cache-bytes", type=int, default=defaults.kv_cache_bytes)
    parser.add_argument("--kv-cache-dtype", type=name_list(KV_CACHE_TYPES), default=defaults.kv_cache_types,
                        help=f"comma-separated K/V cache types, from {','.join(KV_CACHE_TYPES)}: an engine arm "
                             "for each (default: auto)")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="llama.cpp's threads (default: torch's)")
    parser.add_argument("--llama-repack", choices=("both", "auto", "on", "off"), default=defaults.llama_repack,
                        help="llama.cpp's weights: 'auto' runs its defaults (repacked) where they work here, else "
                             "unrepacked, saying why; 'both' (the default) adds an unrepacked arm beside repacked "
                             "defaults; 'on' fails where repacking crashes; 'off' never repacks")
    parser.add_argument("--sampling", choices=tuple(SAMPLING_LAWS), default=defaults.sampling,
                        help="how every system chooses its tokens: greedy (the default), or llama.cpp's command "
                             "line defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), each by its own sampler")
    add_output_options(parser)


def workload_from(args: argparse.Namespace, defaults: DecodeWorkload) -> DecodeWorkload:
    return DecodeWorkload(model=args.model, weights=formats_for(args.model, args.weights, defaults.weights),
                          modes=args.modes, batches=args.batches,
                          prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          transformers=not args.no_transformers, llama_cpp=not args.no_llama_cpp,
                          threads=args.threads, kv_cache_bytes=args.kv_cache_bytes, llama_repack=args.llama_repack,
                          kv_cache_types=args.kv_cache_dtype, sampling=args.sampling)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py e2e", description=__doc__.split("\n\n")[0])
    add_workload_options(parser, DecodeWorkload())
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    results = run(workload_from(args, DecodeWorkload()))
    print("\n" + format_table(results, COLUMNS))
    write_results(results, args.out, result_stem("e2e", args.model, args.tag), None if args.no_plot else write_plot)
    return 0
