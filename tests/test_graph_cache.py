"""Compiled by default and never waited for: decode graphs built once per machine into the
compile cache, loaded without compiling, refused when damaged or foreign, built in the
background while their buckets run eagerly."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.worker import build as build_module
from nanoserve.worker import decode_step as decode_step_module
from nanoserve.worker.graph_build import CPU_MIN_CHUNK, MIN_CHUNK_ENV, inductor_backend, load_entry
from nanoserve.worker.graph_cache import GraphCache, GraphKey, torch_serialises_graphs

PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 5]
OPTIONS = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=64, weights="fp32",
               row_buckets=(2, 4), width_buckets=(64,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "graphs"))
    return tmp_path / "graphs"


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def dynamo_frames() -> int:
    return sum(torch._dynamo.utils.counters["frames"].values())


def test_a_cached_graph_loads_without_compiling_and_runs_another_models_weights(cache_dir):
    built = build_engine(random_model(tiny_config(), seed=0), compile=True, warmup="eager", **OPTIONS)
    assert built.stats().graphs_built == 2 and built.stats().graphs_loaded == 0
    frames = dynamo_frames()
    # The same shapes, other weights: the graphs are found by the model's structure, and the
    # weights are the graph's inputs, so the second model's own tokens come out.
    model = random_model(tiny_config(), seed=1)
    warm = build_engine(model, compile=True, warmup="eager", **OPTIONS)
    stats = warm.stats()
    assert (stats.graphs_loaded, stats.graphs_built, stats.graphs_ready) == (2, 0, 2)
    got = warm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert dynamo_frames() == frames, "a warm start traced with dynamo"
    assert warm.stats().eager_steps == 0 and warm.stats().recompiles_after_warmup == 0
    want = build_engine(model, compile=False, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(got) == tokens(want)


def test_the_cpp_and_python_wrappers_run_the_same_tokens_from_graphs_of_their_own(cache_dir):
    model = random_model(tiny_config(), seed=2)
    cpp = build_engine(model, compile=True, warmup="eager", **OPTIONS)
    python = build_engine(model, compile=True, warmup="eager", compile_cpp_wrapper=False, **OPTIONS)
    assert cpp.worker.decode_step.cpp_wrapper and not python.worker.decode_step.cpp_wrapper
    assert python.stats().graphs_built == 2, "the Python wrapper's graphs were taken from the C++ wrapper's"
    for engine, cpp_entry in ((cpp, True), (python, False)):  # the C++ wrapper's entry point is in its graphs
        step = engine.worker.decode_step
        assert all((b"inductor_entry_impl" in step.graph_cache.read(step.graph_key(shape))) == cpp_entry
                   for shape in step.shapes)
    want = build_engine(model, compile=False, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)
    for engine in (cpp, python):
        assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(want)
        assert engine.stats().eager_steps == 0


# The ops a decode graph calls. The C++ wrapper passes tensors, ints, floats and bools (and their
# optionals; a ScalarType is an int there) through torch's C shim; any other argument type (a
# string) makes it box the call through c10's dispatcher, whose headers cost a graph ~5 s to build.
GRAPH_OPS = ("group_mm", "experts_mm", "quantize_rows", "dequantize", "dequantize_rows", "decode_attention",
             "experts_dense", "experts_packed")


def test_every_op_a_graph_calls_takes_what_the_cpp_wrapper_passes_through_torchs_c_shim():
    from nanoserve.model.network import experts  # noqa: F401 (registers the expert ops)
    from nanoserve.model.quant import cpu_kernels

    if not cpu_kernels._ops_loaded():
        pytest.skip("nanoserve's CPU ops did not build on this host")
    plain = (torch.TensorType, torch.IntType, torch.FloatType, torch.BoolType)

    def passes(t) -> bool:
        return passes(t.getElementType()) if isinstance(t, torch.OptionalType) else isinstance(t, plain)

    for name in GRAPH_OPS:
        schema = getattr(torch.ops.nanoserve, name).default._schema
        boxed = [f"{a.name}: {a.type}" for a in (*schema.arguments, *schema.returns) if not passes(a.type)]
        assert not boxed, f"nanoserve::{name} takes {boxed}"


def test_a_torch_that_cannot_store_graphs_compiles_them_in_process(cache_dir, monkeypatch):
    # torch 2.10's aot-compiled functions do not serialise: on such a torch the engine keeps no
    # cache and compiles each bucket in its own process, with the eager engine's tokens.
    assert not torch_serialises_graphs("2.10.0") and not torch_serialises_graphs("2.12.1+cpu")
    assert torch_serialises_graphs("2.13.0+cpu") and torch_serialises_graphs("2.14.0.dev20261201")
    monkeypatch.setattr(build_module, "torch_serialises_graphs", lambda: False)
    model = random_model(tiny_config(), seed=4)
    engine = build_engine(model, compile=True, warmup="eager", **OPTIONS)
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = engine.stats()
    assert (stats.graphs_built, stats.graphs_loaded, stats.eager_steps) == (2, 0, 0)
    assert not list(cache_dir.rglob("*.graph")), "a graph was stored by a torch that cannot load it"
    want = build_engine(model, compile=False, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(got) == tokens(want)


def test_a_changed_key_misses(cache_dir, monkeypatch):
    step = build_engine(random_model(tiny_config()), compile=True, warmup="none", **OPTIONS).worker.decode_step
    key = step.graph_key((2, 64, 1)).digest
    assert step.graph_key((4, 64, 1)).digest != key  # the bucket
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert step.graph_key((2, 64, 1)).digest != key  # torch
    monkeypatch.undo()
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(cache_dir))
    capability = os.environ.get("ATEN_CPU_CAPABILITY")  # a run may cap torch already
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default" if capability == "avx2" else "avx2")
    assert step.graph_key((2, 64, 1)).digest != key  # the CPU capability torch runs at
    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    assert step.graph_key((2, 64, 1)).digest == key
    monkeypatch.setenv(MIN_CHUNK_ENV, "512")
    assert step.graph_key((2, 64, 1)).digest != key  # a user's split of the CPU kernels over threads
    monkeypatch.delenv(MIN_CHUNK_ENV)
    wider = build_engine(random_model(tiny_config(hidden_size=96)), compile=True, warmup="none", **OPTIONS)
    assert wider.worker.decode_step.graph_key((2, 64, 1)).digest != key  # the model's shape
    bf16 = build_engine(random_model(tiny_config()), compile=True, warmup="none", **{**OPTIONS, "weights": "bf16"})
    assert bf16.worker.decode_step.graph_key((2, 64, 1)).digest != key  # the dtype and the kernels


def test_a_batch_1_steps_small_kernels_are_not_split_over_threads(monkeypatch):
    # a norm of one 2048-wide row is one thread's: an OpenMP fork and join cost more than its work
    monkeypatch.delenv(MIN_CHUNK_ENV, raising=False)
    for mode, cpp_wrapper in [("reduce-overhead", True), ("reduce-overhead", False), (None, False)]:
        assert inductor_backend(mode, cpp_wrapper).config["cpp.min_chunk_size"] == CPU_MIN_CHUNK > 2 * 2048
    monkeypatch.setenv(MIN_CHUNK_ENV, "512")  # inductor's own setting: the user's value is kept
    assert inductor_backend("reduce-overhead", True).config["cpp.min_chunk_size"] == 512


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "garbage"])
def test_a_damaged_entry_is_refused_in_one_line_and_rebuilt(cache_dir, damage, caplog):
    model = random_model(tiny_config())
    step = build_engine(model, compile=True, warmup="eager", **OPTIONS).worker.decode_step
    cache, key = step.graph_cache, step.graph_key((2, 64, 1))
    path = cache.path(key)
    data = path.read_bytes()
    if damage == "corrupt":
        data = data[:-100] + bytes(b ^ 0xFF for b in data[-100:])
    elif damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "foreign":
        data = cache.path(step.graph_key((4, 64, 1))).read_bytes()
    else:
        data = b"\x00" * 64
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="nanoserve.worker.graph_cache"):
        assert load_entry(cache, key) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    assert not path.exists()
    rebuilt = build_engine(model, compile=True, warmup="eager", **OPTIONS)
    assert (rebuilt.stats().graphs_built, rebuilt.stats().graphs_loaded) == (1, 1)
    assert load_entry(cache, key) is not None


def test_the_cache_is_bounded_by_entries_and_bytes(tmp_path):
    cache = GraphCache(tmp_path, max_entries=3, max_bytes=1 << 20)
    keys = [GraphKey.of(shape=(n, 64, 1)) for n in range(5)]
    for n, key in enumerate(keys):
        cache.store(key, bytes([n]) * 1000)
        os.utime(cache.path(key), (n, n))  # older first
    assert sorted(p.name for p in cache.entries()) == sorted(cache.path(k).name for k in keys[2:])
    cache = GraphCache(tmp_path, max_entries=10, max_bytes=2500)
    cache.store(keys[0], b"x" * 1000)
    assert len(cache.entries()) == 2 and cache.has(keys[0])
    assert cache.read(keys[0]) == b"x" * 1000


class NeverDoneBuilder:
    """A stand-in for the background builder whose compiler takes as long as the test likes."""

    instances: list[NeverDoneBuilder] = []

    def __init__(self, job, cache, shapes) -> None:
        self.pending, self.failed, self.built = list(shapes), {}, 0
        self.requested: list = []
        self.release = threading.Event()
        self.job = job
        NeverDoneBuilder.instances.append(self)

    @property
    def building(self) -> int:
        return len(self.pending)

    def request(self, shape) -> None:
        self.requested.append(shape)

    def ready(self) -> list:
        if not self.release.is_set():
            return []
        out = []
        for shape in self.pending:
            graph = load_entry(GraphCache(self.job.cache_root), self.job.keys[shape])
            if graph is not None:
                out.append((shape, graph))
        self.pending = [s for s in self.pending if s not in dict(out)]
        return out

    def close(self) -> None:
        pass


def test_no_request_waits_for_a_compiler(cache_dir, monkeypatch):
    # The builder never finishes while the requests run: they finish anyway, eagerly, with the
    # eager engine's tokens; once the graphs exist they are swapped in between steps.
    monkeypatch.setattr(decode_step_module, "BackgroundBuilder", NeverDoneBuilder)
    model = random_model(tiny_config(), seed=2)
    lazy = build_engine(model, compile=True, warmup="lazy", **OPTIONS)
    builder = NeverDoneBuilder.instances[-1]
    got = lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = lazy.stats()
    assert stats.eager_steps > 0 and stats.graphs_ready == 0 and stats.graphs_building + stats.graphs_pending == 2
    assert builder.requested, "a step that met a bucket without a graph did not ask for it"
    want = build_engine(model, compile=False, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(got) == tokens(want)
    build_engine(random_model(tiny_config(), seed=3), compile=True, warmup="eager", **OPTIONS)  # "the compiler"
    builder.release.set()
    eager_steps = lazy.stats().eager_steps
    again = lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert lazy.stats().graphs_ready == 2 and lazy.stats().eager_steps == eager_steps
    assert tokens(again) == tokens(want)


def test_a_background_process_builds_the_graphs_while_eager_steps_serve(cache_dir, tiny_llama_dir):
    path = str(tiny_llama_dir)
    options = {**OPTIONS, "max_model_len": 64}
    lazy = build_engine(path, compile=True, warmup="lazy", **options)
    try:
        first = lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
        step = lazy.worker.decode_step
        assert step.builder is not None
        assert step.wait_for_graphs(timeout=600), step.builder.failed
        then = lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = lazy.stats()
        assert stats.graphs_ready == 2 and stats.graphs_built == 2 and stats.graphs_pending == 0
        want = build_engine(path, compile=False, **options).generate(PROMPTS, GREEDY, use_tqdm=False)
        assert tokens(first) == tokens(want) == tokens(then)
    finally:
        lazy.close()


def test_a_builder_that_dies_leaves_its_buckets_eager_saying_why(tmp_path, monkeypatch, caplog):
    from nanoserve.worker import graph_build

    died = "import sys; sys.stderr.write('MemoryError: the builder ran out\\n'); sys.exit(3)"
    monkeypatch.setattr(graph_build, "_CHILD", died)
    shapes = [(1, 64, 1), (2, 64, 1)]
    job = graph_build.BuildJob(None, None, str(tmp_path), dict.fromkeys(shapes))
    with caplog.at_level(logging.WARNING, logger=graph_build.__name__):
        builder = graph_build.BackgroundBuilder(job, GraphCache(tmp_path), shapes)
        builder._reader.join(60)
    try:
        assert builder.building == 0 and builder.pending == []
        why = "the graph builder exited with code 3: MemoryError: the builder ran out"
        assert builder.failed == dict.fromkeys(shapes, why)
        assert why in caplog.text and "2 bucket(s) stay eager" in caplog.text
    finally:
        builder.close()


WARM = """
import sys
from nanoserve import build_engine
engine = build_engine(sys.argv[1], compile=True, warmup="eager", max_batch_size=4, kv_cache_bytes=1 << 20,
                      block_size=4, max_model_len=64, weights="fp32", row_buckets=(1, 2, 4), width_buckets=(64,))
