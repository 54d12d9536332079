"""BlockLayout: the partition of DESIGN §1 and the block-major reorderings."""

import itertools
import math

import pytest
import torch

from mhla_gen import BlockLayout
from mhla_gen.layout import split_sizes

LAYOUTS = [
    ((12,), (3,)),  # 1D even
    ((13,), (5,)),  # 1D uneven
    ((8, 6), (2, 3)),  # 2D even
    ((7, 5), (3, 2)),  # 2D uneven
    ((4, 6, 8), (2, 3, 2)),  # 3D even
    ((3, 5, 6), (2, 2, 3)),  # 3D uneven
    ((5, 4), (1, 1)),  # one block
    ((4, 3), (4, 3)),  # one token per block
]


@pytest.mark.parametrize("grid, blocks", LAYOUTS)
def test_round_trip(grid, blocks):
    layout = BlockLayout(grid, blocks)
    x = torch.randn(2, 3, layout.num_tokens, 5)
    xb = layout.to_blocks(x)
    assert xb.shape == (2, 3, layout.num_blocks, layout.max_block_len, 5)
    assert torch.equal(layout.from_blocks(xb), x)
    # the fused no-autograd copies agree with the reshaping ones, dtype cast included
    assert torch.equal(layout.copy_to_blocks(x), xb)
    assert torch.equal(layout.copy_from_blocks(xb), x)
    assert torch.equal(layout.copy_to_blocks(x, torch.float64), xb.double())
    # padded slots are exactly zero and the mask marks the real tokens
    mask = layout.block_mask()
    assert int(mask.sum()) == layout.num_tokens
    assert torch.all(xb[..., ~mask, :] == 0)


@pytest.mark.parametrize("grid, blocks", LAYOUTS)
def test_block_index_is_a_row_major_tiling(grid, blocks):
    layout = BlockLayout(grid, blocks)
    index = layout.block_index
    assert index.shape == (layout.num_tokens,) and index.dtype == torch.long
    assert layout.num_blocks == math.prod(blocks)
    # per axis: contiguous ranges whose lengths differ by at most one
    for g, b, sizes in zip(grid, blocks, layout.axis_sizes):
        assert sum(sizes) == g and len(sizes) == b and max(sizes) - min(sizes) <= 1
    coords = torch.tensor(list(itertools.product(*[range(g) for g in grid])))  # row-major token coords
    starts = [torch.tensor([0, *itertools.accumulate(s)]) for s in layout.axis_sizes]
    for block in range(layout.num_blocks):
        members = coords[index == block]
        extent = []
        for axis, b_id in enumerate(int(c) for c in torch.unravel_index(torch.tensor(block), blocks)):
            lo, hi = int(starts[axis][b_id]), int(starts[axis][b_id + 1])
            assert members[:, axis].min() == lo and members[:, axis].max() == hi - 1  # contiguous tile
            extent.append(hi - lo)
        assert len(members) == math.prod(extent)  # the full box, nothing missing
    assert torch.equal(layout.block_lengths, torch.bincount(index, minlength=layout.num_blocks))
    assert layout.max_block_len == int(layout.block_lengths.max())
    assert layout.block_centers.shape == (layout.num_blocks, len(grid))


def test_row_major_block_ids_on_a_small_grid():
    layout = BlockLayout((4, 6), (2, 3))
    expected = torch.tensor([[0, 0, 1, 1, 2, 2]] * 2 + [[3, 3, 4, 4, 5, 5]] * 2).reshape(-1)
    assert torch.equal(layout.block_index, expected)


def test_split_sizes_match_tensor_split():
    for length, parts in [(7, 3), (10, 4), (5, 5), (9, 1)]:
        expected = [len(c) for c in torch.tensor_split(torch.arange(length), parts)]
        assert split_sizes(length, parts) == expected


@pytest.mark.parametrize(
    "grid, blocks, match",
    [
        ((4, 4), (5, 1), "blocks\\[0\\]=5"),
        ((4, 4), (0, 2), "blocks\\[0\\]=0"),
        ((4, 4), (2,), "different ranks"),
        ((2, 2, 2, 2), (1, 1, 1, 1), "1D, 2D or 3D"),
        ((4, 0), (1, 1), "length 0"),
        ((4.5, 4), (1, 1), "integers"),
    ],
)
def test_bad_layouts_raise(grid, blocks, match):
    with pytest.raises(ValueError, match=match):
        BlockLayout(grid, blocks)


def test_token_count_mismatch_raises():
    layout = BlockLayout((4, 4), (2, 2))
    with pytest.raises(ValueError, match="15"):
        layout.to_blocks(torch.zeros(1, 15, 2))
    with pytest.raises(ValueError, match="L_max"):
        layout.from_blocks(torch.zeros(1, 3, 4, 2))


def test_split_views_replayed_from_the_cache_match_fresh_views():
    """The cached geometry is keyed by sizes and strides and applied at the tensor's own storage offset."""
    layout = BlockLayout((4, 6), (2, 3))
    memory = torch.randn(2, 24, 3, 5)  # heads-interleaved, like diffusers' (B, N, H, d)
    views = [memory[:, :, h].unsqueeze(1) for h in range(3)]  # same sizes and strides, different offsets
    views.append(torch.randn(2, 1, 24, 5))  # same sizes, other strides
    for _ in range(2):  # the first pass fills the cache, the second replays it
        for x in views:
            assert torch.equal(layout.token_split_view(x), layout._token_split_view(x))
            xb = layout.copy_to_blocks(x)
            assert torch.equal(layout.block_split_view(xb), layout._block_split_view(xb))
            assert torch.equal(layout.copy_from_blocks(xb), x)


def test_split_views_stay_plain_views_under_autograd():
    layout = BlockLayout((4, 6), (2, 3))
    x = torch.randn(2, 24, 5, requires_grad=True)
    layout.token_split_view(x.detach())  # cache this geometry first
    view = layout.token_split_view(x)
    assert "AsStrided" not in type(view.grad_fn).__name__
    (view * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_split_views_pair_tokens_with_their_block_slots():
    layout = BlockLayout((4, 6), (2, 3))
    x = torch.randn(2, 24, 5)
    assert torch.equal(layout.token_split_view(x), layout.block_split_view(layout.to_blocks(x)))
    with pytest.raises(ValueError, match=r"\(7, 5\)"):
        BlockLayout((7, 5), (3, 2)).token_split_view(torch.zeros(1, 35, 2))
