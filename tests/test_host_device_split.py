"""The host side and the device side share nothing but the plan: the block manager imports no
torch, a tensor-parallel rank builds a worker and nothing of the host side, the packages import
only downward, and NANOSERVE_CHECKS=1 stops a step whose plan carries a planted fault with the
gate's message."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from engine_oracle_helpers import BLOCK_BYTES, engine_for, greedy

from nanoserve.cache.gates import GateError
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = random_model(tiny_config(), seed=5)
# Lower layers first: a module may import its own package and the packages before it.
LAYERS = ["model", "cache", "worker", "distributed", "speculative", "engine", "serve"]


def test_the_block_manager_and_its_package_import_no_torch():
    code = ("import sys, nanoserve.cache, nanoserve.cache.gates; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def imported_packages(path: Path) -> set[str]:
    """The nanoserve packages a module imports (at any depth of the file), except for type hints
    alone (under ``if TYPE_CHECKING:``: nothing runs them)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found.update(name.split(".")[1] for name in names if name.startswith("nanoserve.") and name.count("."))
    return found


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package):
    allowed = set(LAYERS[:LAYERS.index(package) + 1])
    upward = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & set(LAYERS) - allowed)
              for path in (ROOT / "nanoserve" / package).rglob("*.py")}
    assert not {path: names for path, names in upward.items() if names}


RANK_SCRIPT = """
import sys
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.engine import Engine
from nanoserve.engine.scheduler import Scheduler
from nanoserve.model.formats.tokenizer import Tokenizer

built = []
for owner, name in ((Scheduler, "__init__"), (Engine, "__init__")):
    def counted(self, *args, _build=getattr(owner, name), _name=owner.__name__, **kwargs):
        built.append(_name)
        return _build(self, *args, **kwargs)
    setattr(owner, name, counted)
for name in ("from_gguf_metadata", "from_hf_dir"):
    def counted(*args, _build=getattr(Tokenizer, name), **kwargs):
        built.append("Tokenizer")
        return _build(*args, **kwargs)
    setattr(Tokenizer, name, staticmethod(counted))
try:
    engine = build_engine(sys.argv[1], tensor_parallel_size=2, weights="fp32", max_batch_size=2,
                          max_model_len=32, kv_cache_bytes=1 << 20, block_size=4)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("tokens", out[0].token_ids)
    engine.close()
finally:
    print("built", sorted(set(built)), flush=True)
"""


