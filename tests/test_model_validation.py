"""A model file's own claims are checked at load: a broken or hostile GGUF file or Hugging Face
directory is refused with one ModelLoadError naming the file and the field, before the
tokenizer library, the model code or a chat request trips over it."""

from __future__ import annotations

import json
import struct

import pytest
from gguf_files import V, tiny_chat_gguf

from nanoserve.launch import main
from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.loader import load_config, load_model

# The chat-template payload of llama-cpp-python's template-injection advisory: it reaches for
# os through a global's __init__; the sandbox must stop it and the file be refused.
PAYLOAD = "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}"


def refused(path, *patterns: str) -> str:
    """The one-line refusal of loading `path`; it names the file and matches each pattern."""
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for pattern in patterns:
        assert pattern in message, message
    return message


def test_tiny_chat_gguf_loads_and_renders_its_template(tmp_path):
    model, tokenizer = load_model(str(tiny_chat_gguf().write(tmp_path / "ok.gguf")))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and model.config.vocab_size == tokenizer.vocab_size


def test_template_reaching_for_python_internals_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    d = tiny_chat_gguf()
    d.set("tokenizer.chat_template", PAYLOAD % marker, V.STRING)
    path = d.write(tmp_path / "hostile.gguf")
    refused(path, "tokenizer.chat_template", "SecurityError")
    assert main(["generate", "--model", str(path), "--chat", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nanoserve: error: {path}: tokenizer.chat_template") and "\n" not in err
    assert not marker.exists()


@pytest.mark.parametrize("template, reason", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ raise_exception('no') }}", "no"),
    ("{{ messages[5].content.upper() }}", "UndefinedError"),
    ("{{ 'x' * 10**12 }}", "SecurityError"),
    ("{{ messages.append(1) }}", "SecurityError"),
], ids=["syntax", "raises", "undefined", "size-bomb", "mutates"])
def test_template_that_fails_its_probe_is_refused_with_the_reason(tmp_path, template, reason):
    d = tiny_chat_gguf()
    d.set("tokenizer.chat_template", template, V.STRING)
    refused(d.write(tmp_path / "template.gguf"), "tokenizer.chat_template", reason)


def test_vocabulary_shorter_than_the_embedding_is_refused(tmp_path):
    d = tiny_chat_gguf()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        value, vtype, sub = d.fields[key]
        d.set(key, value[:200], vtype, sub)
    d.set("tokenizer.ggml.bos_token_id", 0, V.UINT32)
    d.set("tokenizer.ggml.eos_token_id", 1, V.UINT32)
    refused(d.write(tmp_path / "short.gguf"), "tokenizer.ggml.tokens has 200 tokens",
            "token_embd.weight has 264 rows")


