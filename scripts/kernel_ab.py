"""Two builds of the CPU kernels against each other in one process: the working tree's and another
revision's (``--base``, default HEAD), both tier libraries loaded side by side and called
alternately, so that a shared VM's phases (its memory reading at half speed for tens of seconds,
then at full speed) fall on both arms alike, which one process per arm, minutes apart, cannot
promise. For a model file: first whether the arms give the same bits (else their largest
difference), then each distinct linear shape (called again and again: its weights stay in the
last-level cache where they fit) and a whole pass of the model's products (streamed from memory),
at each ``--rows``. Per arm the median time, and the median over rounds of new / base; a pass
also times a read beside each round (compile/floor.py's), and gives new / base again over the
rounds whose read was the faster half. With ``--contexts``, the model's decode attention
instead: one step's read at each context length and row count, every layer its own K/V cells
in the model's dtype on huge pages, each row's cells in runs of 16 slots, as the engine's paged
pool lays them out.

With ``--set NAME=VALUE`` (repeatable) the new arm is the working tree's kernels with the
constant ``constexpr ... NAME`` given VALUE, so a tuning constant (a prefetch distance) is
compared with HEAD's value without editing the source.

    PYTHONPATH=. python scripts/kernel_ab.py MODEL.gguf [--base REV] [--rows 1,8] [--x-bits 8]
        [--rounds 60] [--pass-rounds 200] [--contexts 512,2048] [--tier avx2] [--set NAME=VALUE]
        [--out DIR] [--tag WHAT]

Prints a table and writes kernel-ab-<model>[-WHAT].csv under --out (default compile/results/runs).
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from compile.common import (
    RUNS,
    add_tier_options,
    apply_tier_options,
    format_table,
    host_description,
    int_list,
    write_results,
)
from compile.floor import SAMPLE_BYTES, packed_read_bytes, read_buffer
from nanoserve.model.quant import cpu_kernels
from nanoserve.worker.huge_pages import zeros_on_huge_pages

COLUMNS = ["what", "rows", "x_bits", "base_us", "new_us", "new_over_base", "same_bits", "read_gb_s",
           "new_over_base_fast_reads"]


def kernels_at(revision: str, into: Path) -> Path:
    """The kernel sources as ``revision`` holds them, extracted under ``into``."""
    relative = cpu_kernels.KERNELS.relative_to(Path(__file__).resolve().parent.parent)
    archive = subprocess.run(["git", "archive", revision, str(relative)], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / relative


def with_constants(kernels: Path, settings: list[str], into: Path) -> Path:
    """A copy of the kernel sources under ``into`` with each NAME=VALUE of ``settings`` given to
    the one ``constexpr <type> NAME = ...;`` that defines it."""
    shutil.copytree(kernels, into)
    for setting in settings:
        name, _, value = setting.partition("=")
        pattern = re.compile(rf"(constexpr\s+\w+\s+{re.escape(name)}\s*=\s*)[^;]+;")
        texts = {f: f.read_text() for f in sorted(into.iterdir())}
        hits = {f: len(pattern.findall(text)) for f, text in texts.items()}
        if not value or sum(hits.values()) != 1:
            raise SystemExit(f"--set {setting}: no single constexpr {name} in {kernels} to give a value")
        source = next(f for f, n in hits.items() if n)
        source.write_text(pattern.sub(rf"\g<1>{value};", texts[source]))
    return into


def product(m, x: torch.Tensor, handle: int, x_bits: int) -> torch.Tensor:
    """``x @ m``'s weight through the tier library ``handle``."""
    return torch.ops.nanoserve.group_mm(x, m.codes, m.scales, m.mins, m.zero_point, handle, x_bits)


def one_pass(linears: list, inputs: dict[int, torch.Tensor], handle: int, x_bits: int) -> None:
    """Every packed linear of a model once, as a decode step calls them."""
    for m in linears:
        product(m, inputs[m.in_features], handle, x_bits)