def test_a_tensor_parallel_rank_builds_a_worker_and_no_scheduler_tokenizer_or_engine(tmp_path, gguf_writer):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = gguf_writer(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    master = free_port()
    processes = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        processes.append(subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert not any("terminate called" in out for out in outputs), outputs
    assert "built ['Engine', 'Scheduler', 'Tokenizer']" in outputs[0] and "tokens [" in outputs[0], outputs[0]
    assert "built []" in outputs[1] and "tokens" not in outputs[1], outputs[1]


# The scripts below import nanoserve once, then fork the two ranks of a torchrun-style group: a rank
# pays no import, and leaves through the interpreter's own exit (atexit, finalization, C++
# destructors), as a torchrun-launched rank does.
TWO_RANKS = """
import faulthandler, gc, json, os, socket, sys, time
from nanoserve.engine import SamplingParams, build_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def two_ranks(rank_main, out=None):
    # rank_main(rank) in each forked rank on a fresh port, which then exits 0; out(rank): the file a
    # rank's stdout and stderr go to (None: the parent's). Returns the ranks' exit codes.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(2):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            if out is not None:
                fd = os.open(out(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
            faulthandler.enable()  # a fatal signal writes where each thread was
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank_main(rank)
            sys.exit(0)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def engine_of(model, **options):
    return build_engine(model, tensor_parallel_size=2, weights="fp32", max_batch_size=2, max_model_len=32,
                        kv_cache_bytes=1 << 20, block_size=4, compile=False, **options)
"""

# Run after run: even runs close the engine; odd ones leave it to the exit.
EXIT_RUNS = TWO_RANKS + """
model, runs, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for run in range(runs):
    def rank_main(rank):
        engine = engine_of(model)
        print("tokens", engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids, flush=True)
        if run % 2 == 0:
            engine.close()

    print("run", run, *two_ranks(rank_main, lambda rank: os.path.join(outdir, f"{run}-{rank}.txt")), flush=True)
"""
EXIT_REPEATS = 10


def _two_rank_script(tmp_path, gguf_writer, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run one of the scripts above over a tiny GGUF file (its path the script's first argument)."""
    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = gguf_writer(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    (tmp_path / "script.py").write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NANOSERVE_COMPILE="0")
    return subprocess.run([sys.executable, str(tmp_path / "script.py"), str(path), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_tensor_parallel_rank_exits_cleanly_run_after_run(tmp_path, gguf_writer):
    # A fault at exit (a C++ thread still joinable when its object goes: SIGABRT, "terminate
    # called without an active exception") showed once in three runs: ten fresh 2-rank runs
    # (each would miss it with odds of 2/3: 1.7% for ten).
    done = _two_rank_script(tmp_path, gguf_writer, EXIT_RUNS, str(EXIT_REPEATS), str(tmp_path))
    assert done.returncode == 0, done.stderr
    outputs = {f"{run}-{rank}": (tmp_path / f"{run}-{rank}.txt").read_text()
               for run in range(EXIT_REPEATS) for rank in range(2)}
    failed = {f"{run}-{rank}": outputs[f"{run}-{rank}"] for run, line in enumerate(done.stdout.split("\n")[:-1])
              if line != f"run {run} 0 0" for rank in range(2)}
    assert done.stdout.split("\n")[:-1] == [f"run {run} 0 0" for run in range(EXIT_REPEATS)], (done.stdout, failed)
    assert not {name: out for name, out in outputs.items() if "terminate called" in out}
    assert all("tokens [" in outputs[f"{run}-0"] for run in range(EXIT_REPEATS))


# Once rank 0's engine is closed and gone, no thread of a process group (gloo's loops, the store
# server rank 0 hosts) may be left to run into the exit (rank 1 serves plans until then, and exits
# from inside engine_of).
GROUP_THREADS = TWO_RANKS + """
def rank_main(rank):
    engine = engine_of(sys.argv[1])
    engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    engine.close()
    del engine
    gc.collect()
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print("threads", json.dumps(names), flush=True)


print("exits", *two_ranks(rank_main), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")
def test_a_closed_tensor_parallel_engine_leaves_no_process_group_thread_running(tmp_path, gguf_writer):
    # torch.distributed.nn's defaults capture the world group when first imported (torch._dynamo
    # does, at the first collective): a join that did not import it first left the group, its
    # threads and the store server alive until the process exited.
    done = _two_rank_script(tmp_path, gguf_writer, GROUP_THREADS)
    assert done.returncode == 0 and "exits 0 0" in done.stdout, (done.stdout, done.stderr)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("threads")]  # rank 0's
    assert not [name for name in json.loads(line[len("threads "):]) if "gloo" in name or "tcpstore" in name], line


# Collectives may wait 1 s; rank 1 starts 3 s late (as a rank importing torch on a loaded host
# does) and comes 2 s late to each group's creation: the rendezvous still wait for it.
LATE_RANK = TWO_RANKS + """
import torch.distributed as dist


def rank_main(rank):
    if rank == 1:
        time.sleep(3.0)
        new_group = dist.new_group

        def late_new_group(*args, **kwargs):
            time.sleep(2.0)
            return new_group(*args, **kwargs)

        dist.new_group = late_new_group
    engine = engine_of(sys.argv[1], tensor_parallel_timeout=1.0)
    print("tokens", engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids, flush=True)
    engine.close()


print("exits", *two_ranks(rank_main), flush=True)
"""


def test_a_rank_starting_later_than_the_collectives_timeout_still_joins(tmp_path, gguf_writer):
    done = _two_rank_script(tmp_path, gguf_writer, LATE_RANK)
    assert "exits 0 0" in done.stdout and "tokens [" in done.stdout, (done.stdout, done.stderr[-3000:])


# -- NANOSERVE_CHECKS=1: a fault planted in a plan stops the step with its gate's message ----------

def checked_engine(monkeypatch, checks: bool, **options):
    monkeypatch.setenv("NANOSERVE_CHECKS", "1" if checks else "0")
    engine = engine_for(MODEL, 16, kv_cache_bytes=32 * BLOCK_BYTES, max_model_len=48, **options)
    assert engine.checks == checks
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
        engine.add_request(prompt, greedy(8))
    engine.step()  # both prompts prefilled: the next plan decodes rows 0 and 1
    return engine


def plant(engine, fault) -> None:
    """The scheduler's next plan passes through `fault` before the worker gets it."""
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: fault(schedule())


def stale_slot(plan):
    decode = plan.decode
    stale = (decode.write_slots[0] - 1,) + decode.write_slots[1:]  # the slot of the token before
    return dataclasses.replace(plan, decode=dataclasses.replace(decode, write_slots=stale))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_gate_passes_on_a_healthy_checked_run(monkeypatch, compiled):
    # A pool of 7 usable blocks of 4 for requests that need more: preemption, shared prefixes,
    # a scored prompt, an abort's compaction.
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")
    options = dict(compile=True, compile_backend="eager", row_buckets=(2, 4), width_buckets=(16, 28)) if compiled else {}
    engine = engine_for(MODEL, 16, kv_cache_bytes=16 * BLOCK_BYTES, max_model_len=28, **options)
    prompts = [[1, 2, 3], list(range(4, 15)), [3], list(range(1, 20)), list(range(1, 10)), list(range(1, 11))]
    ids = [engine.add_request(p, greedy(20 if i < 5 else 5, prompt_logprobs=2 if i == 5 else None))
           for i, p in enumerate(prompts)]
    for _ in range(3):
        engine.step()
    engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    engine.check_drained()
    stats = engine.stats()
    assert stats.preemptions and stats.compactions and stats.prefix_cache_hits  # the gates saw every row change


def test_a_stale_decode_slot_runs_unchecked_and_is_stopped_by_the_checks(monkeypatch):
    unchecked = checked_engine(monkeypatch, checks=False)
    plant(unchecked, stale_slot)
    unchecked.step()  # a silent corruption: nothing on the engine path looks
    engine = checked_engine(monkeypatch, checks=True)
    plant(engine, stale_slot)
    with pytest.raises(GateError, match=r"the step plan disagrees with the block manager.*\n  decode row 0: writes "
                                        r"slot \d+ at position \d+; its block table"):
        engine.step()


def test_a_block_freed_twice_is_stopped_by_the_checks(monkeypatch):
    engine = checked_engine(monkeypatch, checks=True)
    blocks = engine.scheduler.blocks
    held = blocks.tables[1].blocks[-1]
    blocks.pool.free([held])  # the first free, behind row 1's back: the row's finish would be the second
    with pytest.raises(GateError, match=rf"the pool disagrees with the block tables.*\n  block {held}: free in "
                                        r"the pool, but held by rows \[1\]"):
        engine.step()


def test_a_plan_that_leaves_out_a_row_change_is_stopped_by_the_worker_gate(monkeypatch):
    engine = checked_engine(monkeypatch, checks=True)
    engine.worker.cache.free(0)  # the worker thinks row 0 left; no plan said so
    with pytest.raises(GateError, match=r"plan_decode: the decode rows do not follow the slot table.*\n  row 0: "
                                        r"the plan writes position 5, the worker's slot table holds 0 tokens"):
        engine.step()


def test_a_compiled_step_refuses_decode_rows_that_are_not_a_window():
    # The plan names its decode rows, so the capture gate sees the gather a scattered row set reads.
    engine = engine_for(MODEL, 16, compile=True, compile_backend="eager", row_buckets=(2, 4), width_buckets=(16, 64))
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
        engine.add_request(prompt, greedy(8))
    engine.step()
    plant(engine, lambda plan: dataclasses.replace(plan, decode=dataclasses.replace(plan.decode, row_ids=(1, 0))))
    with pytest.raises(GateError, match=r"plan over rows \[1, 0\] reads a gathered copy, not a window"):
        engine.step()


def test_a_slot_table_too_large_for_its_pool_is_refused_at_build_under_the_checks(monkeypatch):
    options = dict(kv_cache_bytes=8 * BLOCK_BYTES, max_model_len=28, max_batch_size=16)  # the table: 18%
    engine_for(MODEL, 32, **options)
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")
    with pytest.raises(GateError, match=r"slot table \[16, 28\] int64 reserves 3,584 bytes, 17.9% of resident"):
        engine_for(MODEL, 32, **options)
