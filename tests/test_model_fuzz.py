"""The model-file fuzzer (tests/model_fuzz.py) in the suite: mutated GGUF files and Hugging Face
directories each load and generate, or are refused in one line naming the file. Each run is a
child process bounded in time and memory. The suite draws the same quick sample every run;
NANOSERVE_HYPOTHESIS=long draws many more, new ones each run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

# Cases per run: a quick sample in the suite, a long exploration on request.
EXAMPLES = {"ci": {"gguf": 60, "hf": 40}, "long": {"gguf": 2000, "hf": 1000}}
ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("files", ["gguf", "hf"])
def test_mutated_model_files_load_or_are_refused_naming_the_file(files):
    profile = os.environ.get("NANOSERVE_HYPOTHESIS", "ci")
    examples = EXAMPLES.get(profile, EXAMPLES["ci"])[files]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [files, str(examples)] + (["--derandomize"] if profile != "long" else [])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "model_fuzz.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60 + examples * 5)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(summary)  # the count of distinct mutations tried, shown with -s
    assert summary["examples"] == examples
    assert summary["outcomes"].get("refused", 0) > 0 and summary["outcomes"].get("loaded", 0) > 0
