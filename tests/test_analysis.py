"""Attention-map statistics: stochastic rows, entropy, and the rank claim of the paper's Table 1."""

import math

import pytest
import torch

from mhla_gen import (
    BlockLayout,
    attention_matrix,
    attention_rank,
    compare_attention,
    locality_init,
    row_entropy,
)
from mhla_gen.metrics.attention_maps import ATTENTION_KINDS, mirror_block_share, mirror_mass


@pytest.fixture
def setup(make_qkv):
    layout = BlockLayout((8, 8), (4, 4))
    q, k, _ = make_qkv(64, batch=1, heads=2, dim=4)
    return q, k, layout, locality_init(layout)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
def test_maps_are_row_stochastic(kind, feature_map, setup):
    q, k, layout, mixing = setup
    attn = attention_matrix(q, k, kind, layout, mixing, feature_map=feature_map)
    assert attn.shape == (1, 2, 64, 64) and attn.dtype == torch.float64
    assert torch.all(attn >= 0)
    sums = attn.sum(dim=-1)
    # a ReLU query with no positive coordinate attends to nothing: its row is all zero, not NaN
    silent = (q <= 0).all(dim=-1)
    if kind == "softmax" or feature_map != "relu":
        silent = torch.zeros_like(silent)
    torch.testing.assert_close(sums[~silent], torch.ones_like(sums[~silent]))
    assert torch.all(sums[silent] == 0)
    if feature_map == "relu" and kind != "softmax":
        assert silent.any()  # the case above is exercised by this seed


def test_uniform_rows_have_entropy_log_n():
    for n in (1, 7, 64):
        uniform = torch.full((2, 3, n, n), 1.0 / n)
        torch.testing.assert_close(row_entropy(uniform), torch.full((2, 3), math.log(n), dtype=torch.float64))
    one_hot = torch.eye(5).expand(1, 1, 5, 5)
    assert torch.all(row_entropy(one_hot) == 0)


def test_mhla_rank_exceeds_head_dim_linear_does_not(setup):
    """Table 1: φ(Q)φ(K)ᵀ has rank <= d; block mixing lifts MHLA's rank above d."""
    q, k, layout, mixing = setup
    d = q.shape[-1]
    linear_rank = attention_rank(attention_matrix(q, k, "linear"))
    mhla_rank = attention_rank(attention_matrix(q, k, "mhla", layout, mixing))
    assert torch.all(linear_rank <= d)
    assert torch.all(mhla_rank > d)
    assert torch.all(mhla_rank <= layout.num_blocks * d)  # rank(W ⊗ 1) · d bounds it


def test_compare_attention_reports_every_kind(setup):
    q, k, layout, mixing = setup
    stats = compare_attention(q, k, layout, mixing)
    assert set(stats) == set(ATTENTION_KINDS)
    assert stats["linear"]["rank"] <= q.shape[-1] < stats["mhla"]["rank"]
    for kind in ATTENTION_KINDS:
        assert 0 < stats[kind]["entropy"] <= math.log(64) + 1e-9


def test_bad_arguments_raise(setup):
    q, k, _, _ = setup
    with pytest.raises(ValueError, match="'cosine'"):
        attention_matrix(q, k, "cosine")
    with pytest.raises(ValueError, match="layout and a mixing"):
        attention_matrix(q, k, "mhla")


@pytest.mark.parametrize("grid", [(4, 6), (2, 3, 4)])
def test_mirror_mass_scores_the_horizontally_mirrored_key(grid):
    n = math.prod(grid)
    index = torch.arange(n).reshape(grid)
    mirror = torch.zeros(1, 2, n, n)
    mirror[..., index.reshape(n), index.flip(-1).reshape(n)] = 1.0  # each query copies its mirror token
    assert mirror_mass(mirror, grid).tolist() == [[1.0, 1.0]]
    assert mirror_mass(torch.full((1, 1, n, n), 1 / n), grid).item() == pytest.approx(1 / n)
    assert mirror_mass(torch.eye(n)[None, None], grid).item() == 0.0  # even width: no token is its mirror
    other = torch.zeros(1, 1, n, n)  # mirrored across the other axis instead
    other[..., index.reshape(n), index.flip(-2).reshape(n)] = 1.0
    assert mirror_mass(other, grid).item() == 0.0


def test_mirror_mass_refuses_a_grid_that_is_not_the_maps():
    with pytest.raises(ValueError, match="2D or 3D token grid with N = 16"):
        mirror_mass(torch.eye(16)[None, None], (4, 5))
    with pytest.raises(ValueError, match="2D or 3D"):
        mirror_mass(torch.eye(16)[None, None], (16,))


def test_mirror_block_share_reads_the_mixing_rows():
    blocks = (2, 4)
    mirror = torch.tensor([3, 2, 1, 0, 7, 6, 5, 4])
    routed = torch.full((8, 8), 0.1)
    routed[torch.arange(8), mirror] = 0.3  # 0.3 of each row's 1.0 on the mirrored block
    assert mirror_block_share(routed, blocks) == pytest.approx(0.3)
    assert mirror_block_share(torch.ones(8, 8), blocks) == pytest.approx(1 / 8)
    assert mirror_block_share(torch.eye(8), blocks) == 0.0
    with pytest.raises(ValueError, match="block grid of M = 8"):
        mirror_block_share(torch.eye(8), (8,))
