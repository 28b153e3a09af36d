"""The model-file fuzzer, run as its own process (tests/test_model_fuzz.py starts it) so that each
case is bounded in time (SIGALRM) and the whole run in memory (RLIMIT_DATA):

    python tests/model_fuzz.py gguf|hf EXAMPLES [--derandomize] [--seed N]

Hypothesis mutates a small valid file — a GGUF (metadata values and types, array lengths and
items, tensor names, shapes, types and offsets, the chat template, raw header bytes) or a
Hugging Face directory (config.json, tokenizer files, the safetensors header) — and each result
must either load and generate two tokens, or be refused with a ModelLoadError (or a
FileNotFoundError) naming a file of the model: never another exception, a hang or a memory
blow-up. Prints one JSON line: examples run, distinct mutations tried, outcomes.
--derandomize draws the same cases every run (the suite's quick sample); --seed N replays the
run a failure names ("@seed(N)").
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

os.environ.setdefault("NANOSERVE_COMPILE", "0")  # each case loads and generates: no graph builders
sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import CHATML, GGUFDescription, V, tiny_chat_gguf  # noqa: E402

from nanoserve.engine import SamplingParams, build_engine  # noqa: E402
from nanoserve.model.formats.errors import ModelLoadError  # noqa: E402
from nanoserve.model.formats.loader import load_model  # noqa: E402

CASE_SECONDS = 20  # one load and two tokens of a tiny model take well under a second
MEMORY_BYTES = 6 << 30  # the process's data segment: torch, the tiny model, and room for a bad case


class CaseTimeout(Exception):
    """A case ran past CASE_SECONDS: a hang, reported as a failure."""


def _alarm(*_):
    raise CaseTimeout(f"a case ran past {CASE_SECONDS} s")


def run_case(model_path: Path, owner: Path) -> str:
    """Load and generate, or be refused naming a file under `owner`; the outcome's name."""
    signal.alarm(CASE_SECONDS)
    try:
        try:
            model, tokenizer = load_model(str(model_path))
        except (ModelLoadError, FileNotFoundError) as e:
            named = e.path if isinstance(e, ModelLoadError) else str(e).split(":", 1)[0]
            assert named.startswith(str(owner)), f"the refusal names {named!r}, not the model's file: {e}"
            assert "\n" not in str(e), f"the refusal is more than one line: {e!r}"
            return "refused"
        engine = build_engine(model, tokenizer=tokenizer, max_batch_size=1, max_model_len=32,
                              kv_cache_bytes=1 << 20)
        prompt = tokenizer.encode("the thin hat") or [0]
        output = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                 use_tqdm=False)[0]
        assert len(output.token_ids) == 2
        if tokenizer.chat_template is not None:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        return "loaded"
    finally:
        signal.alarm(0)


def checked(run, model_path: Path, owner: Path, label: tuple) -> str:
    """run(model_path, owner), naming the mutation when it fails: a BaseException that is not
    an Exception (a Rust panic from a library) stops hypothesis before it reports the case."""
    try:
        return run(model_path, owner)
    except BaseException:
        print(f"failing mutation: {label!r}", file=sys.stderr)
        raise


# -- GGUF mutations ----------------------------------------------------------------------------

INT_TYPES = [V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64]
KNOWN_KEYS = ["llama.vocab_size", "llama.attention.key_length", "llama.rope.scaling.type",
              "llama.rope.scaling.factor", "llama.attention.sliding_window", "llama.final_logit_softcapping",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "llama.attn_logit_softcapping",
              "llama.expert_count", "llama.expert_used_count", "llama.expert_feed_forward_length",
              "llama.expert_weights_norm"]
HOSTILE_TEMPLATES = [
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ 'x' * 10**10 }}", "{% for i in range(10**9) %}{% endfor %}", "{{ raise_exception('no') }}",
    "{% for m in messages %}", "{{ messages[0].content | nosuchfilter }}", "{{ 1 / 0 }}", "{{ x.y.z }}",
    "{{ messages.pop() }}", "{% set a = namespace(b=1) %}{{ a.b }}", "{{ bos_token + 1 }}", "",
]
_int_value = st.one_of(st.sampled_from([0, 1, -1, 2, 3, 255, 256, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1, -2 ** 63]),
                       st.integers(-1000, 100_000))
