"""scale: the sizes people run. For Llama-shaped GGUF files of the 1B, 3B and 8B shapes, and the
mixtures of experts (Qwen3-30B-A3B's shape, a small Mixtral-style one) (random weights,
``model_files``), each system alone in a process of its own, one after the other:
seconds to load (to ready), peak resident memory (``getrusage``) after loading and over the whole
run, resident weight bytes, decode tokens/s at batches 1 and 8 (nanoserve compiled ``auto``),
time to first token of a 512-token prompt, and batch 1's step against its two limits: its weight
bytes at the host's read bandwidth (``floor_ms_b1``: a streaming read of a buffer larger than the
last-level cache, timed after each step and paired with it; of an expert tensor, the routed
experts only) and its integer multiply-adds at
the kernel tier's peak (``arith_ms_b1``: ``cpu_kernels.dot_peak_rate``, each weight once, twice
for nanoserve's 16-bit activations): nanoserve (``--weights``, an arm each) against llama.cpp on
the same file (``python compilebench.py scale``; ``--sizes 1b --types Q4_0`` for one file).
Writes ``compile/results/runs/scale[-TAG].csv`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compile import llama_peer
from compile.common import (
    add_output_options,
    format_table,
    host_description,
    make_prompts,
    name_list,
    pyplot,
    result_stem,
    save_figure,
    text_prompt,
    write_results,
)
from compile.floor import read_bandwidth
from compile.model_files import FILE_TYPES, SHAPES, model_file
from nanoserve.model.quant import cpu_kernels

NEW_TOKENS = 24  # decode steps timed per batch, after a warm-up run of the same shape
PROMPT_TOKENS = 32
TTFT_TOKENS = 512
TTFT_REPEATS = 2  # after a warm-up prefill of WARMUP_TOKENS (an 8B file's 512-token prefill takes a minute)
WARMUP_TOKENS = 64
MAX_MODEL_LEN = 1024
COLUMNS = ("file", "system", "weights", "llama_cpp", "file_gb", "load_s", "rss_load_gb", "rss_peak_gb", "weights_gb",
           "tok_s", "ttft_512_s", "step_ms_b1", "floor_ms_b1", "arith_ms_b1")  # tok_s: a column per batch


def _peak_rss_gb() -> float:
    """This process's peak resident size: /proc's VmHWM where there is one (getrusage's maxrss of a
    forked child starts at its parent's), else getrusage (KiB on Linux, bytes on macOS)."""
    status = Path("/proc/self/status")
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        return int(fields["VmHWM"].split()[0]) * 1024 / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e9


def _median_step(steps) -> float:
    while not steps.done:
        steps.step()
    return statistics.median(steps.decode_steps)


def _batch_1(steps, step_bytes: int) -> dict:
    """Batch 1's median step and its read floor: a timed read (compile/floor.py) after each step,
    each step against the read beside it, since a shared VM's memory speed moves within a run.
    A worker runs it after taking its peak RSS, which the reads' buffer must not swell."""
    from compile.floor import SAMPLE_BYTES, ReadSampler, read_buffer, x_read_floor

    read = ReadSampler(read_buffer(SAMPLE_BYTES))
    while not steps.done:
        steps.step()
        read.step()
    step, x_floor = statistics.median(steps.decode_steps), x_read_floor(steps.decode_steps, read.decode_steps,
                                                                        read.data.nbytes, step_bytes)
    return dict(tok_s_b1=1 / step, step_bytes_b1=step_bytes, step_s_b1=step, x_floor_b1=x_floor,
                floor_s_b1=step / x_floor)


def measure_nanoserve(path: Path, batches: Sequence[int], width_buckets: tuple[int, ...] | None = None,
                      weights: str = "auto") -> dict:
    from compile.floor import step_multiply_adds, step_weight_bytes
    from compile.interleave import EngineSteps
    from compile.ttft import nanoserve_ttft
    from nanoserve.engine import build_engine

    started = time.perf_counter()
    engine = build_engine(str(path), max_batch_size=max(batches), max_model_len=MAX_MODEL_LEN, compile=True, warmup="eager",
                          enable_prefix_caching=False, width_buckets=width_buckets, weights=weights)
    row = dict(load_s=time.perf_counter() - started, rss_load_gb=_peak_rss_gb(),
               weights_gb=engine.stats().weight_bytes / 1e9, load_stages=engine.stats().load_stages)
    vocab = engine.model.config.vocab_size
    for batch in batches:
        EngineSteps(engine, make_prompts(batch, PROMPT_TOKENS, vocab, seed=batch), 4)  # builds the graph
        while engine.has_unfinished():
            engine.step()
        if batch != 1:  # timed last (_batch_1)
            steps = EngineSteps(engine, make_prompts(batch, PROMPT_TOKENS, vocab, seed=batch), NEW_TOKENS)
            row[f"tok_s_b{batch}"] = batch / _median_step(steps)
    prompt = text_prompt(engine.tokenizer, TTFT_TOKENS)
    nanoserve_ttft(engine, prompt[:WARMUP_TOKENS])
    row["ttft_512_s"] = statistics.median(nanoserve_ttft(engine, prompt) for _ in range(TTFT_REPEATS))
    row["rss_peak_gb"] = _peak_rss_gb()
    if 1 in batches:
        steps = EngineSteps(engine, make_prompts(1, PROMPT_TOKENS, vocab, seed=1), NEW_TOKENS)
        row.update(_batch_1(steps, step_weight_bytes(engine.model, 1)), step_macs_b1=step_multiply_adds(engine.model))
    stats = engine.stats()
    row.update(weights=stats.weights, kernels=stats.cpu_kernels, dtype=stats.compute_dtype)
    return row


def measure_llama_cpp(path: Path, batches: Sequence[int], repack: bool) -> dict:
    from compile.ttft import llama_ttft
    from nanoserve.model.formats.gguf_loader import GGUFCheckpoint
    from nanoserve.model.formats.tokenizer import Tokenizer

    started = time.perf_counter()
    peer = llama_peer.LlamaCpp(path, max(batches), MAX_MODEL_LEN, torch.get_num_threads(), repack=repack)
    row = dict(load_s=time.perf_counter() - started, rss_load_gb=_peak_rss_gb())
    ckpt = GGUFCheckpoint.open(path)
    row["weights_gb"] = sum(int(t.n_bytes) for t in ckpt.reader.tensors) / 1e9  # it runs the file's blocks
    for batch in batches:
        _median_step(llama_peer.LlamaCppSteps(peer, make_prompts(batch, PROMPT_TOKENS, peer.vocab_size, seed=batch), 4))
        if batch != 1:  # timed last (_batch_1)
            steps = llama_peer.LlamaCppSteps(peer, make_prompts(batch, PROMPT_TOKENS, peer.vocab_size, seed=batch),
                                             NEW_TOKENS)
            row[f"tok_s_b{batch}"] = batch / _median_step(steps)
    prompt = text_prompt(Tokenizer.from_gguf_metadata(ckpt.metadata, source=str(path)), TTFT_TOKENS)
    llama_ttft(peer, prompt[:WARMUP_TOKENS])
    row["ttft_512_s"] = statistics.median(llama_ttft(peer, prompt) for _ in range(TTFT_REPEATS))
    row["rss_peak_gb"] = _peak_rss_gb()
    if 1 in batches:
        # A step reads every tensor but the embedding table (a few rows of it), unless it is the
        # head too; of an expert tensor, the routed experts only.
        names = {t.name for t in ckpt.reader.tensors}
        arch = ckpt.architecture
        experts = int(ckpt.metadata.get(f"{arch}.expert_count", 0) or 0)
        share = int(ckpt.metadata.get(f"{arch}.expert_used_count", 0) or 0) / experts if experts else 1.0
        read = [t for t in ckpt.reader.tensors if t.name != "token_embd.weight" or "output.weight" not in names]
        steps = llama_peer.LlamaCppSteps(peer, make_prompts(1, PROMPT_TOKENS, peer.vocab_size, seed=1), NEW_TOKENS)
        row.update(_batch_1(steps, int(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0) for t in read))))
        # its q8 activations multiply each weight of a product once (norms' vectors are no product)
        row["step_macs_b1"] = int(sum(int(t.n_elements) * (share if "_exps." in t.name else 1.0)
                                      for t in read if len(t.shape) >= 2))
    # Which instruction sets this llama.cpp build runs (an AVX2-only build beside a forced tier).
    info = peer.lib.llama_print_system_info().decode()
    row["kernels"] = "llama.cpp " + "+".join(name for name in ("AVX2", "AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")
                                             if f"{name} = 1" in info)
    row["dtype"] = ""
    peer.close()
    return row


