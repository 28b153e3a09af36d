"""slotbench counts cells exactly and tabulates planning (a benchmark is never a timed test: counts and
shapes, not clocks)."""

from __future__ import annotations

import csv

import pytest
import torch

import compilebench
from compile import slotbench
from compile.slot_planning import COLUMNS, PlanningRun, format_planning, measure_planning, planning_verdict
from compile.slotbench import (
    SlotWorkload,
    incremental_cells,
    rebuilt_cells,
    run_loop_append,
    run_rebuild,
    run_table,
)
from nanoserve import build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.worker.gates import check_slots_agree


@pytest.mark.parametrize("steps,rebuilt,written", [(8, 656, 96), (64, 12_416, 320), (128, 41_216, 576),
                                                   (512, 558_080, 2_112)])
def test_cell_counts_match_the_seed(steps, rebuilt, written):
    assert rebuilt_cells(4, 16, steps) == rebuilt
    assert incremental_cells(4, 16, steps) == written


@pytest.mark.parametrize("steps", [8, 64])
def test_arms_count_the_seeds_cells(steps):
    work = SlotWorkload(steps=steps)
    assert run_rebuild(work).cells == rebuilt_cells(4, 16, steps)
    assert run_table(work, "window").cells == incremental_cells(4, 16, steps)
    assert run_table(work, "gather").cells == incremental_cells(4, 16, steps)
    assert run_loop_append(work).cells == incremental_cells(4, 16, steps)


def test_512_steps_rebuild_558080_cells_and_the_table_writes_2112():
    work = SlotWorkload(steps=512)
    assert run_rebuild(work).cells == 558_080
    assert run_table(work, "window").cells == 2_112


def test_arms_end_on_the_same_plan():
    work = SlotWorkload(steps=40)
    rebuild, window, gather = run_rebuild(work), run_table(work, "window"), run_table(work, "gather")
    assert window.plan.is_window and not gather.plan.is_window
    assert gather.plan.rows == (1, 3, 5, 7)
    for plan in (window.plan, gather.plan, run_loop_append(work).plan):
        assert torch.equal(plan.context_lens, rebuild.plan.context_lens)
        assert torch.equal(plan.positions, rebuild.plan.positions)
        assert plan.slot_mapping.shape == rebuild.plan.slot_mapping.shape == (4, 56)


def test_measure_reports_every_column():
    row = slotbench.measure(SlotWorkload(steps=4), repeats=1)
    assert row["cells_rebuilt"] == rebuilt_cells(4, 16, 4) and row["cells_written"] == incremental_cells(4, 16, 4)
    assert row["speedup"] == pytest.approx(row["rebuild_ms"] / row["window_ms"])


def test_verdict_reports_the_ratios_with_no_target():
    rows = [{"steps": 64, "window_us_per_step": 10.0, "speedup": 3.0},
            {"steps": 512, "window_us_per_step": 12.0, "speedup": 31.0, "speedup_best": 33.0,
             "speedup_min": 25.0, "speedup_max": 35.0}]
    assert slotbench.verdict(rows) == [
        "window vs rebuild at 512 steps: 31.0x median; best run vs best run 33.0x; per repeat 25.0-35.0x",
        "window per step, 512 vs 64 steps: 1.20x"]


def test_compilebench_runs_the_slots_suite_and_writes_results(tmp_path, capsys):
    argv = ["slots", "--steps", "4", "8", "--repeats", "1", "--out", str(tmp_path), "--no-planning"]
    assert compilebench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "slotbench.csv").open()))
    assert [int(r["steps"]) for r in rows] == [4, 8]
    assert [int(r["cells_written"]) for r in rows] == [80, 96]
    assert (tmp_path / "slotbench.png").stat().st_size > 0
    assert not (tmp_path / "slots_planning.csv").exists()
    assert "cells rebuilt -> written" in capsys.readouterr().out


def test_planning_table_has_one_row_per_row_count_and_leaves_the_addressing_right():
    engine = build_engine(random_model(tiny_config()), max_batch_size=4, max_model_len=64)
    run = PlanningRun(row_counts=(1, 4, 2), context=5, steps=3, warmup=1)
    results = measure_planning(engine, run)
    assert [list(r) for r in results] == [COLUMNS] * 3
    assert [r["rows"] for r in results] == [1, 4, 2] and {r["context"] for r in results} == {5}
    assert all(r["plan_us"] > 0 and r["plan_hot_us"] > 0 and r["step_ms"] > 0 and r["plan_share_pct"] > 0
               for r in results)
    # The last row count's rows took the warm-up, then two planning steps and a decode step per timed round.
    assert [engine.scheduler.blocks.num_tokens(row) for row in range(4)] == [5 + 1 + 3 * 3] * 2 + [0, 0]
    check_slots_agree(engine.worker.cache.slot_table, engine.scheduler.blocks.tables, range(2))
    table = format_planning(results).splitlines()
    assert table[0].split() == ["rows", "context", "planning", "hot", "eager", "step", "share"] and len(table) == 4


def test_planning_verdict_names_the_share_at_32_rows_against_the_bar():
    results = [{"rows": 8, "plan_share_pct": 5.0}, {"rows": 32, "plan_share_pct": 0.25}]
    assert planning_verdict(results) == ["planning at 32 rows: 0.25% of the eager step (within the 2% bar)"]
    assert planning_verdict([{"rows": 32, "plan_share_pct": 2.5}]) == [
        "planning at 32 rows: 2.50% of the eager step (over the 2% bar)"]
    assert planning_verdict(results[:1]) == []


def test_planning_refuses_a_compiled_engine():
    engine = build_engine(random_model(tiny_config()), max_batch_size=2, max_model_len=32, compile=True,
                          compile_backend="eager")
    with pytest.raises(ValueError, match="eager step"):
        measure_planning(engine, PlanningRun(row_counts=(1,), context=2, steps=1))


def test_compilebench_slots_writes_the_planning_csv(tmp_path, tiny_llama_dir, capsys):
    argv = ["slots", "--steps", "4", "--repeats", "1", "--no-plot", "--out", str(tmp_path), "--model",
            str(tiny_llama_dir), "--plan-rows", "1,3", "--plan-steps", "2", "--context", "4", "--device", "cpu"]
    assert compilebench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / f"slots_planning-{tiny_llama_dir.name}.csv").open()))
    assert [list(r) for r in rows] == [COLUMNS] * 2 and [int(r["rows"]) for r in rows] == [1, 3]
    assert "planning per decode step vs the eager step" in capsys.readouterr().out


def test_compilebench_names_its_suites_and_refuses_unknown_ones(capsys):
    assert compilebench.main(["--help"]) == 0
    assert "slots" in capsys.readouterr().out
    assert compilebench.main(["nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