def product_rows(linears: list, dtype: torch.dtype, handles: dict[str, int], rows_list, x_bits: int, rounds: int,
                 pass_rounds: int, host: dict) -> list[dict]:
    """Each distinct linear shape alone, then a whole pass of the products with a read beside each
    round, base against new, per row count."""
    read = read_buffer(SAMPLE_BYTES)
    results = []
    shapes = {(m.in_features, m.out_features, m.codes.dtype, m.codes.nbytes): m for m in linears}
    for rows in rows_list:
        for (k, n, _, nbytes), m in shapes.items():
            x = torch.randn(rows, k, dtype=dtype)
            base, new = (product(m, x, handles[arm], x_bits) for arm in ("base", "new"))
            same = "yes" if torch.equal(base, new) else f"max diff {(base - new).abs().max().item():.3g}"
            calls = {arm: functools.partial(product, m, x, handle, x_bits) for arm, handle in handles.items()}
            seconds, _ = interleaved(calls, rounds)
            results.append(dict(host, **row(f"{k} x {n} ({nbytes / 1e6:.1f} MB)", rows, x_bits, seconds, same)))
            print(progress(results[-1]))
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in linears}}
        calls = {arm: functools.partial(one_pass, linears, inputs, handle, x_bits) for arm, handle in handles.items()}
        seconds, reads = interleaved(calls, pass_rounds, read)
        nbytes = sum(map(packed_read_bytes, linears))
        results.append(dict(host, **row(f"pass ({nbytes / 1e6:.0f} MB)", rows, x_bits, seconds, "", reads,
                                        read.nbytes)))
        print(progress(results[-1]))
    return results


def attention_step(layers: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, slots: torch.Tensor,
                   lens: torch.Tensor, handle: int) -> None:
    """One decode step's attention: every layer's read of its own cells."""
    for k, v in layers:
        torch.ops.nanoserve.decode_attention(q, k, v, slots, lens, q.shape[-1] ** -0.5, handle)