def run_alone(system: str, path: Path, batches: Sequence[int], env: dict[str, str],
              width_buckets: tuple[int, ...] | None = None, repack: bool = True, weights: str = "auto") -> dict:
    """One system's measurements in a fresh process (its own peak RSS and nothing else running)."""
    command = [sys.executable, "-m", "compile.scale", "--worker", system, str(path),
               "--batches", ",".join(map(str, batches)), "--llama-repack", "on" if repack else "off",
               "--weights", weights]
    if width_buckets:
        command += ["--width-buckets", ",".join(map(str, width_buckets))]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env},
                          cwd=Path(__file__).resolve().parent.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode < 0:
        return dict(error=f"killed by {signal.Signals(-done.returncode).name}")
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return dict(error=f"exit {done.returncode}: {' | '.join(tail)}")
    return json.loads(lines[-1])


def arms(llama_cpp: bool, repack: str, weights: Sequence[str] = ("auto",)) -> list[tuple[str, bool, str, str]]:
    """The (system, llama.cpp repacking, label, nanoserve's weights) runs per file: nanoserve in each
    of ``weights``, llama.cpp with its defaults (repacking on) and, with ``both``, unrepacked too
    (the two differ by up to 2x on some CPUs)."""
    runs = [("nanoserve", False, "", w) for w in weights]
    if llama_cpp and repack in ("both", "on"):
        runs.append(("llama.cpp", True, "defaults (repacking on)", ""))
    if llama_cpp and repack in ("both", "off"):
        runs.append(("llama.cpp", False, "repacking off", ""))
    return runs