_float_value = st.one_of(st.sampled_from([0.0, -0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf")]),
                         st.floats(-1e6, 1e6, allow_nan=False))
# Text, and the names the loader branches on (architectures, tokenizer models, rope types).
_text = st.one_of(st.text(max_size=12), st.sampled_from(["llama", "qwen2", "qwen3", "gemma3", "mistral", "gpt2",
                                                         "linear", "llama3", "yarn", "none", "<s>", "</s>"]))


@st.composite
def gguf_value(draw):
    """(value, type, item type) of any GGUF kind, a type that can hold the value."""
    kind = draw(st.sampled_from(["int", "float", "str", "bool", "int-array", "str-array", "float-array"]))
    if kind == "int":
        value = draw(_int_value)
        fits = [t for t in INT_TYPES if _fits(value, t)]
        return value, draw(st.sampled_from(fits)), None
    if kind == "float":
        return draw(_float_value), draw(st.sampled_from([V.FLOAT32, V.FLOAT64])), None
    if kind == "str":
        return draw(_text), V.STRING, None
    if kind == "bool":
        return draw(st.booleans()), V.BOOL, None
    if kind == "int-array":
        return draw(st.lists(st.integers(0, 300), max_size=6)), V.ARRAY, V.INT32
    if kind == "float-array":
        return draw(st.lists(_float_value, max_size=6)), V.ARRAY, V.FLOAT32
    return draw(st.lists(_text, max_size=6)), V.ARRAY, V.STRING


def _fits(value: int, vtype) -> bool:
    bits = {V.UINT8: 8, V.INT8: 8, V.UINT16: 16, V.INT16: 16, V.UINT32: 32, V.INT32: 32, V.UINT64: 64, V.INT64: 64}
    signed = vtype in (V.INT8, V.INT16, V.INT32, V.INT64)
    low, high = (-(1 << (bits[vtype] - 1)), (1 << (bits[vtype] - 1)) - 1) if signed else (0, (1 << bits[vtype]) - 1)
    return low <= value <= high


@st.composite
def gguf_mutation(draw):
    """One change to the tiny GGUF, dense or with experts: (its label, for the count; an edit of
    the description; an edit of the written file; whether the file has experts)."""
    experts = draw(st.booleans())
    label, edit, patch = draw(_gguf_edit(experts))
    return ("experts" if experts else "dense", *label), edit, patch, experts


@st.composite
def _gguf_edit(draw, experts: bool):
    d = tiny_chat_gguf(experts=experts)
    keys = sorted(d.fields) + KNOWN_KEYS
    tensors = sorted(d.tensors)
    kind = draw(st.sampled_from(["set", "delete", "array-length", "array-item", "template",
                                 "tensor-delete", "tensor-rename", "tensor-shape", "tensor-info", "bytes"]))
    if kind == "set":
        key = draw(st.sampled_from(keys))
        value, vtype, sub = draw(gguf_value())
        return (kind, key, vtype.name, repr(value)[:40]), lambda d: d.set(key, value, vtype, sub), None
    if kind == "delete":
        key = draw(st.sampled_from(sorted(d.fields)))
        return (kind, key), lambda d: d.fields.pop(key), None
    arrays = ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges"]
    if kind == "array-length":
        key, length = draw(st.sampled_from(arrays)), draw(st.integers(0, 300))

        def resize(d, key=key, length=length):
            value, vtype, sub = d.fields[key]
            value = (value * (length // max(len(value), 1) + 1))[:length] if value else []
            d.set(key, value, vtype, sub)
        return (kind, key, length), resize, None
    if kind == "array-item":
        key = draw(st.sampled_from(arrays))
        index = draw(st.integers(0, 400))
        item = draw({"tokenizer.ggml.tokens": _text, "tokenizer.ggml.merges": _text,
                     "tokenizer.ggml.token_type": st.integers(-3, 10),
                     "tokenizer.ggml.scores": _float_value}[key])

        def replace(d, key=key, index=index, item=item):
            value, vtype, sub = d.fields[key]
            value = list(value)
            value[index % len(value)] = item
            d.set(key, value, vtype, sub)
        return (kind, key, index % 264, repr(item)[:40]), replace, None
    if kind == "template":
        text = draw(st.one_of(st.sampled_from(HOSTILE_TEMPLATES),
                              st.builds(lambda cut, junk: CHATML[:cut] + junk + CHATML[cut:],
                                        st.integers(0, len(CHATML)), _text)))
        return (kind, text[:60]), lambda d: d.set("tokenizer.chat_template", text, V.STRING), None
    if kind == "tensor-delete":
        name = draw(st.sampled_from(tensors))
        return (kind, name), lambda d: d.tensors.pop(name), None
    if kind == "tensor-rename":
        name = draw(st.sampled_from(tensors))
        new = draw(st.one_of(st.sampled_from(tensors + ["blk.7.attn_q.weight", "blk.0.unknown.weight",
                                                        "rope_freqs.weight", "output.bias",
                                                        "blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_inp.weight",
                                                        "blk.1.ffn_up_exps.weight"]), _text))

        def rename(d, name=name, new=new):
            d.tensors[new] = d.tensors.pop(name)
        return (kind, name, new), rename, None
    if kind == "tensor-shape":
        name = draw(st.sampled_from(tensors))
        how = draw(st.sampled_from(["transpose", "drop-row", "add-dim", "flatten", "f16", "empty"]))

        def reshape(d, name=name, how=how):
            t = d.tensors[name]
            d.tensors[name] = {"transpose": lambda: np.ascontiguousarray(t.T), "drop-row": lambda: t[:-1].copy(),
                               "add-dim": lambda: t[None].copy(), "flatten": lambda: t.reshape(-1).copy(),
                               "f16": lambda: t.astype(np.float16), "empty": lambda: t[:0].copy()}[how]()
        return (kind, name, how), reshape, None
    if kind == "tensor-info":
        index, part = draw(st.integers(0, len(tensors) - 1)), draw(st.sampled_from(["n_dims", "dim", "type", "offset"]))
        value = draw(st.one_of(st.integers(0, 64), st.integers(0, 2 ** 32 - 1), st.sampled_from([2 ** 63, 2 ** 64 - 1])))
        return (kind, index, part, value), None, lambda path: patch_tensor_info(path, index, part, value)
    start, flips = draw(st.integers(0, 2000)), draw(st.lists(st.integers(0, 255), min_size=1, max_size=8))
    cut = draw(st.one_of(st.none(), st.integers(0, 4000)))
    return (kind, start, tuple(flips), cut), None, lambda path: corrupt_bytes(path, start, flips, cut)


def patch_tensor_info(path: Path, index: int, part: str, value: int) -> None:
    """Overwrite one field of tensor `index`'s info entry (its dimension count, first dimension,
    type or data offset) in a written GGUF."""
    from gguf import GGUFReader

    field = GGUFReader(path, "r").tensors[index].field
    offsets, at = [], field.offset
    for p in field.parts:
        offsets.append(at)
        at += int(p.nbytes)
    slot, fmt = {"n_dims": (2, "<I"), "dim": (3, "<Q"), "type": (4, "<I"), "offset": (5, "<Q")}[part]
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offsets[slot], value % (1 << (8 * struct.calcsize(fmt))))
    path.write_bytes(bytes(data))


def corrupt_bytes(path: Path, start: int, flips: list[int], cut: int | None) -> None:
    data = bytearray(path.read_bytes())
    for i, b in enumerate(flips):
        if start + i < len(data):
            data[start + i] = b
    path.write_bytes(bytes(data[:cut] if cut is not None else data))


def fuzz_gguf(examples: int, workdir: Path, tried: set, outcomes: Counter, derandomize: bool,
              replay: int | None) -> None:
    @seed(replay)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(gguf_mutation())
    def case(mutation):
        label, edit, patch, experts = mutation
        tried.add(("gguf",) + label)
        d: GGUFDescription = tiny_chat_gguf(experts=experts)
        if edit is not None:
            edit(d)
        path = workdir / "case.gguf"
        try:
            d.write(path)
        except Exception:  # gguf's writer refused the edit itself (e.g. an empty tensor name)
            outcomes["unwritable"] += 1
            return
        if patch is not None:
            patch(path)
        outcomes[checked(run_case, path, path, label)] += 1

    case()


# -- Hugging Face mutations --------------------------------------------------------------------

def tiny_hf_dir(directory: Path) -> Path:
    """A tiny Llama as a Hugging Face directory: config.json, model.safetensors, tokenizer files."""
    from safetensors.torch import save_file

    from nanoserve.model.network.llama import unfuse_hf_weights
    from nanoserve.model.network.synthetic import random_model, tiny_config

    sys.path.insert(0, str(Path(__file__).parent))
    from arch_models import save_bpe_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(vocab_size=300, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                         head_dim=16)
    weights = {k: v.contiguous() for k, v in unfuse_hf_weights(random_model(config, seed=0)).items()}
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}))
    save_bpe_tokenizer(directory, "the thin hat sat on the mat", 290, "<s>", "</s>")
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": CHATML}))
    return directory


