"""BlockLayout: the near-equal partition and the block-major reorderings."""

import itertools
import math

import pytest
import torch

from mhla_gen import BlockLayout
from mhla_gen.ops.layout import split_sizes

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
    parts = layout.to_blocks(x)
    assert [p.shape for p in parts] == [(s.num_blocks, 2, 3, s.block_len, 5) for s in layout.subgrids]
    assert torch.equal(layout.from_blocks(parts), x)
    assert sum(p.shape[0] * p.shape[3] for p in parts) == layout.num_tokens  # no padding anywhere
    # heads-interleaved memory (B, N, H, c) seen as (B, H, N, c): the views read it in place
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    for a, b in zip(layout.to_blocks(strided), parts):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grid, blocks", LAYOUTS)
def test_subgrids_tile_the_grid_with_equal_blocks(grid, blocks):
    """At most 2 runs per axis; every block of a sub-grid holds exactly the tokens of one layout block."""
    layout = BlockLayout(grid, blocks)
    assert len(layout.subgrids) <= 2 ** len(grid)
    assert (len(layout.subgrids) == 1) == layout.is_even
    assert sorted(layout.block_order) == list(range(layout.num_blocks))
    assert layout.natural_order == (layout.block_order == list(range(layout.num_blocks)))
    token_ids = torch.arange(layout.num_tokens, dtype=torch.float64).view(1, 1, -1, 1)
    index = layout.block_index
    for sub, part in zip(layout.subgrids, layout.to_blocks(token_ids)):
        for local in range(sub.num_blocks):
            block = layout.block_order[sub.offset + local]
            members = part[local, 0, 0, :, 0].long()
            assert torch.equal(members, (index == block).nonzero().squeeze(-1))  # row-major inside the block


@pytest.mark.parametrize("max_tokens", [1, 7, 40, 10**6])
@pytest.mark.parametrize("grid, blocks", LAYOUTS)
def test_slabs_are_sub_grids_in_the_same_block_order(grid, blocks, max_tokens):
    """Cutting sub-grids into slabs of block rows keeps every block's tokens and the block order: the
    slabs' token views hold the tokens of the sub-grid's consecutive blocks."""
    layout = BlockLayout(grid, blocks)
    token_ids = torch.arange(layout.num_tokens, dtype=torch.float64).view(1, 1, -1, 1)
    for sub, part in zip(layout.subgrids, layout.to_blocks(token_ids)):
        slabs = sub.slabs(max_tokens)
        assert sum(s.num_blocks for s in slabs) == sub.num_blocks
        for slab in slabs:
            assert slab.num_blocks * slab.block_len <= max(
                max_tokens, sub.num_blocks // sub.counts[0] * sub.block_len
            )
            own = part[slab.offset - sub.offset : slab.offset - sub.offset + slab.num_blocks]
            view = slab.token_view(token_ids, layout.grid).reshape(own.shape)
            assert torch.equal(view, own)


def test_large_grids_are_cut_into_slabs():
    """A quarter of the tokens at most (never below CHUNK_MIN_TOKENS): the real Wan grid's large
    sub-grid in three frame slabs; small grids keep their sub-grids."""
    wan = BlockLayout((21, 30, 52), (3, 5, 10))
    assert [(c.counts, c.offset) for c in wan.chunks] == [
        ((3, 5, 2), 0),
        ((1, 5, 8), 30),
        ((1, 5, 8), 70),
        ((1, 5, 8), 110),
    ]
    assert len(BlockLayout((128, 128), (4, 4)).chunks) == 4  # SANA 4096 px: 4 x 4096 tokens
    assert BlockLayout((32, 32), (4, 4)).chunks == BlockLayout((32, 32), (4, 4)).subgrids


@pytest.mark.parametrize(
    "grid, blocks", [((7, 5), (3, 2)), ((3, 5, 6), (2, 2, 3)), ((21, 30, 52), (3, 5, 10))]
)
def test_mixing_block_order_round_trip(grid, blocks):
    layout = BlockLayout(grid, blocks)
    w = torch.randn(layout.num_blocks, layout.num_blocks)
    ordered = layout.mixing_in_block_order(w)
    order = layout.block_order
    assert torch.equal(ordered[1, 2], w[order[1], order[2]])
    assert torch.equal(layout.mixing_from_block_order(ordered), w)


def test_the_real_wan_grid_is_eight_boxes():
    """480x832x81 -> tokens (21, 30, 52) in (3, 5, 10) blocks: 52 = 2 x 6 + 8 x 5."""
    layout = BlockLayout((21, 30, 52), (3, 5, 10))
    assert len(layout.subgrids) == 2
    assert [(s.counts, s.sizes) for s in layout.subgrids] == [((3, 5, 2), (7, 6, 6)), ((3, 5, 8), (7, 6, 5))]
    assert len(BlockLayout((21, 31, 52), (2, 5, 10)).subgrids) == 8


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
        layout.to_blocks(torch.zeros(1, 1, 15, 2))
