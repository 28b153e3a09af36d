"""A benchmark run leaves the checkout clean: every suite writes under compile/results/runs/,
which git ignores, while the committed reference figures in compile/results/ stay tracked."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

import compilebench
from compile.common import RESULTS, RUNS, add_output_options

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(autouse=True)
def in_a_git_checkout():
    if shutil.which("git") is None or git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("not a git checkout")


def test_a_suites_default_output_folder_is_ignored_by_git():
    parser = argparse.ArgumentParser()
    add_output_options(parser)
    out = parser.parse_args([]).out
    assert out == RUNS
    for name in ("headline.csv", "headline.png", "e2e-SmolLM2-135M-Instruct.Q4_K_M-avx2.csv"):
        assert git("check-ignore", "-q", str(out / name)).returncode == 0, name


def test_the_committed_reference_figures_stay_tracked_and_are_not_ignored():
    for name in ("headline.csv", "headline.png", "NOTES.md"):
        path = RESULTS / name
        assert git("ls-files", "--error-unmatch", str(path)).returncode == 0, name
        assert git("check-ignore", "-q", str(path)).returncode == 1, name


@pytest.mark.parametrize("suite", sorted(compilebench.SUITES))
def test_every_suite_writes_to_the_ignored_folder_by_default(suite, capsys):
    with pytest.raises(SystemExit):
        compilebench.SUITES[suite](["--help"])
    assert "(default: compile/results/runs, which git ignores" in " ".join(capsys.readouterr().out.split())