_json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), _int_value, _float_value, _text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6)
CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_scaling",
               "architectures", "model_type", "sliding_window", "layer_types", "hidden_act", "attention_bias",
               "text_config", "mlp_bias", "final_logit_softcapping"]


@st.composite
def hf_mutation(draw):
    kind = draw(st.sampled_from(["config-set", "config-delete", "tokenizer-config", "tokenizer-json",
                                 "header-entry", "header-bytes", "file-delete"]))
    if kind == "config-set":
        key, value = draw(st.sampled_from(CONFIG_KEYS)), draw(_json_value)
        if draw(st.booleans()) and key == "rope_scaling":
            value = {"rope_type": draw(st.sampled_from(["linear", "llama3", "yarn", "dynamic"])),
                     "factor": draw(_json_value)}
        return (kind, key, repr(value)[:40]), lambda d: _edit_json(d / "config.json", {key: value})
    if kind == "config-delete":
        key = draw(st.sampled_from(CONFIG_KEYS[:12]))
        return (kind, key), lambda d: _edit_json(d / "config.json", {key: _DELETE})
    if kind == "tokenizer-config":
        key = draw(st.sampled_from(["bos_token", "eos_token", "pad_token", "unk_token", "chat_template"]))
        value = draw(st.one_of(_json_value, st.sampled_from(HOSTILE_TEMPLATES + ["<s>", "</s>", "<unk>"])))
        return (kind, key, repr(value)[:40]), lambda d: _edit_json(d / "tokenizer_config.json", {key: value})
    if kind == "tokenizer-json":
        cut = draw(st.integers(0, 5000))
        how = draw(st.sampled_from(["truncate", "vocab-id", "drop-vocab"]))
        token_id = draw(_int_value)
        return (kind, how, cut, token_id), lambda d: _edit_tokenizer(d / "tokenizer.json", how, cut, token_id)
    if kind == "header-entry":
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "delete", "rename", "metadata"]))
        index, value = draw(st.integers(0, 30)), draw(_json_value)
        return (kind, field, index, repr(value)[:40]), lambda d: _edit_header(d / "model.safetensors", field, index, value)
    if kind == "header-bytes":
        start, flips = draw(st.integers(0, 600)), draw(st.lists(st.integers(0, 255), min_size=1, max_size=8))
        return (kind, start, tuple(flips)), lambda d: _flip(d / "model.safetensors", start, flips)
    name = draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json", "model.safetensors"]))
    return (kind, name), lambda d: (d / name).unlink()