# The tiers a run can force, each with the caps that hold torch's own kernels (MKL, oneDNN; ATen
# has nothing between AVX2 and AVX-512) to the same instructions: AVX-VNNI is MKL's AVX2_E1.
TORCH_CAPS = {"avx2": ("AVX2", "AVX2"), "avx-vnni": ("AVX2_E1", "AVX2_VNNI")}


def worker_env(system: str, tier: str | None, llama_cpp_path: Path | None) -> dict[str, str]:
    """The environment one system's worker runs in: a forced tier caps torch's kernels as well
    (in an inductor cache of its own: graphs compiled for one capability must not serve another)."""
    if system == "llama.cpp":
        return {} if llama_cpp_path is None else {"PYTHONPATH": f"{llama_cpp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if tier is None:
        return {}
    mkl, onednn = TORCH_CAPS[tier]
    return {"NANOSERVE_CPU_KERNELS": tier, "MKL_ENABLE_INSTRUCTIONS": mkl, "ONEDNN_MAX_CPU_ISA": onednn,
            "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / f"inductor-{tier}")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=name_list(tuple(SHAPES)), default=("1b", "3b", "8b"))
    parser.add_argument("--types", type=name_list(FILE_TYPES), default=("Q4_0", "Q4_K_M"))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "nanoserve-scale",
                        help="where the random GGUF files are written (once) and kept")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-repack", choices=("both", "on", "off"), default="both",
                        help="llama.cpp's arms: its defaults (weights repacked: 'on'), unrepacked ('off'), or both "
                             "(the default); a crashed arm is a row saying how it died")
    parser.add_argument("--tier", choices=tuple(TORCH_CAPS), help="force nanoserve's kernel tier and cap torch's own "
                        "kernels to it (with a fresh inductor cache); compare with --llama-cpp-path")
    parser.add_argument("--llama-cpp-path", type=Path, help="a folder holding another llama-cpp-python build "
                        "(e.g. one without AVX-512, installed with pip --target), put first on the peer's path")
    parser.add_argument("--width-buckets", type=lambda text: tuple(int(w) for w in text.split(",")),
                        help="nanoserve's decode width buckets (default: the engine's, doubling to the context): "
                             "fewer graphs to compile for a big model, e.g. 64,1024 covers this benchmark's steps")
    parser.add_argument("--weights", default="auto",
                        help="nanoserve's weights, comma-separated for an arm each (e.g. auto,auto+a16: 16-bit "
                             "activations at every batch beside the default)")
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "FILE"), help=argparse.SUPPRESS)
    add_output_options(parser)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.worker:
        system, path = args.worker
        torch.set_grad_enabled(False)
        if system == "nanoserve":
            print(json.dumps(measure_nanoserve(Path(path), batches, args.width_buckets, args.weights)))
        else:
            print(json.dumps(measure_llama_cpp(Path(path), batches, repack=args.llama_repack != "off")))
        return 0
    host = host_description()
    floor = read_bandwidth()
    tier = args.tier or host["kernels"]
    peak = None if tier == "torch" else cpu_kernels.dot_peak_rate(tier)
    dtype = str(cpu_kernels.compute_dtype(tier)).removeprefix("torch.")
    print(f"CPU: {host['cpu']}; nanoserve kernels: {tier}{' (forced)' if args.tier else ''}, compute dtype {dtype}; "
          f"read bandwidth now {floor / 1e9:.1f} GB/s (each batch-1 step meets the reads beside it); int8 multiply-add peak "
          f"{'-' if peak is None else f'{peak / 1e9:.0f} G/s'} ({tier})")
    with_llama = not args.no_llama_cpp and llama_peer.available()
    if not args.no_llama_cpp and not with_llama:
        print(llama_peer.ABSENT)
    columns = [name for c in COLUMNS for name in ([f"tok_s_b{b}" for b in batches] if c == "tok_s" else [c])]
    rows = []
    for size in args.sizes:
        for file_type in args.types:
            if size == "8b" and file_type == "Q4_0":
                continue  # the 8B row is the Q4_K_M file people run
            path = model_file(args.models_dir, size, file_type)
            for system, repack, label, weights in arms(with_llama, args.llama_repack, args.weights.split(",")):
                measured = run_alone(system, path, batches, worker_env(system, args.tier, args.llama_cpp_path),
                                     args.width_buckets if system == "nanoserve" else None, repack, weights)
                row = {**host, "file": path.name, "system": system, "file_gb": path.stat().st_size / 1e9, **measured}
                if label:
                    row["llama_cpp"] = label
                if "step_s_b1" in row:
                    # batch 1's step against its two limits: its weight bytes at the read rate
                    # beside its steps (_batch_1), its multiply-adds at the tier's peak (dot_peak_rate)
                    row["read_gbps_b1"] = row["step_bytes_b1"] / row["step_s_b1"] / 1e9
                    row["of_floor_b1"] = 1 / row["x_floor_b1"]
                    row["step_ms_b1"] = row["step_s_b1"] * 1e3
                    row["floor_ms_b1"] = row["floor_s_b1"] * 1e3
                    row["floor_gbps"] = row["step_bytes_b1"] / row["floor_s_b1"] / 1e9
                    if peak:
                        row["arith_ms_b1"] = row["step_macs_b1"] / peak * 1e3
                row["peak_gmacs"] = peak / 1e9 if peak else None
                rows.append(row)
                print(format_table([row], [c for c in columns if c in row] + (["error"] if "error" in row else [])))
    print(format_table(rows, [c for c in columns if any(c in r for r in rows)]))
    write_results(rows, args.out, result_stem("scale", tag=args.tag), plot=None if args.no_plot else _plot)
    return 0


def _plot(rows: Sequence[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    files = list(dict.fromkeys(r["file"] for r in rows))
    runs = list(dict.fromkeys((r["system"], r.get("llama_cpp", "")) for r in rows))
    width = 0.8 / len(runs)
    for ax, (column, label) in zip(axes, [("load_s", "load to ready (s)"), ("rss_peak_gb", "peak RSS (GB)"),
                                          ("tok_s_b1", "decode tok/s, batch 1")]):
        for offset, (system, mode) in enumerate(runs):
            values = [next((r.get(column, 0) for r in rows
                            if r["file"] == f and (r["system"], r.get("llama_cpp", "")) == (system, mode)), 0)
                      for f in files]
            ax.bar([i + width * offset for i in range(len(files))], values, width=width,
                   label=f"{system} ({mode})" if mode else system)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(files))])
        ax.set_xticklabels([f.removeprefix("random-").removesuffix(".gguf") for f in files], fontsize=8)
        ax.set_title(label)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