print(engine.stats().graphs_built, engine.stats().graphs_loaded)
"""


def test_two_processes_warming_the_same_cache_both_finish_with_valid_entries(tmp_path, tiny_llama_dir):
    env = dict(os.environ, NANOSERVE_CACHE_DIR=str(tmp_path / "shared"))
    runs = [subprocess.Popen([sys.executable, "-c", WARM, str(tiny_llama_dir)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [run.communicate(timeout=600) for run in runs]
    for run, (_, err) in zip(runs, results):
        assert run.returncode == 0, err[-2000:]
    counts = [tuple(map(int, out.split()[-2:])) for out, _ in results]
    assert all(built + loaded == 3 for built, loaded in counts)
    assert sum(built for built, _ in counts) == 3, f"an entry was built twice: {counts}"
    cache = GraphCache(tmp_path / "shared")
    assert len(cache.entries()) == 3
    for entry in cache.entries():
        assert entry.read_bytes().startswith(b"nanoserve-graph")


def test_nanoserve_warmup_builds_every_bucket_then_a_start_loads_them(cache_dir, tiny_llama_dir, capsys):
    from nanoserve.launch import main

    options = ["--max-batch-size", "2", "--max-model-len", "64", "--kv-cache-bytes", "1M"]
    assert main(["warmup", str(tiny_llama_dir), *options]) == 0
    err = capsys.readouterr().err
    assert "model: 2 graphs ready (0 already cached, 2 built)" in err and "rows=2" in err
    assert main(["warmup", str(tiny_llama_dir), *options]) == 0
    assert "(2 already cached, 0 built)" in capsys.readouterr().err
    engine = build_engine(str(tiny_llama_dir), max_batch_size=2, max_model_len=64, kv_cache_bytes=1 << 20,
                          compile=True, warmup="none")
    assert (engine.stats().graphs_loaded, engine.stats().graphs_ready, engine.stats().graphs_pending) == (2, 2, 0)


def test_the_start_up_summary_says_which_graphs_are_ready():
    from nanoserve.engine.stats import EngineStats
    from nanoserve.summary import describe_graphs

    line = describe_graphs(EngineStats(graphs_ready=3, graphs_loaded=3, graph_load_seconds=0.4, graphs_building=1,
                                       graphs_pending=3))
    assert line == ("compiled decode: 3 graphs ready (3 loaded from the compile cache in 0.4 s), 4 building in the "
                    "background (those buckets run eagerly meanwhile)")
