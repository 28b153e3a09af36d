"""compile/quantised_files: the model laid out wider for llama.cpp's 256-weight super-blocks is
the same function."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from compile.model_files import Shape, write_model
from compile.quantised_files import write_padded
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.fidelity import teacher_forced_logits


def test_a_padded_model_gives_the_logits_of_the_model_it_pads(tmp_path):
    # 6 query heads in 2 K/V groups of 3; 512 wide holds 8 heads, groups of 4 with a zero head each.
    shape = Shape(hidden=384, layers=2, heads=6, kv_heads=2, ffn=512, tied=True)
    source = write_model(tmp_path / "f32.gguf", shape, "F32")
    write_padded(source, tmp_path / "padded.gguf", 512)
    widths = {t.name: int(t.shape[0]) for t in GGUFReader(tmp_path / "padded.gguf").tensors}
    assert all(w % 256 == 0 for w in widths.values()), widths
    ids = list(range(5, 40))
    with torch.no_grad():
        theirs, _ = load_model(str(source), with_tokenizer=False)
        ours, _ = load_model(str(tmp_path / "padded.gguf"), with_tokenizer=False)
        want, got = teacher_forced_logits(theirs, ids), teacher_forced_logits(ours, ids)
    assert (ours.config.hidden_size, ours.config.num_heads, ours.config.num_kv_heads) == (512, 8, 2)
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item())


def test_a_width_that_cannot_keep_the_groups_is_refused(tmp_path):
    shape = Shape(hidden=384, layers=1, heads=6, kv_heads=2, ffn=512, tied=True)
    source = write_model(tmp_path / "f32.gguf", shape, "F32")
    with pytest.raises(ValueError, match="K/V groups"):
        write_padded(source, tmp_path / "padded.gguf", 448)  # 7 heads: not whole groups
