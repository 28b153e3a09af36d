"""The bucketing arithmetic: bucket lists, bucket_for, and the waste figure."""

import pytest

from nanoserve.worker.bucketing import (
    Buckets,
    PaddingWaste,
    bucket_for,
    default_row_buckets,
    default_width_buckets,
)


def test_row_buckets_cover_max_batch_size_and_end_there():
    assert default_row_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_row_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert default_row_buckets(5) == (1, 2, 4, 5)
    assert default_row_buckets(1) == (1,)


def test_width_buckets_are_block_multiples_growing_to_max_model_len():
    widths = default_width_buckets(16, 1000)
    assert widths == (64, 128, 256, 512, 1000)
    assert all(w % 16 == 0 for w in widths[:-1])


def test_bucket_for_is_the_smallest_bucket_that_fits():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


@pytest.mark.parametrize("n", [0, 9])
def test_bucket_for_refuses_what_does_not_fit(n):
    with pytest.raises(ValueError, match="does not fit"):
        bucket_for(n, (1, 2, 4, 8))


def test_buckets_reject_unsorted_lists():
    with pytest.raises(ValueError, match="increasing"):
        Buckets((1, 4, 2), (64,))


def test_shape_for_pads_both_axes():
    buckets = Buckets((1, 2, 4, 8), (64, 128, 256))
    assert buckets.shape_for(3, 65) == (4, 128)
    assert len(buckets.grid) == 12


def test_waste_counts_padded_cells_per_real_cell():
    waste = PaddingWaste()
    waste.add(4 * 64, context_lens_sum=3 * 40)
    assert waste.real_cells == 120 and waste.padded_cells == 4 * 64 - 120
    assert waste.ratio == pytest.approx((256 - 120) / 120)