def test_eos_outside_the_vocabulary_is_refused(tmp_path, capsys):
    d = tiny_chat_gguf()
    d.set("tokenizer.ggml.eos_token_id", 99999, V.UINT32)
    path = d.write(tmp_path / "eos.gguf")
    refused(path, "tokenizer.ggml.eos_token_id is 99999, outside the vocabulary")
    assert main(["generate", "--model", str(path), "hello"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("key, value, vtype, sub, pattern", [
    ("tokenizer.ggml.token_type", [1] * 10, V.ARRAY, V.INT32, "token_type has 10 entries for 264 tokens"),
    ("tokenizer.ggml.scores", [0.5] * 300, V.ARRAY, V.FLOAT32, "scores has 300 entries for 264 tokens"),
    ("tokenizer.ggml.token_type", [9] * 264, V.ARRAY, V.INT32, "holds 9, not a token type"),
    ("tokenizer.ggml.merges", ["Ġ t", "x yz"], V.ARRAY, V.STRING, "merges[1] ('x yz') needs the token 'yz'"),
    ("tokenizer.ggml.merges", ["Ġt"], V.ARRAY, V.STRING, "merges[0] is 'Ġt', not 'left right'"),
    ("tokenizer.ggml.padding_token_id", 264, V.UINT32, None, "padding_token_id is 264, outside"),
    ("llama.block_count", "two", V.STRING, None, "llama.block_count must be an integer, got 'two'"),
    ("llama.block_count", 3, V.UINT32, None, "block_count is 3 but the file has no tensors for layer 2"),
    ("llama.block_count", 1, V.UINT32, None, "block_count is 1 but the file has tensors for layer 1"),
    ("llama.context_length", 0, V.UINT32, None, "llama.context_length must be in [1,"),
    ("llama.context_length", 2 ** 40, V.UINT64, None, "llama.context_length must be in [1,"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, V.FLOAT32, None, "epsilon must be above 0"),
    ("llama.rope.freq_base", float("nan"), V.FLOAT32, None, "freq_base must be finite"),
    ("llama.attention.head_count_kv", 3, V.UINT32, None, "head_count (2) is not a multiple of"),
    ("llama.vocab_size", 100, V.UINT32, None, "vocab_size is 100 but tokenizer.ggml.tokens has 264"),
    ("tokenizer.chat_template", 7, V.UINT32, None, "chat_template must be a string"),
], ids=lambda v: v if isinstance(v, str) and v.startswith(("tokenizer", "llama")) else None)
def test_metadata_that_contradicts_itself_is_refused_naming_the_field(tmp_path, key, value, vtype, sub, pattern):
    d = tiny_chat_gguf()
    d.set(key, value, vtype, sub)
    refused(d.write(tmp_path / "bad.gguf"), pattern)


def test_load_config_checks_the_file_too(tmp_path):
    d = tiny_chat_gguf()
    d.set("tokenizer.ggml.bos_token_id", 4000, V.UINT32)
    path = d.write(tmp_path / "bos.gguf")
    with pytest.raises(ModelLoadError, match="bos_token_id is 4000"):
        load_config(str(path))


def test_chat_without_a_template_says_so_in_one_line(tmp_path, capsys):
    d = tiny_chat_gguf()
    del d.fields["tokenizer.chat_template"]
    path = d.write(tmp_path / "plain.gguf")
    assert main(["generate", "--model", str(path), "--max-tokens", "2", "hello"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--chat", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"nanoserve: error: {path}: the model has no chat template; give one with --chat-template "
                   "FILE|NAME (built-in: chatml, gemma, llama3, mistral) or run without --chat")


# -- Hugging Face directories ------------------------------------------------------------------

@pytest.fixture
def hf_dir(tiny_llama_dir, tmp_path):
    """A copy of the tiny Llama directory to break."""
    import shutil

    return shutil.copytree(tiny_llama_dir, tmp_path / "model")


def _edit_json(path, **changes):
    raw = json.loads(path.read_text()) if path.is_file() else {}
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_hf_directory_loads_when_nothing_is_wrong(hf_dir):
    model, tokenizer = load_model(str(hf_dir))
    assert tokenizer.vocab_size <= model.config.vocab_size


@pytest.mark.parametrize("changes, pattern", [
    ({"vocab_size": "320"}, "config.json: vocab_size must be an integer, got '320'"),
    ({"num_hidden_layers": 0}, "config.json: num_hidden_layers must be in [1,"),
    ({"rms_norm_eps": -1}, "config.json: rms_norm_eps must be in [0, 1], got -1"),
    ({"eos_token_id": 5000}, "config.json: eos_token_id is 5000, outside the vocabulary"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor must be a positive number"),
    ({"vocab_size": 100}, "tokenizer.json: the tokenizer has token id 274 but config.json's vocab_size is 100"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but the safetensors files hold layer 1"),
], ids=["type", "range", "eps", "eos-id", "rope", "vocab-rows", "layers"])
def test_hf_config_that_contradicts_the_files_is_refused(hf_dir, changes, pattern):
    _edit_json(hf_dir / "config.json", **changes)
    with pytest.raises(ModelLoadError, match=None) as err:
        load_model(str(hf_dir))
    assert pattern in str(err.value) and str(hf_dir) in str(err.value)


def test_hf_special_token_outside_the_vocabulary_is_refused(hf_dir):
    _edit_json(hf_dir / "tokenizer_config.json", eos_token="<|not-a-token|>")
    refused_dir = pytest.raises(ModelLoadError, match="tokenizer_config.json: eos_token '<|not-a-token|>' is not in")
    with refused_dir:
        load_model(str(hf_dir))


def test_hf_hostile_template_is_refused_and_never_runs(hf_dir):
    marker = hf_dir / "payload-ran"
    (hf_dir / "chat_template.jinja").write_text(PAYLOAD % marker)
    with pytest.raises(ModelLoadError, match="chat_template.jinja: chat_template: .*SecurityError"):
        load_model(str(hf_dir))
    assert not marker.exists()


def test_hf_unreadable_tokenizer_files_are_refused(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: not valid JSON"):
        load_model(str(hf_dir))
    (hf_dir / "tokenizer_config.json").write_text("{}")
    (hf_dir / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot read tokenizer"):
        load_model(str(hf_dir))


def _rewrite_header(path, edit):
    data = path.read_bytes()
    length, = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


@pytest.mark.parametrize("edit, pattern", [
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype="F33"), "unknown dtype 'F33'"),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=[-1, 4]), "is not a list of sizes"),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(data_offsets=[0, 2 ** 62]),
     "are not a byte range inside"),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=[1]), "needs 4 bytes, data_offsets give"),
], ids=["dtype", "shape", "offsets", "size"])
def test_malformed_safetensors_header_is_refused_naming_the_tensor(hf_dir, edit, pattern):
    path = hf_dir / "model.safetensors"
    _rewrite_header(path, edit)
    with pytest.raises(ModelLoadError, match="model.safetensors: safetensors tensor ") as err:
        load_model(str(hf_dir))
    assert pattern in str(err.value)


def test_safetensors_header_longer_than_the_file_is_refused(hf_dir):
    path = hf_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2 ** 60) + data[8:])
    with pytest.raises(ModelLoadError, match="safetensors header claims"):
        load_model(str(hf_dir))


def test_chat_route_without_a_template_is_a_400(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from conftest import served

    from nanoserve.engine import build_engine

    d = tiny_chat_gguf()
    del d.fields["tokenizer.chat_template"]
    model, tokenizer = load_model(str(d.write(tmp_path / "plain.gguf")))
    engine = build_engine(model, tokenizer=tokenizer, max_batch_size=1, max_model_len=32, kv_cache_bytes=1 << 20)
    with served(engine, "plain", None) as server:
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        completion = httpx.post(f"{server.url}/v1/completions", json={"model": "plain", "prompt": "hi",
                                                                       "max_tokens": 2}, timeout=30)
    assert response.status_code == 400 and "has no chat template" in response.json()["error"]["message"]
    assert completion.status_code == 200


def test_hf_merge_whose_join_is_missing_is_refused_not_a_panic(hf_dir):
    raw = json.loads((hf_dir / "tokenizer.json").read_text())
    left, right = raw["model"]["merges"][-1] if isinstance(raw["model"]["merges"][-1], list) \
        else raw["model"]["merges"][-1].split(" ")
    del raw["model"]["vocab"][left + right]  # the tokenizers library panics on this
    (hf_dir / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=f"tokenizer.json: model.merges\\[{len(raw['model']['merges']) - 1}\\]"):
        load_model(str(hf_dir))
