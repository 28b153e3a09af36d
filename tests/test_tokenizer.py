"""Tokenizer: parity with the reference on the default model, pre-tokenizer rules, chat templates,
and incremental detokenisation that never splits a character."""

from __future__ import annotations

import jinja2
import pytest

from nanoserve.model.formats.tokenizer import IncrementalDetokenizer, Tokenizer, _bytes_to_unicode

ALPHABET = list(_bytes_to_unicode().values())
PARITY_STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "café naïve résumé Ünïcödé façade",
    "日本語のテキスト、中文文本와 한국어",
    "emoji 🦙🚀 and a family 👩\u200d👩\u200d👧 done",
    "def f(x):\n\tif x:\n\t\treturn  x    + 1\n",
    "a\tb\t\tc   d\n\n\ne    ",
    "numbers 12345 and 3.14159, year 2024",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    " ",
    "\n\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🦙"},
     {"role": "user", "content": "Tell me about café culture\n\twith tabs."}],
]
MULTI_TOKEN_TEXT = "naïve 日本語 🦙🚀 👩\u200d👩\u200d👧 ok"


def byte_level_metadata(pre: str = "default", extra: tuple[str, ...] = (), merges: tuple[str, ...] = (),
                        template: str | None = None) -> dict:
    """GGUF tokenizer metadata for a vocabulary of the 256 byte symbols plus `extra` tokens,
    then two control tokens, <s> and </s>."""
    tokens = ALPHABET + list(extra) + ["<s>", "</s>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3], "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": len(tokens) - 2, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    if template:
        metadata["tokenizer.chat_template"] = template
    return metadata


# --- parity with the reference tokenizer on the default model ----------------------------------

@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.mark.model
@pytest.mark.parametrize("text", PARITY_STRINGS)
def test_encode_matches_reference(tokenizer, hf_smollm2_tokenizer, text):
    assert tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(
        text, add_special_tokens=False)


@pytest.mark.model
@pytest.mark.parametrize("text", PARITY_STRINGS)
def test_decode_matches_reference_and_round_trips(tokenizer, hf_smollm2_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_smollm2_tokenizer.decode(
        ids, skip_special_tokens=True)


@pytest.mark.model
def test_special_ids_match_reference(tokenizer, hf_smollm2_tokenizer):
    ref = hf_smollm2_tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 2)
    assert tokenizer.stop_token_ids == (2,)
    assert tokenizer.vocab_size == 49152


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn"])
def test_chat_template_renders_like_reference(tokenizer, hf_smollm2_tokenizer, conversation,
                                              add_generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ref = hf_smollm2_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
    assert ours == ref
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_smollm2_tokenizer.encode(ref, add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|> stays one control token


@pytest.mark.model
def test_incremental_detokenizer_on_real_vocabulary(tokenizer):
    ids = tokenizer.encode(MULTI_TOKEN_TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == MULTI_TOKEN_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some characters really did span tokens and were held back


# --- pre-tokenizer rules, chat templates and detokenising on planted vocabularies --------------

def test_smollm_pre_tokenizer_splits_digits_one_by_one():
    """SmolLM2's own tokenizer (and llama.cpp's 'smollm' rule) never merges digits; plain GPT-2 does."""
    metadata = dict(extra=("12", "123"), merges=("1 2", "12 3"))
    digits = Tokenizer.from_gguf_metadata(byte_level_metadata("smollm", **metadata))
    gpt2 = Tokenizer.from_gguf_metadata(byte_level_metadata("default", **metadata))
    assert len(digits.encode("123")) == 3
    assert gpt2.encode("123") == [256 + 1]


def test_control_tokens_match_whole_and_bos_is_added_when_the_file_says_so():
    metadata = byte_level_metadata()
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("a</s>") == [ALPHABET.index("a"), tok.eos_token_id]
    with_bos = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("a") == [with_bos.bos_token_id, ALPHABET.index("a")]
    assert with_bos.encode("a", add_special_tokens=False) == [ALPHABET.index("a")]


def test_unsupported_tokenizer_model_is_refused():
    with pytest.raises(ValueError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({**byte_level_metadata(), "tokenizer.ggml.model": "bert"}, source="x.gguf")


def test_chat_template_helpers_work_like_transformers():
    template = ("{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}"
                "{% for m in messages %}{{ bos_token }}{{ m | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata(template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>{"role": "user", "content": "é"}\n>'
    with pytest.raises(jinja2.exceptions.TemplateError, match="too long"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 3)


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_gguf_metadata(byte_level_metadata()).apply_chat_template([])


def test_incremental_detokenizer_holds_partial_characters():
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata())  # one token per byte
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("aé🦙")  # 1 + 2 + 4 bytes
    assert [detok.add(i) for i in ids] == ["a", "", "é", "", "", "", "🦙"]
    assert detok.text == "aé🦙"


def test_incremental_detokenizer_flush_releases_an_unfinished_character():
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata())
    detok = IncrementalDetokenizer(tok)
    first_byte_of_llama = tok.encode("🦙")[0]
    assert detok.add(first_byte_of_llama) == ""
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_can_skip_special_tokens():
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata())
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    out = "".join(detok.add(i) for i in tok.encode("hi</s>"))
    assert out + detok.flush() == "hi"
