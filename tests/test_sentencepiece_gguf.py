"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model "llama": Gemma, Mistral and
Llama 2 files) encode and decode as transformers' GGUF tokenizer does."""

from __future__ import annotations

import gguf
import pytest

from nanoserve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
SPACE = "\u2581"
PIECES = [SPACE, "e", "t", "h", "a", "o", "l", "r", "s", "n", "w", "d", SPACE + "t", "he", SPACE + "the",
          SPACE + "a", "ll", "ell", "hell", "hello", SPACE + "w", "or", "wor", "ld", "world", SPACE + "world",
          "er", SPACE + "s", "st", SPACE + SPACE, "in", "ing", SPACE + "s" + "t"]
TEXTS = ["hello world", "the rest of the world", "  two leading spaces", "héllo wörld ☃", "a\nnew line\tand tab",
         "<start_of_turn>user\nhello<end_of_turn>", "sting and stinging the worlds"]


def spm_metadata(add_space_prefix: bool) -> dict:
    """A SentencePiece vocabulary laid out as llama.cpp's converter writes one: <unk>, <s>, </s>,
    the turn markers (control), 256 byte tokens, then pieces best-scored first."""
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def write_tokenizer_gguf(path, arch: str, metadata: dict):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(metadata["tokenizer.ggml.add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[("llama", True), ("gemma3", False)], ids=["llama", "gemma3"])
def tokenizers_pair(request, tmp_path_factory):
    arch, prefix = request.param
    metadata = spm_metadata(prefix)
    path = write_tokenizer_gguf(tmp_path_factory.mktemp(arch) / "tok.gguf", arch, metadata)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf_metadata(metadata), reference


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_encoding_matches_transformers(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_decoding_round_trips(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids)
    if not text.startswith(" "):  # both take a leading space for the prefix they strip
        assert ours.decode(ids) == text


def test_bytes_no_piece_covers_fall_back_to_byte_tokens(tokenizers_pair):
    ours, _ = tokenizers_pair
    ids = ours.encode("☃", add_special_tokens=False)
    snowman = [ours.backend.token_to_id(f"<0x{b:02X}>") for b in "☃".encode()]
    assert ids[-3:] == snowman