def attention_rows(config, dtype: torch.dtype, handles: dict[str, int], rows_list, contexts, rounds: int,
                   host: dict) -> list[dict]:
    """decode_attention of the model's shape, base against new, per context and row count."""
    results = []
    block = 16  # cells a block of slots: a row's cells lie in runs of this many
    for context in contexts:
        for rows in rows_list:
            cells = rows * context
            nbytes = 2 * cells * config.num_kv_heads * config.head_dim * dtype.itemsize * config.num_layers
            if nbytes > 2e9:
                print(f"context {context}, {rows} rows: over 2 GB of cells, skipped")
                continue
            shape = (cells + block, config.num_kv_heads, config.head_dim)
            pool = zeros_on_huge_pages([(shape, dtype)] * 2 * config.num_layers)  # as the engine's pool
            pool = pool or [torch.empty(shape, dtype=dtype) for _ in range(2 * config.num_layers)]
            for cells_ in pool:
                cells_.copy_(torch.randn(shape))
            layers = list(zip(pool[::2], pool[1::2]))
            order = torch.randperm(cells // block + 1, generator=torch.Generator().manual_seed(context))
            runs = (order[:, None] * block + torch.arange(block)).flatten()[:cells]
            slots = runs.view(rows, context).contiguous()
            lens = torch.full((rows,), context, dtype=torch.long)
            q = torch.randn(rows, config.num_heads, config.head_dim, dtype=dtype)
            base, new = (torch.ops.nanoserve.decode_attention(q, *layers[0], slots, lens, config.head_dim ** -0.5,
                                                              handles[arm]) for arm in ("base", "new"))
            same = "yes" if torch.equal(base, new) else f"max diff {(base - new).abs().max().item():.3g}"
            calls = {arm: functools.partial(attention_step, layers, q, slots, lens, handle)
                     for arm, handle in handles.items()}
            seconds, _ = interleaved(calls, rounds)
            results.append(dict(host, **row(f"attention, context {context} ({nbytes / 1e6:.0f} MB of cells)", rows,
                                            "", seconds, same)))
            print(progress(results[-1]))
    return results


def interleaved(arms: dict[str, object], rounds: int, read: torch.Tensor | None = None
                ) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per call of each arm's callable, after one call each: the arms alternating, in
    reverse order every other round (a call can warm the cache for the one after it); with
    ``read`` (a read_buffer), the seconds of one sum of it after each round."""
    for call in arms.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    reads: list[float] = []
    for round_ in range(rounds):
        for name, call in (list(arms.items()) if round_ % 2 == 0 else reversed(arms.items())):
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
        if read is not None:
            started = time.perf_counter()
            read.sum()
            reads.append(time.perf_counter() - started)
    return seconds, reads


def row(what: str, rows: int, x_bits: int, seconds: dict[str, list[float]], same: str,
        reads: list[float] = (), read_bytes: int = 0) -> dict:
    """One line of the table; with the reads beside each round, their median rate and new / base
    over the rounds whose read was at or above the median (a VM whose memory runs at two speeds
    shows there what a change does when the products, not the memory, set the pace)."""
    ratios = [new / base for base, new in zip(seconds["base"], seconds["new"])]
    result = dict(what=what, rows=rows, x_bits=x_bits, base_us=statistics.median(seconds["base"]) * 1e6,
                  new_us=statistics.median(seconds["new"]) * 1e6, new_over_base=statistics.median(ratios),
                  same_bits=same, read_gb_s="", new_over_base_fast_reads="")
    if reads:
        rates = [read_bytes / r / 1e9 for r in reads]
        middle = statistics.median(rates)
        result.update(read_gb_s=middle,
                      new_over_base_fast_reads=statistics.median(q for q, r in zip(ratios, rates) if r >= middle))
    return result


def progress(result: dict) -> str:
    return (f"{result['what']}, {result['rows']} row(s): new / base {result['new_over_base']:.3f}"
            + (f", same bits: {result['same_bits']}" if result["same_bits"] else "")
            + (f", reads {result['read_gb_s']:.1f} GB/s, new / base where faster "
               f"{result['new_over_base_fast_reads']:.3f}" if result["read_gb_s"] else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are the base arm")
    parser.add_argument("--rows", type=int_list, default=(1, 8))
    parser.add_argument("--x-bits", type=int, choices=(8, 16), default=8)
    parser.add_argument("--rounds", type=int, default=60, help="rounds of each shape alone")
    parser.add_argument("--pass-rounds", type=int, default=200,
                        help="rounds of whole passes (a 2-core VM's memory phases last 10-30 s: 1000 spans some)")
    parser.add_argument("--contexts", type=int_list, default=(),
                        help="time the model's decode attention at these context lengths instead of its products")
    parser.add_argument("--out", type=Path, default=RUNS)
    parser.add_argument("--tag", default="", help="appended to the CSV's name: what the new arm changes")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="the new arm's kernels with this constexpr constant changed (repeatable)")
    add_tier_options(parser)
    args = parser.parse_args()
    tier = apply_tier_options(args)
    if tier not in cpu_kernels.TIERS:
        parser.error(f"tier {tier!r} builds no library of ours to compare")
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"base": cpu_kernels._build(cpu_kernels.TIERS[tier], kernels_at(args.base, Path(tmp))),
                 "new": cpu_kernels._build(cpu_kernels.TIERS[tier], with_constants(cpu_kernels.KERNELS, args.set,
                                                                                   Path(tmp) / "new")
                                           if args.set else cpu_kernels.KERNELS)}
    if paths["base"] == paths["new"]:
        print(f"the working tree's kernels are {args.base}'s: an A/A run (how far apart two equal arms fall)")
    handles = {name: torch.ops.nanoserve.load_tier(str(path)) for name, path in paths.items()}

    from nanoserve.engine import build_engine
    from nanoserve.model.quant.linear import GroupLinear
    model = build_engine(args.model, max_batch_size=1, max_model_len=256, compile=False).model
    linears = [m for m in model.modules() if isinstance(m, GroupLinear) and m.handle is not None]
    if not linears and not args.contexts:
        parser.error(f"{args.model} has no packed linear for the kernels to multiply")
    dtype = model.norm.weight.dtype

    host = dict(host_description(), kernels=tier, model=Path(args.model).name, base=args.base,
                new=" ".join(args.set) or "working tree")
    print(f"{host['cpu']}, {tier}, {dtype}; base {args.base} ({paths['base'].name}), new ({paths['new'].name})")
    if args.contexts:
        results = attention_rows(model.config, dtype, handles, args.rows, args.contexts, args.rounds, host)
    else:
        results = product_rows(linears, dtype, handles, args.rows, args.x_bits, args.rounds, args.pass_rounds, host)
    print(format_table(results, COLUMNS))
    write_results(results, args.out, "-".join(filter(None, ["kernel-ab", Path(args.model).stem, args.tag])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
