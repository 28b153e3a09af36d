"""`--chat-template FILE|NAME` / `chat_template=`: a model without a template of its own (a planted
GGUF here, as Gemma 3's files) chats through a jinja file or a built-in one, rendered in the
model template's sandbox; a name or file that is not a usable template is refused in one line
before any weights load, and a model that cannot chat says so before it loads."""

from __future__ import annotations

import re

import pytest
from conftest import served

from nanoserve.engine import EngineConfig, build_engine
from nanoserve.launch import main
from nanoserve.model.formats.chat_templates import BUILTIN, checked_chat_template
from nanoserve.model.formats.loader import load_tokenizer
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.serve.cli import describe_chat

CONFIG = tiny_config(vocab_size=260, tie_word_embeddings=True)
TWO_TURNS = [{"role": "user", "content": "Hi there "}, {"role": "assistant", "content": "Hello."}]
ENGINE = dict(weights="fp32", max_batch_size=2, max_model_len=128, kv_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def templateless_gguf(tmp_path_factory):
    """A tiny GGUF with a byte-level tokenizer and no chat template."""
    from conftest import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return str(write_gguf(path, CONFIG, unfuse_hf_weights(random_model(CONFIG, seed=0))))


def test_the_builtin_gemma_template_renders_a_two_turn_conversation_in_gemmas_format():
    text = checked_chat_template("gemma").render(TWO_TURNS, False, bos_token="<bos>")
    assert text == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
    # A system message leads the first user turn (Gemma has no system turn); the reply is the model's.
    system = [{"role": "system", "content": "Be terse."}, TWO_TURNS[0]]
    assert checked_chat_template("gemma").render(system, True, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("name, turn", [
    ("chatml", "<|im_start|>user\nHi there <|im_end|>\n"),
    ("llama3", "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"),
    ("mistral", "[INST] Hi there [/INST] Hello.</s>"),
])
def test_each_builtin_template_renders_its_formats_turns(name, turn):
    assert turn in checked_chat_template(name).render(TWO_TURNS, True, bos_token="<s>", eos_token="</s>")


def test_the_option_names_the_builtin_templates():
    assert set(BUILTIN) == {"chatml", "llama3", "gemma", "mistral"}
    help = EngineConfig.__dataclass_fields__["chat_template"].metadata["help"]
    assert all(name in help for name in BUILTIN)


def test_an_unknown_name_is_refused_in_one_line_listing_the_names(tmp_path):
    with pytest.raises(ValueError) as refused:
        EngineConfig(chat_template="gemma3")
    assert str(refused.value) == ("chat_template 'gemma3': neither a file nor a built-in template "
                                  "(chatml, gemma, llama3, mistral)")
    # Checked before the model is read: a missing model file is not what is reported.
    with pytest.raises(ValueError, match="gemma3"):
        build_engine(str(tmp_path / "missing.gguf"), chat_template="gemma3")


@pytest.mark.parametrize("source, why", [
    ("{% for message in messages %}{{ message.content }}", "line 1: Unexpected end of template"),
    ("{{ raise_exception('no system role') }}", "cannot render a sample conversation: no system role"),
    ("{{ messages[0].content + 1 }}", "cannot render a sample conversation"),
    ("{{ 'x' * 10**9 }}", "sandbox"),  # the model template's sandbox, limits included
    ("{{ add_generation_prompt }}", "leaves the messages out"),
])
def test_a_template_file_that_cannot_render_a_sample_conversation_is_refused_in_one_line(tmp_path, source, why):
    path = tmp_path / "template.jinja"
    path.write_text(source)
    with pytest.raises(ValueError, match=re.escape(why)) as refused:
        EngineConfig(chat_template=str(path))
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_a_template_file_is_the_engines_chat_template(templateless_gguf, tmp_path):
    path = tmp_path / "turns.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    engine = build_engine(templateless_gguf, chat_template=str(path), **ENGINE)
    assert engine.config.chat_template == str(path)
    assert engine.tokenizer.apply_chat_template(TWO_TURNS) == "[user] Hi there \n[assistant] Hello.\n[assistant]"
    assert engine.chat([{"role": "user", "content": "hi"}]).finish_reason in ("stop", "length")


def test_the_callers_tokenizer_keeps_its_own_template(templateless_gguf):
    tokenizer = load_tokenizer(templateless_gguf)
    engine = build_engine(random_model(CONFIG, seed=0), tokenizer=tokenizer, chat_template="chatml",
                          max_batch_size=2, kv_cache_bytes=1 << 20)
    assert tokenizer.chat_template is None and engine.tokenizer.chat_template is not None


def test_generate_chat_without_a_template_fails_in_one_line_before_the_weights_load(templateless_gguf, capsys,
                                                                                    monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("nanoserve.engine.build_engine", no_load)
    assert main(["generate", "--model", templateless_gguf, "--chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template" in err and "--chat-template FILE|NAME" in err, err
    assert "chatml, gemma, llama3, mistral" in err


def test_generate_chat_with_the_gemma_template_prompts_in_gemmas_format(templateless_gguf, capsys):
    assert main(["generate", "--model", templateless_gguf, "--weights", "fp32", "--chat-template", "gemma",
                 "--chat", "--max-tokens", "2", "hi"]) == 0
    tokenizer = load_tokenizer(templateless_gguf)
    prompt = checked_chat_template("gemma").render([{"role": "user", "content": "hi"}], True,
                                                    eos_token=tokenizer.special_tokens["eos_token"])
    assert prompt.startswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert f"[{len(tokenizer.encode(prompt))} prompt + " in capsys.readouterr().err


def test_a_server_says_at_start_whether_it_can_chat(templateless_gguf):
    line, available = describe_chat(build_engine(templateless_gguf, **ENGINE))
    assert not available and line.startswith("chat unavailable: the model has no chat template")
    assert "--chat-template FILE|NAME" in line
    assert describe_chat(build_engine(templateless_gguf, chat_template="chatml", **ENGINE)) == (
        "chat template: 'chatml'", True)


def test_the_chat_route_serves_a_model_through_its_given_template(templateless_gguf):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    engine = build_engine(templateless_gguf, chat_template="gemma", **ENGINE)
    with served(engine, "tiny", None) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert response.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt))