_DELETE = object()


def _edit_json(path: Path, changes: dict) -> None:
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def _edit_tokenizer(path: Path, how: str, cut: int, token_id: int) -> None:
    text = path.read_text()
    if how == "truncate":
        path.write_text(text[:cut])
        return
    raw = json.loads(text)
    vocab = raw["model"]["vocab"]
    token = sorted(vocab)[cut % len(vocab)]
    if how == "vocab-id":
        vocab[token] = token_id
    else:
        del vocab[token]
    path.write_text(json.dumps(raw))


def _edit_header(path: Path, field: str, index: int, value) -> None:
    data = path.read_bytes()
    length, = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[index % len(names)]
    if field == "delete":
        del header[name]
    elif field == "rename":
        header[str(value)[:30]] = header.pop(name)
    elif field == "metadata":
        header["__metadata__"] = value
    else:
        header[name][field] = value
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def _flip(path: Path, start: int, flips: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for i, b in enumerate(flips):
        if start + i < len(data):
            data[start + i] = b
    path.write_bytes(bytes(data))


def fuzz_hf(examples: int, workdir: Path, tried: set, outcomes: Counter, derandomize: bool,
            replay: int | None) -> None:
    base = tiny_hf_dir(workdir / "base")

    @seed(replay)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(hf_mutation())
    def case(mutation):
        label, edit = mutation
        tried.add(("hf",) + label)
        directory = workdir / "case"
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(base, directory)
        edit(directory)
        outcomes[checked(run_case, directory, directory, label)] += 1

    case()


def main(argv: list[str]) -> int:
    which, examples = argv[0], int(argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_BYTES, MEMORY_BYTES))
    signal.signal(signal.SIGALRM, _alarm)
    tried: set = set()
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        fuzz = fuzz_gguf if which == "gguf" else fuzz_hf
        replay = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else None
        fuzz(examples, Path(tmp), tried, outcomes, derandomize="--derandomize" in argv, replay=replay)
    print(json.dumps({"files": which, "examples": sum(outcomes.values()), "distinct_mutations": len(tried),
                      "outcomes": dict(outcomes)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
