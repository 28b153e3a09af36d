"""The scale suite's arms and worker environments (its timings are the bench's, never a test's)."""

from __future__ import annotations

import pytest

from compile import scale
from nanoserve.model.quant import cpu_kernels


@pytest.mark.parametrize("tier", tuple(scale.TORCH_CAPS))
def test_forced_tier_caps_torch_and_keeps_its_own_inductor_cache(tier):
    env = scale.worker_env("nanoserve", tier, None)
    assert env["NANOSERVE_CPU_KERNELS"] == tier
    assert tier in cpu_kernels.TIERS
    # torch's kernels held to the tier's instructions, and graphs compiled for it kept apart
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["MKL_ENABLE_INSTRUCTIONS"].startswith("AVX2") and env["ONEDNN_MAX_CPU_ISA"].startswith("AVX2")
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith(f"inductor-{tier}")
    assert scale.worker_env("nanoserve", None, None) == {}


def test_the_peer_gets_the_other_build_on_its_path_and_nothing_forced(tmp_path):
    env = scale.worker_env("llama.cpp", "avx-vnni", tmp_path)
    assert env["PYTHONPATH"].startswith(str(tmp_path)) and "NANOSERVE_CPU_KERNELS" not in env


def test_arms_run_llama_cpp_as_its_users_do_unless_asked():
    labels = [label for _, _, label, _ in scale.arms(True, "both")]
    assert labels == ["", "defaults (repacking on)", "repacking off"]
    assert [s for s, *_ in scale.arms(False, "both", ("auto", "auto+a8"))] == ["nanoserve", "nanoserve"]


def test_batch_1_meets_a_timed_read_after_each_step():
    class Steps:  # four steps of 10 ms, the first a prefill
        def __init__(self):
            self.times = []

        @property
        def done(self):
            return len(self.times) == 4

        def step(self):
            self.times.append(0.01)

        @property
        def decode_steps(self):
            return self.times[1:]

    row = scale._batch_1(Steps(), step_bytes=1 << 20)
    assert row["step_s_b1"] == 0.01 and row["tok_s_b1"] == 100 and row["step_bytes_b1"] == 1 << 20
    assert row["x_floor_b1"] > 0 and row["floor_s_b1"] * row["x_floor_b1"] == pytest.approx(0.01)
