"""slotbench: the persistent slot table against a per-step rebuild, and what planning costs a step
(`python compilebench.py slots`).

Cells (host only, no weights). `rows` rows decode `steps` tokens after a `prompt`-token
prompt, and every arm produces the same DecodePlan fields each step:

  rebuild      grow each block table by one token, then rebuild_mapping (one slot() call
               per cell) and lists -> tensors for the other fields.
  loop_append  the first append step the table had: the same persistent table, appended
               through a Python loop over rows and four small tensors built from lists.
  window       BlockManager.advance + KVCache.plan_decode over rows 0..n-1: appends to the SlotTable
               and reads a view of it.
  gather       the same over scattered rows: the read is a copy (what a scheduler that does
               not keep its rows a prefix gets).

Each timed region includes the prompt (the rebuild arm allocates it; the table arms also
resync it). Arms run interleaved, `repeats` times; the table quotes medians and the ratio
of best runs (on a shared machine the table arm, all small numpy/torch calls, is the one
interference hurts). Each timed run has the garbage collector off, as timeit does, and no
collection is forced before it: the run after a full collection pays to refill the
interpreter's free lists, which a decode loop does not pay every few hundred steps.
Cells are exact counts: cells the rebuild built vs cells the table wrote (resynced + appended).
The window/rebuild ratio is reported with no target.

Planning (compile/slot_planning.py): per decode step at 1, 8, 32 and 64 rows, the
addressing (the block manager's `advance` and the worker cache's `plan_decode`) next to the whole eager decode
step of the default model, measured in the same run (slots_planning.csv).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compile.common import add_output_options, int_list, pyplot, result_stem, save_figure, write_results
from compile.slot_planning import PlanningRun, format_planning, measure_planning, planning_verdict
from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.blocks import BlockPool, BlockTable
from nanoserve.cache.gates import GateError
from nanoserve.worker.gates import check_plan_addressing
from nanoserve.worker.kv_cache import DecodePlan, KVCache
from nanoserve.worker.plan import DecodeBatch
from nanoserve.worker.slot_table import RowsLike, SlotTable, rebuild_mapping

BLOCK_SIZE = 16
MAX_BATCH_SIZE = 8
ARMS = ("rebuild", "loop_append", "window", "gather")


@dataclass(frozen=True)
class SlotWorkload:
    """`rows` rows decode `steps` tokens after a `prompt`-token prompt (host only, no weights)."""

    rows: int = 4
    prompt: int = 16
    steps: int = 512

    @property
    def max_model_len(self) -> int:
        return self.prompt + self.steps

    @property
    def num_blocks(self) -> int:
        # Every row's blocks plus the cache's scratch block.
        return self.rows * -(-self.max_model_len // BLOCK_SIZE) + 1

    def row_ids(self, arm: str) -> list[int]:
        if arm == "gather":  # every other row: never a prefix
            return list(range(1, 2 * self.rows, 2))
        return list(range(self.rows))


def incremental_cells(rows: int, prompt_len: int, steps: int) -> int:
    """Cells the persistent table writes: each prompt resynced once, then one cell per row per step."""
    return rows * prompt_len + rows * steps


def rebuilt_cells(rows: int, prompt_len: int, steps: int) -> int:
    """Cells a per-step rebuild writes: a [rows, context] rectangle every step, context growing by one."""
    return rows * sum(prompt_len + step for step in range(1, steps + 1))


class CellCount:
    """The cells a SlotTable writes from now on: wraps that one table's `write_cells` (cells
    appended) and `adopt` (a row's cells rewritten whole: a resync)."""

    def __init__(self, table: SlotTable) -> None:
        self.appended_cells = self.resynced_cells = self.resyncs = 0
        write_cells, adopt = table.write_cells, table.adopt

        def counted_write_cells(rows: RowsLike, columns: torch.Tensor, slots: torch.Tensor) -> None:
            write_cells(rows, columns, slots)
            self.appended_cells += len(slots)

        def counted_adopt(row: int, slots: torch.Tensor) -> None:
            adopt(row, slots)
            self.resynced_cells += len(slots)
            self.resyncs += 1

        table.write_cells, table.adopt = counted_write_cells, counted_adopt  # type: ignore[method-assign]


def check_appends_incremental(count: CellCount, rows: int, steps: int) -> None:
    """A table counted from fresh that took `rows` prompts and `steps` decode steps appended
    exactly one cell per row per step and resynced each row once (its prompt): never rebuilt."""
    if count.appended_cells == rows * steps and count.resyncs == rows:
        return
    raise GateError(f"{steps} steps over {rows} rows appended {count.appended_cells} cells with {count.resyncs} "
                    f"resyncs; an incremental table appends exactly {rows * steps} with {rows} (one per prompt). "
                    "Cache side: something resynced rows between decode steps instead of appending to them.")


@dataclass(frozen=True)
class ArmRun:
    seconds: float
    cells: int
    plan: DecodePlan


def grow_by_one(tables: dict[int, BlockTable], pool: BlockPool, rows: Sequence[int]) -> list[int]:
    """Each row's block table takes one more token; returns the new lengths."""
    for row in rows:
        table = tables[row]
        if table.num_tokens == table.capacity:
            table.add_blocks(pool.allocate(1))
        table.advance(1)
    return [tables[row].num_tokens for row in rows]


def rebuild_plan(tables: dict[int, BlockTable], pool: BlockPool, rows: Sequence[int]) -> DecodePlan:
    """A decode step that rebuilds every address from the block tables."""
    lengths = grow_by_one(tables, pool, rows)
    return DecodePlan(
        rows=tuple(rows),
        slot_mapping=rebuild_mapping(tables, rows),
        context_lens=torch.tensor(lengths),
        total_context=sum(lengths),
        write_slots=torch.tensor([tables[row].slot(n - 1) for row, n in zip(rows, lengths)]),
        positions=torch.tensor([n - 1 for n in lengths]),
        is_window=False,
    )


def loop_append_plan(tables: dict[int, BlockTable], pool: BlockPool, table: SlotTable, rows: list[int]) -> DecodePlan:
    """The first append step: a loop over rows and list-built tensors, then a read."""
    lengths = grow_by_one(tables, pool, rows)
    write_slots = torch.tensor([tables[row].slot(n - 1) for row, n in zip(rows, lengths)])
    positions = torch.tensor([n - 1 for n in lengths])
    index = torch.tensor(rows)
    table.slots[index, positions] = write_slots
    table.lengths_array[rows] += 1
    return DecodePlan(tuple(rows), table.slots[: len(rows), : max(lengths)], torch.tensor(lengths),
                      sum(lengths), write_slots, positions, True)


def run_rebuild(work: SlotWorkload) -> ArmRun:
    rows = work.row_ids("rebuild")
    pool = BlockPool(work.num_blocks, BLOCK_SIZE)
    tables = {row: BlockTable(BLOCK_SIZE) for row in rows}
    cells = 0
    start = time.perf_counter()
    for row in rows:
        tables[row].add_blocks(pool.allocate(tables[row].blocks_needed(work.prompt)))
        tables[row].advance(work.prompt)
    for _ in range(work.steps):
        plan = rebuild_plan(tables, pool, rows)
        cells += plan.slot_mapping.numel()
    seconds = time.perf_counter() - start
    check_plan_addressing(plan, tables)
    return ArmRun(seconds, cells, plan)


def run_loop_append(work: SlotWorkload) -> ArmRun:
    rows = work.row_ids("loop_append")
    pool = BlockPool(work.num_blocks, BLOCK_SIZE)
    tables = {row: BlockTable(BLOCK_SIZE) for row in rows}
    table = SlotTable(MAX_BATCH_SIZE, work.max_model_len)
    count = CellCount(table)
    start = time.perf_counter()
    for row in rows:
        tables[row].add_blocks(pool.allocate(tables[row].blocks_needed(work.prompt)))
        tables[row].advance(work.prompt)
        table.adopt(row, rebuild_mapping([tables[row]], [0])[0])
    for _ in range(work.steps):
        plan = loop_append_plan(tables, pool, table, rows)
    seconds = time.perf_counter() - start
    check_plan_addressing(plan, tables)
    return ArmRun(seconds, count.resynced_cells + work.rows * work.steps, plan)


def run_table(work: SlotWorkload, arm: str) -> ArmRun:
    """The engine's split: the block manager advances the rows, the worker's cache addresses the step."""
    blocks = BlockManager(work.num_blocks, BLOCK_SIZE, MAX_BATCH_SIZE, work.max_model_len)
    cache = KVCache(1, 1, 1, work.num_blocks, BLOCK_SIZE, MAX_BATCH_SIZE, blocks.max_model_len, blocks.scratch_slot)
    rows = work.row_ids(arm)
    count = CellCount(cache.slot_table)
    start = time.perf_counter()
    for row in rows:
        blocks.grow(row, work.prompt)
        cache.adopt(row, torch.tensor(blocks.slots_of(row, work.prompt)))
    n = len(rows)
    for _ in range(work.steps):
        positions, slots = blocks.advance(rows)
        plan = cache.plan_decode(DecodeBatch(("",) * n, tuple(rows), (0,) * n, tuple(positions), tuple(slots), n,
                                             max(positions) + 1))
    seconds = time.perf_counter() - start
    check_plan_addressing(plan, blocks.tables)
    check_appends_incremental(count, work.rows, work.steps)
    return ArmRun(seconds, count.resynced_cells + count.appended_cells, plan)


RUNNERS: dict[str, Callable[[SlotWorkload], ArmRun]] = {
    "rebuild": run_rebuild,
    "loop_append": run_loop_append,
    "window": lambda work: run_table(work, "window"),
    "gather": lambda work: run_table(work, "gather"),
}


def measure(work: SlotWorkload, repeats: int) -> dict[str, float | int]:
    """Median seconds per arm over interleaved repeats, plus the exact cell counts."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cells: dict[str, int] = {}
    for repeat in range(repeats):
        turn = repeat % len(ARMS)
        for arm in ARMS[turn:] + ARMS[:turn]:  # rotate the order: no arm always runs first
            gc.disable()  # as timeit does: no collection inside a timed run, none forced before it
            try:
                result = RUNNERS[arm](work)
            finally:
                gc.enable()
            times[arm].append(result.seconds)
            cells[arm] = result.cells
    medians = {arm: statistics.median(times[arm]) for arm in ARMS}
    # Each repeat ran all three arms back to back: its own ratio shows how much the machine moved.
    ratios = [r / w for r, w in zip(times["rebuild"], times["window"])]
    return {
        "steps": work.steps,
        "rebuild_ms": medians["rebuild"] * 1e3,
        "loop_append_ms": medians["loop_append"] * 1e3,
        "window_ms": medians["window"] * 1e3,
        "gather_ms": medians["gather"] * 1e3,
        "speedup": medians["rebuild"] / medians["window"],
        "loop_append_speedup": medians["rebuild"] / medians["loop_append"],
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
        # Best runs against best runs: what each arm costs when nothing else on the machine interferes.
        "speedup_best": min(times["rebuild"]) / min(times["window"]),
        "loop_append_us_per_step": medians["loop_append"] * 1e6 / work.steps,
        "window_us_per_step": medians["window"] * 1e6 / work.steps,
        "gather_us_per_step": medians["gather"] * 1e6 / work.steps,
        "cells_rebuilt": cells["rebuild"],
        "cells_written": cells["window"],
    }


def format_table(results: list[dict]) -> str:
    lines = [f"{'steps':>6} {'rebuild':>11} {'loop':>10} {'window':>10} {'gather':>10} {'speedup':>8} "
             f"{'best/best':>10} {'loop':>7} {'window/step':>12} {'cells rebuilt -> written':>26}"]
    for r in results:
        lines.append(
            f"{r['steps']:>6} {r['rebuild_ms']:>9.3f}ms {r['loop_append_ms']:>8.3f}ms {r['window_ms']:>8.3f}ms "
            f"{r['gather_ms']:>8.3f}ms {r['speedup']:>7.2f}x {r['speedup_best']:>9.2f}x {r['loop_append_speedup']:>6.2f}x "
            f"{r['window_us_per_step']:>10.2f}us {r['cells_rebuilt']:>13,} -> {r['cells_written']:>6,}"
        )
    return "\n".join(lines)


def verdict(results: list[dict]) -> list[str]:
    """What the sweep says at 512 steps (where the cell counts were first measured) and how the window's per-step cost grows."""
    by_steps = {r["steps"]: r for r in results}
    lines = []
    if 512 in by_steps:
        r = by_steps[512]
        lines.append(f"window vs rebuild at 512 steps: {r['speedup']:.1f}x median; best run vs best run "
                     f"{r['speedup_best']:.1f}x; per repeat {r['speedup_min']:.1f}-{r['speedup_max']:.1f}x")
    if 512 in by_steps and 64 in by_steps:
        ratio = by_steps[512]["window_us_per_step"] / by_steps[64]["window_us_per_step"]
        lines.append(f"window per step, 512 vs 64 steps: {ratio:.2f}x")
    return lines


def write_plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    steps = [r["steps"] for r in results]
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = dict(zip(ARMS, ("C0", "C1", "C2", "C3")))  # one colour per arm in every panel
    for arm, style in zip(ARMS, ("o-", "x--", "s-", "^-")):
        left.plot(steps, [r[f"{arm}_ms"] for r in results], style, color=colors[arm], label=arm)
    left.set(xscale="log", yscale="log", xlabel="decode steps", ylabel="ms per run (median)",
             title="addressing time per run")
    left.legend()
    mid.plot(steps, [r["loop_append_us_per_step"] for r in results], "x--", color=colors["loop_append"],
             label="loop_append (a Python loop per step)")
    mid.plot(steps, [r["window_us_per_step"] for r in results], "s-", color=colors["window"], label="window")
    mid.plot(steps, [r["gather_us_per_step"] for r in results], "^-", color=colors["gather"], label="gather")
    mid.set(xscale="log", xlabel="decode steps", ylabel="us per step", title="table arms: cost per step (prompt set-up included)", ylim=(0, None))
    mid.legend()
    right.plot(steps, [r["cells_rebuilt"] for r in results], "o-", color=colors["rebuild"], label="rebuilt (rebuild arm)")
    right.plot(steps, [r["cells_written"] for r in results], "s-", color=colors["window"], label="written (slot table)")
    right.set(xscale="log", yscale="log", xlabel="decode steps", ylabel="int64 cells", title="addressing cells")
    right.legend()
    for ax in (left, mid, right):
        ax.set_xticks(steps)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle("slotbench: persistent SlotTable vs per-step rebuild_mapping (host, 4 rows, 16-token prompt)")
    save_figure(fig, path, dpi=110)


def run_planning(args: argparse.Namespace) -> list[dict]:
    """The planning share: an eager engine on `args.model` sized for the planning run."""
    from nanoserve.engine.build import build_engine

    run = PlanningRun(args.plan_rows, args.context, args.plan_steps)
    engine = build_engine(args.model, max_batch_size=max(run.row_counts), max_model_len=run.max_model_len,
                          device=args.device, compile=False)
    print(f"\nplanning per decode step vs the eager step: {args.model} ({engine.resolved.weights}) on {args.device}, "
          f"{run.context}-token context, median of {run.steps} of each, interleaved")
    results = measure_planning(engine, run)
    print(format_planning(results))
    for line in planning_verdict(results):
        print(line)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py slots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 64, 128, 512])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--plan-rows", type=int_list, default=PlanningRun.row_counts,
                        help="row counts of the planning table, e.g. 1,8,32,64")
    parser.add_argument("--plan-steps", type=int, default=PlanningRun.steps,
                        help="timed planning steps and decode steps per row count")
    parser.add_argument("--context", type=int, default=PlanningRun.context, help="tokens per row in the planning run")
    parser.add_argument("--model", default="smollm2", help="the planning run's model: build_engine's model argument")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-planning", action="store_true", help="the cell arms only (no weights loaded)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.rows <= MAX_BATCH_SIZE // 2:
        parser.error(f"--rows must be 1..{MAX_BATCH_SIZE // 2} (the gather arm uses every other row of {MAX_BATCH_SIZE})")
    with torch.inference_mode():
        results = [measure(SlotWorkload(args.rows, args.prompt, steps), args.repeats) for steps in args.steps]
    print(f"slotbench: {args.rows} rows, {args.prompt}-token prompt, block_size {BLOCK_SIZE}, "
          f"host, torch {torch.__version__}, median of {args.repeats}")
    print(format_table(results))
    for line in verdict(results):
        print(line)
    write_results(results, args.out, result_stem("slotbench", tag=args.tag), None if args.no_plot else write_plot)
    if not args.no_planning:
        write_results(run_planning(args), args.out, result_stem("slots_planning", args.model, args.tag))
    return 0
