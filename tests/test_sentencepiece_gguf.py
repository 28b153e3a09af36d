"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model "llama": Gemma, Mistral and
Llama 2 files) encode and decode as transformers' GGUF tokenizer does."""

from __future__ import annotations

import gguf
import pytest
from arch_models import spm_metadata, write_spm_vocabulary

from nanoserve.model.formats.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
TEXTS = ["hello world", "the rest of the world", "  two leading spaces", "héllo wörld ☃", "a\nnew line\tand tab",
         "<start_of_turn>user\nhello<end_of_turn>", "sting and stinging the worlds"]


def write_tokenizer_gguf(path, arch: str, metadata: dict):
    writer = gguf.GGUFWriter(str(path), arch)
    write_spm_vocabulary(writer, metadata)
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
