"""What every suite shares: where results go and what they are named, the texts and prompts it
reads, the decode workload of the e2e and headline suites, argument helpers, timing, and the
writers of its tables, CSVs and plots."""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve.model.formats.loader import DEFAULT_MODEL

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the committed reference figures, rewritten only on purpose (--out compile/results)
RUNS = RESULTS / "runs"  # a run's default --out: git ignores it (.gitignore), so a run leaves the checkout clean
FIDELITY_TEXT = HERE / "texts" / "fidelity.txt"  # original prose written for these suites, over 3,000 tokens


# --- what the suites run -------------------------------------------------------------------------

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "auto")
# What --weights may name: the formats, and auto with a dense copy for steps of many rows.
WEIGHT_CHOICES = (*WEIGHT_FORMATS, "auto+dense", "auto+a8", "auto+a16")
MODES = ("eager", "compile")


# The laws a decode benchmark can sample by, as SamplingParams fields. "llama.cpp": its command
# line's defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8); llama.cpp applies them in
# its own order (temperature last), nanoserve in vLLM's (temperature first): the same work.
SAMPLING_LAWS = {"greedy": dict(temperature=0.0),
                 "llama.cpp": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)}


@dataclass(frozen=True)
class DecodeWorkload:
    """The e2e and headline suites' run: every weight format x mode x batch decodes the same
    ``prompt_len``-token prompts for ``new_tokens`` greedy tokens, beside the peers asked for."""

    model: str = DEFAULT_MODEL
    weights: tuple[str, ...] = WEIGHT_FORMATS
    modes: tuple[str, ...] = MODES
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 32
    new_tokens: int = 128
    transformers: bool = True
    llama_cpp: bool = True
    threads: int = field(default_factory=torch.get_num_threads)
    # llama.cpp's weight repacking: "both" runs its defaults (repacked) and unrepacked side by side,
    # "auto" its defaults alone; either falls back to unrepacked, saying so, where repacking crashes.
    llama_repack: str = "both"
    kv_cache_bytes: int | None = None
    kv_cache_types: tuple[str, ...] = ("auto",)  # an engine arm per K/V cache type
    sampling: str = "greedy"  # a name in SAMPLING_LAWS: every system samples by it, with its own sampler

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + 1


def formats_for(model: str, chosen: tuple[str, ...] | None, every: tuple[str, ...]) -> tuple[str, ...]:
    """The weight formats a run measures: those chosen, else ``every`` for the default model and
    ``auto`` (the file's blocks as it stores them) for another, where the question is how
    nanoserve runs that file."""
    if chosen:
        return chosen
    return every if model == DEFAULT_MODEL else ("auto",)


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` distinct prompts of random token ids (ids 0-2 left out: special tokens)."""
    generator = torch.Generator().manual_seed(seed + batch)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def text_prompt(tokenizer, length: int) -> list[int]:
    """The first ``length`` tokens of the fidelity text (repeated if it is shorter)."""
    ids = tokenizer.encode(FIDELITY_TEXT.read_text())
    return (ids * (length // len(ids) + 1))[:length]


# --- arguments and file names --------------------------------------------------------------------

def int_list(text: str) -> tuple[int, ...]:
    """"1,8,32" -> (1, 8, 32)."""
    return tuple(int(x) for x in text.split(",") if x)


def name_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A parser of comma-separated names, each one of ``choices``."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.split(",") if x)
        unknown = [x for x in names if x not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {list(choices)}")
        return names
    return parse


def add_output_options(parser: argparse.ArgumentParser, plot: bool = True) -> None:
    """--out (the folder), --tag (a suffix for the file names) and, where a suite draws, --no-plot."""
    parser.add_argument("--out", type=Path, default=RUNS,
                        help="folder for the results (default: compile/results/runs, which git ignores; "
                             "--out compile/results rewrites the committed reference figures)")
    parser.add_argument("--tag", default="", help="suffix for the output files (e.g. the forced kernel tier)")
    if plot:
        parser.add_argument("--no-plot", action="store_true")


def result_stem(suite: str, model: str = DEFAULT_MODEL, tag: str = "") -> str:
    """The results' file name without extension: the suite, then the model's file stem when it is
    not the default model (so a user's file never overwrites the default's figures), then the tag."""
    parts = [suite]
    if model != DEFAULT_MODEL:
        parts.append(Path(model).expanduser().resolve().name.removesuffix(".gguf"))
    if tag:
        parts.append(tag)
    return "-".join(parts)


# --- timing and the host -------------------------------------------------------------------------

def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, a GPU synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls."""
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_description() -> dict:
    """What a recorded figure ran on: the CPU's model name, nanoserve's kernel tier and the
    compute dtype that tier uses (the kernels detect features through cpuid, not this name)."""
    from nanoserve.model.quant import cpu_kernels

    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith(("model name", "Model"))]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    tier = cpu_kernels.resolve_tier()
    return dict(cpu=cpu, kernels=tier, dtype=str(cpu_kernels.compute_dtype(tier)).removeprefix("torch."))


# --- tables, CSVs and plots ----------------------------------------------------------------------

def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain aligned table of ``columns`` (floats to 3 decimals, or 3 significant digits below 0.1)."""
    def cell(value) -> str:
        if isinstance(value, float):
            if 0 < abs(value) < 0.1:  # a KL divergence of 0.0004 must not print as 0.000
                return f"{value:.3g}"
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)
    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """Every key of every row a column, in the order first seen."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """matplotlib's pyplot drawing to files only (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_results(rows: Sequence[dict], out: Path, stem: str,
                  plot: Callable[[Sequence[dict], Path], None] | None = None) -> list[Path]:
    """``out/stem.csv`` and, with ``plot``, ``out/stem.png``; says what it wrote."""
    written = [out / f"{stem}.csv"]
    write_csv(rows, written[0])
    if plot is not None:
        written.append(out / f"{stem}.png")
        plot(rows, written[1])
    print("wrote " + ", ".join(str(path) for path in written))
    return written


def add_tier_options(parser: argparse.ArgumentParser) -> None:
    """--threads and --tier, for suites that time the kernels themselves."""
    from nanoserve.model.quant import cpu_kernels

    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tier", default="auto", choices=[c for c in cpu_kernels.CHOICES if c != "torch"])


def apply_tier_options(args: argparse.Namespace) -> str:
    """Sets torch's threads where asked; the kernel tier the run uses."""
    from nanoserve.model.quant import cpu_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    return cpu_kernels.resolve_tier(args.tier)
