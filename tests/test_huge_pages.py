"""The weights' move onto transparent huge pages and the K/V pool made there
(nanoserve/worker/huge_pages.py): what moves, that values and aliases survive it, and that an
engine built with or without them decodes the same tokens."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from nanoserve import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant.linear import GroupLinear
from nanoserve.worker import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="this OS has no MADV_HUGEPAGE (Linux only)")


def owned_by_torch(t: torch.Tensor) -> bool:
    return t.untyped_storage().resizable()  # a moved tensor views the arena's mapping: not resizable


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
        self.weight = nn.Parameter(big.clone(), requires_grad=False)
        self.register_buffer("table", big.clone().view(1024, 1024))
        self.register_buffer("rows", self.table[256:512])  # a view sharing the table's storage
        self.register_buffer("scales", torch.arange(1 << 15, dtype=torch.float16))  # 64 KiB: a product's scales
        self.register_buffer("small", torch.ones(16))
        mapping = mmap.mmap(-1, 4 << 20)
        self.register_buffer("mapped", torch.frombuffer(mapping, dtype=torch.float32))  # not torch's bytes
        self.tied = nn.Linear(1, 1)
        self.tied.weight = self.weight  # one Parameter in two modules


def test_owned_storages_of_a_page_or_more_move_and_keep_their_values_and_aliases():
    holder = Holder()
    expected = {name: t.clone() for name, t in holder.state_dict().items()}
    mapped_at = holder.mapped.data_ptr()
    moved = huge_pages.move_to_huge_pages(holder)
    assert moved == 2 * (4 << 20) + (64 << 10)  # the parameter's, the table's, the scales'; the view rides along
    for name, t in holder.state_dict().items():
        assert torch.equal(t, expected[name]), name
    assert not any(owned_by_torch(t) for t in (holder.weight, holder.table, holder.scales))
    assert holder.rows.untyped_storage().data_ptr() == holder.table.untyped_storage().data_ptr()
    assert holder.rows.data_ptr() == holder.table.data_ptr() + 256 * 1024 * 4
    assert holder.tied.weight is holder.weight and isinstance(holder.weight, nn.Parameter)
    assert owned_by_torch(holder.small) and holder.mapped.data_ptr() == mapped_at  # too small; not torch's
    for t in (holder.weight, holder.table, holder.scales):
        assert t.data_ptr() % 4096 == 0
    assert huge_pages.move_to_huge_pages(holder) == 0  # moved once: nothing left to move


def thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def smaps_field(address: int, field: str) -> int | None:
    """A /proc/self/smaps field of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return None


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="transparent huge pages are off on this host")
def test_the_arena_is_eligible_for_huge_pages():
    mapping, start = huge_pages.huge_page_arena(8 << 20)
    t = torch.frombuffer(mapping, dtype=torch.uint8, count=8 << 20, offset=start).fill_(1)
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert smaps_field(t.data_ptr(), "THPeligible") == 1


def test_zeros_on_huge_pages_are_zeros_of_their_shapes_each_on_its_own_pages():
    specs = [((512, 32, 128), torch.bfloat16), ((5, 3, 2), torch.float16), ((7,), torch.float32), ((2, 4), torch.int8)]
    tensors = huge_pages.zeros_on_huge_pages(specs)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == specs
    for i, t in enumerate(tensors):
        assert not t.any() and t.is_contiguous() and t.data_ptr() % huge_pages.ALIGN == 0
        t.fill_(i + 1)  # writable, and no write reaches another tensor
    assert [int(t.flatten()[0]) for t in tensors] == [1, 2, 3, 4] and all(bool((t == t.flatten()[0]).all())
                                                                           for t in tensors)
    if thp_mode() not in (None, "never"):  # a mapping holding a whole 2 MB page (the first tensor's 4 MB)
        assert smaps_field(tensors[0].data_ptr(), "THPeligible") == 1


@pytest.mark.parametrize("weights", ["int4", None])
def test_an_engine_decodes_the_same_tokens_with_and_without_huge_pages(weights):
    model = random_model(tiny_config(hidden_size=512, intermediate_size=1024, vocab_size=2048), seed=3)
    prompts = [[5, 17, 99, 3], [42, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, owned = {}, {}
    for huge in (True, False):
        engine = build_engine(random_model(model.config, seed=3) if huge else model, weights=weights,
                              max_batch_size=2, max_model_len=64, compile=False, huge_pages=huge)
        tokens[huge] = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        big = [t for t in engine.model.state_dict().values() if t.untyped_storage().nbytes() >= huge_pages.ALIGN]
        owned[huge] = {owned_by_torch(t) for t in big + engine.worker.cache.layers.tensors()}
        if weights == "int4":
            assert any(isinstance(m, GroupLinear) for m in engine.model.modules())
    assert tokens[True] == tokens[False]
    assert owned == {True: {False}, False: {True}}
