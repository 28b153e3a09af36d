"""Shared test set-up: devices, the gpu marker, hypothesis profiles."""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref

import pytest
import torch
from hypothesis import HealthCheck, settings

# Engines in the suite decode eagerly unless a test asks for compile: a default (compiled) engine
# starts a background graph build, and hundreds of them would take the two cores. Tests that
# compile share one graph cache made for the run (a graph's key is the model's structure, not its
# weights, so same-shaped test models share entries).
os.environ.setdefault("NANOSERVE_COMPILE", "0")
os.environ.setdefault("NANOSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="nanoserve-test-graphs-"))

# CI keeps the property suite quick; NANOSERVE_HYPOTHESIS=long explores much further.
settings.register_profile(
    "ci", max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", max_examples=1000, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("NANOSERVE_HYPOTHESIS", "ci"))

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist (`make test` runs a worker a core) each worker takes its share of the cores:
# two workers' OpenMP teams of a core count each would fight over the same cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from nanoserve.distributed.launch import usable_cores

    torch.set_num_threads(max(1, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session", autouse=True)
def kernel_tiers_built():
    """Every kernel tier the host runs built before the first test, one compiler a core: the
    suite runs them all, and one by one, as tests first used them, a cold machine spent ~45 s a
    tier on 2 cores. A tier that fails to build fails here silently and is refused where used."""
    from concurrent.futures import ThreadPoolExecutor

    from nanoserve.model.quant import cpu_kernels

    tiers = [cpu_kernels.TIERS[t] for t in cpu_kernels.host_tiers() if t in cpu_kernels.TIERS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(cpu_kernels._build, tier) for tier in tiers]:
            with contextlib.suppress(Exception):
                done.result()


@pytest.fixture
def threads():
    """torch.set_num_threads for one test: what the test sets is put back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def dense_greedy():
    """The greedy continuation by the dense oracle: the whole sequence re-run for every token."""
    from nanoserve.model.network.llama import dense_forward

    @torch.no_grad()
    def greedy(model, prompt_ids, steps: int) -> list[int]:
        ids = list(prompt_ids)
        for _ in range(steps):
            ids.append(int(dense_forward(model, torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt_ids):]

    return greedy
# ---------------------------------------------------------------------------------------------
# Step limits. An engine that stops making progress (a leaked block starves admission; a
# preemption that never ends) must fail the test naming the stuck requests, not hang it.
STEP_LIMIT = 20_000  # engine steps one test may take; the suite's busiest engine needs ~2,000
IDLE_STEP_LIMIT = 200  # steps in a row that schedule nothing while requests are unfinished


def describe_stuck(engine, why: str) -> str:
    """What is unfinished and what the pool holds, for a failure message."""
    scheduler, cache = engine.scheduler, engine.scheduler.blocks

    def listed(requests) -> str:
        return ", ".join(f"{r.request_id} ({r.num_tokens} tokens, row {r.row})" for r in requests) or "none"

    return (f"engine stuck: {why}. waiting: {listed(scheduler.waiting)}; running: {listed(scheduler.running)}; "
            f"pool {cache.pool.num_free} of {cache.pool.num_blocks} blocks free; live rows {cache.live_rows}")


def while_unfinished(engine, until=None, max_steps: int = STEP_LIMIT):
    """Yield once per turn of a test's engine loop while `until()` holds (by default
    `engine.has_unfinished()`); fail naming the stuck requests after `max_steps` turns.

        for _ in while_unfinished(engine):
            outputs = engine.step()
    """
    until = until or engine.has_unfinished
    for _ in range(max_steps):
        if not until():
            return
        yield
    raise AssertionError(describe_stuck(engine, f"still unfinished after {max_steps} steps"))


@pytest.fixture(autouse=True)
def engine_step_limit(monkeypatch):
    """Bound the loops inside the engine too (generate, stream, the server's engine loop):
    every Engine.step counts against STEP_LIMIT, and IDLE_STEP_LIMIT steps in a row that
    return nothing while requests are unfinished mean nothing can be scheduled any more."""
    from nanoserve.engine.engine import Engine

    step = Engine.step
    counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> [steps, idle steps in a row]

    def limited_step(self):
        count = counts.setdefault(self, [0, 0])
        count[0] += 1
        if count[0] > STEP_LIMIT:
            raise AssertionError(describe_stuck(self, f"more than {STEP_LIMIT} steps"))
        outputs = step(self)
        count[1] = count[1] + 1 if not outputs and self.has_unfinished() else 0
        if count[1] >= IDLE_STEP_LIMIT:
            raise AssertionError(describe_stuck(self, f"{IDLE_STEP_LIMIT} steps in a row scheduled nothing"))
        return outputs

    monkeypatch.setattr(Engine, "step", limited_step)


# Parametrise device-generic tests over these: cpu always, cuda where present.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


# ---------------------------------------------------------------------------------------------
# Model fixtures. The default GGUF and the transformers reference are loaded once per session
# (transformers needs ~15 s to dequantise it). Never touch a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from nanoserve.model_path import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(LlamaModel, Tokenizer) for the default GGUF, fp32 on cpu."""
    from nanoserve.model.formats.loader import load_model

    return load_model(str(smollm2_path), dtype=torch.float32)


@contextlib.contextmanager
def _quick_gguf_parsing():
    """Speed up transformers' GGUF loading without changing what it computes.

    It parses the file twice with gguf.GGUFReader, whose np.memmap slicing costs ~15 s for this
    vocabulary, and rebuilds gguf's tensor-name table once per tensor. We hand it our reader
    subclass (same parser, same bytes, plain-array views) and memoise that pure name table;
    dequantisation, permutation and the model code stay the reference's own.
    """
    import functools

    import gguf

    from nanoserve.model.formats.gguf_loader import _PlainArrayReader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _PlainArrayReader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """The transformers reference on the same GGUF file (dequantised to fp32)."""
    transformers = pytest.importorskip("transformers")
    with _quick_gguf_parsing():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    with _quick_gguf_parsing():
        return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def _byte_alphabet() -> list[str]:
    from nanoserve.model.formats.tokenizer import _bytes_to_unicode

    return list(_bytes_to_unicode().values())


def write_gguf(path, config, hf_weights=None, *, arch="llama", qtype=None, tensor_types=None,
               permute=True, uint32s=None):
    """Write a small GGUF the way llama.cpp's converter would: metadata, a byte-level vocabulary
    of `config.vocab_size` tokens (the 256 byte symbols, then control tokens), and `hf_weights`
    (HF naming) renamed, Q/K rows permuted for llama, and stored as `qtype` (F32 by default;
    1-D tensors always F32). `tensor_types` forces a type on named GGUF tensors; where gguf
    cannot quantise to it, seeded random bytes are stored instead. `uint32s`: more metadata
    fields (key -> value; "{arch}." in a key is the architecture's prefix), e.g. a pooling_type."""
    import gguf
    import numpy as np

    from nanoserve.model.formats.gguf_loader import GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS

    qtype = qtype or gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = _byte_alphabet() + [f"<|special_{i}|>" for i in range(config.vocab_size - 256)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:config.vocab_size])
    writer.add_token_types([1] * 256 + [3] * (config.vocab_size - 256))
    writer.add_token_merges([])
    writer.add_eos_token_id(config.vocab_size - 1)
    for key, value in (uint32s or {}).items():
        writer.add_uint32(key.replace("{arch}", arch), value)

    to_gguf = {v: k for k, v in GGUF_GLOBAL_TENSORS.items()}
    for i in range(config.num_layers):
        to_gguf.update({f"model.layers.{i}.{v}": f"blk.{i}.{k}" for k, v in GGUF_LAYER_TENSORS.items()})
    for hf_name, tensor in (hf_weights or {}).items():
        name = to_gguf[hf_name]
        data = tensor.detach().float().numpy().copy()
        if permute and arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
            data = data.reshape(tensor.shape)
        kind = (tensor_types or {}).get(name, qtype if data.ndim > 1 else gguf.GGMLQuantizationType.F32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            try:
                writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
            except (NotImplementedError, KeyError):
                # gguf cannot quantise to this type (K-quants, or types nobody dequantises):
                # plant seeded random bytes of the right size instead of the weights.
                block, size = gguf.GGML_QUANT_SIZES[kind]
                rng = np.random.default_rng(len(name))
                raw = rng.integers(0, 256, (data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
                writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def gguf_writer():
    """`write_gguf(path, config, hf_weights, ...)`: plant a small GGUF file (see write_gguf)."""
    return write_gguf


@contextlib.contextmanager
def served(engine, model_name: str, api_key: str | None, **app_options):
    """`engine` behind the HTTP app (`create_app(..., **app_options)`) on a free loopback port,
    its loop reachable as `server.engine_loop`; on exit the server stops and the loop must
    have ended."""
    from nanoserve.serve.app import create_app
    from nanoserve.serve.engine_loop import EngineLoop
    from nanoserve.serve.server import BackgroundServer

    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name, api_key=api_key, **app_options)).start()
    server.engine_loop = loop
    try:
        yield server
    finally:
        server.stop()
    assert not loop.alive


def random_smollm2_shaped(smollm2_path, **config_overrides):
    """(model, tokenizer): SmolLM2's tokenizer (from the GGUF's metadata only) and a random model
    in its shape with 2 layers (and ``config_overrides``), its logits flattened so that sampling
    does not only ever repeat the input token."""
    import dataclasses

    from nanoserve.model.formats.gguf_loader import GGUFCheckpoint
    from nanoserve.model.formats.tokenizer import Tokenizer
    from nanoserve.model.network.synthetic import random_model, smollm2_135m_config

    metadata = GGUFCheckpoint.open(smollm2_path).metadata
    tokenizer = Tokenizer.from_gguf_metadata(metadata, source=str(smollm2_path))
    config = dataclasses.replace(smollm2_135m_config(max_position_embeddings=1024), num_layers=2, **config_overrides)
    model = random_model(config, seed=0)
    with torch.no_grad():
        model.norm.weight.fill_(0.005)
    return model, tokenizer


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_text_engine(directory, **engine_kwargs):
    """A tiny random model with a byte-level tokenizer and a simple chat template (a planted
    GGUF, so text, chat and token paths all run), built with `engine_kwargs`."""
    from nanoserve.engine import build_engine
    from nanoserve.model.formats.loader import load_model
    from nanoserve.model.formats.tokenizer import ChatTemplate
    from nanoserve.model.network.llama import unfuse_hf_weights
    from nanoserve.model.network.synthetic import random_model, tiny_config

    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = write_gguf(directory / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    model, tokenizer = load_model(str(path))
    tokenizer.chat_template = ChatTemplate(TINY_CHAT_TEMPLATE)
    return build_engine(model, tokenizer=tokenizer, **engine_kwargs)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process, url: str, timeout: float = 60.0) -> None:
    """Poll `url`/health until the server `process` answers 200; fail with its output if it
    exits first, or if `timeout` seconds pass."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def stop_and_collect(process, sig: int, timeout: float = 30.0) -> str:
    """Send `sig` to a server process and return its output once it exits; a process still
    running after `timeout` seconds is killed and the wait fails."""
    import subprocess

    process.send_signal(sig)
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama as a Hugging Face directory with a byte-level tokenizer, so it loads
    by path like any model (its shapes suit the packed int4 kernel)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["the model reads the text"] * 10, trainers.BpeTrainer(
        vocab_size=config.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"]))
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return path
