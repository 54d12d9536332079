"""Mixing matrix: the locality-biased initialisations and the [0, 1] constraint."""

import math

import pytest
import torch
from torch import nn

from mhla_gen import BlockLayout, MixingMatrix, clamp_mixing_, locality_init
from mhla_gen.ops.mixing import INIT_RULES


def _linear_rule_by_hand(layout):
    """The paper's rule: W⁰[i, j] ∝ 1 − dist(i, j) / max_k dist(i, k) over block centres, in loops."""
    centres = layout.block_centers.tolist()
    dist = [[sum((a - b) ** 2 for a, b in zip(ci, cj)) ** 0.5 for cj in centres] for ci in centres]
    return torch.tensor([[1 - d_ij / max(row) for d_ij in row] for row in dist], dtype=torch.float64)


@pytest.mark.parametrize("blocks, grid", [((4,), (16,)), ((3, 4), (6, 8)), ((2, 3, 2), (4, 6, 4))])
def test_linear_rule_matches_design(blocks, grid):
    layout = BlockLayout(grid, blocks)
    raw = _linear_rule_by_hand(layout)
    rows = locality_init(layout, "linear", normalize="row")
    # computed in float64 and rounded once to float32: |error| <= 2^-24 |value| (+ float64 noise)
    expected = raw / raw.sum(dim=1, keepdim=True)
    torch.testing.assert_close(rows.double(), expected, atol=0, rtol=torch.finfo(torch.float32).eps)
    cols = locality_init(layout, "linear", normalize="column")  # the release's rule, see below
    torch.testing.assert_close(cols.sum(dim=0), torch.ones(layout.num_blocks))
    # each block weights itself most, its farthest block zero
    assert torch.all(rows.argmax(dim=1) == torch.arange(layout.num_blocks))
    assert torch.all(rows.min(dim=1).values == 0)


def _release_rule(blocks, rule, exp_sigma=3.0, local_thres=1.5):
    """The original release's init (DAGroup-PKU/MHLA, BlockDistanceConv3D._apply_transform; the 2D class
    has the same rules), rewritten here from its description: float32 block centres (index + 0.5),
    pairwise Euclidean norms in loops, D = the largest distance in the matrix, then per rule."""
    import itertools
    import math

    centres = torch.tensor([[i + 0.5 for i in idx] for idx in itertools.product(*map(range, blocks))])
    n = len(centres)
    dist = torch.zeros(n, n)
    for i in range(n):
        for j in range(n):
            dist[i, j] = torch.norm(centres[i] - centres[j], p=2)
    big = dist.max()
    if rule == "linear":
        mat = 1.0 - dist / big
    elif rule == "cos":
        mat = torch.cos(dist / big * math.pi / 4)
    elif rule == "exp":
        mat = torch.exp(-dist / exp_sigma)
    elif rule == "local":
        mat = (dist <= local_thres).float()
    else:  # gaussian: sigma from the largest distance, returned without normalisation
        sigma = big / 3
        return torch.exp(-(dist**2) / (2 * sigma**2))
    return mat / mat.sum(dim=0, keepdim=True)


@pytest.mark.parametrize("blocks", [(4, 4), (2, 3), (3, 5, 10), (2, 2, 3)])
@pytest.mark.parametrize("rule, temperature", [("linear", 1.0), ("cos", 1.0), ("exp", 3.0), ("local", 1.5),
                                               ("gaussian", 1.0)])
def test_column_mode_is_the_release_rule(blocks, rule, temperature):
    """normalize="column" reproduces the release's init exactly (up to its float32 arithmetic)."""
    layout = BlockLayout(blocks, blocks)  # one token per block: the init depends on the blocks only
    ours = locality_init(layout, rule, normalize="column", temperature=temperature)
    # The release works in float32: each entry (<= 1) comes from at most 8 roundings before the column sum
    # (ndim <= 3 squares and adds and a sqrt for the distance, / D, the rule's function, 1 - x), and the sum
    # of M non-negative terms adds M - 1 relative roundings; ours is computed in float64 and rounded once.
    bound = (math.prod(blocks) + 8) * torch.finfo(torch.float32).eps
    torch.testing.assert_close(ours, _release_rule(blocks, rule), rtol=0, atol=bound)


def test_column_mode_differs_from_per_row_scaling():
    """At 4x4 blocks the global-max rule differs from 'per-row max, then columns' by up to ~0.05."""
    layout = BlockLayout((4, 4), (4, 4))
    per_row = _linear_rule_by_hand(layout)
    per_row = (per_row / per_row.sum(dim=0, keepdim=True)).float()
    assert (locality_init(layout, "linear", normalize="column") - per_row).abs().max() > 0.01


@pytest.mark.parametrize("rule", INIT_RULES)
def test_every_rule_gives_stochastic_rows(rule):
    layout = BlockLayout((6, 8), (3, 4))
    w = locality_init(layout, rule, temperature=1.5)
    assert w.shape == (12, 12) and w.dtype == torch.float32
    assert torch.all(w >= 0)
    torch.testing.assert_close(w.sum(dim=1), torch.ones(12))


def test_identity_and_single_block():
    layout = BlockLayout((6, 8), (3, 4))
    assert torch.equal(locality_init(layout, "identity"), torch.eye(12))
    assert torch.equal(locality_init(BlockLayout((5, 5), (1, 1))), torch.ones(1, 1))


def test_bad_init_arguments_raise():
    layout = BlockLayout((4, 4), (2, 2))
    with pytest.raises(ValueError, match="'nearest'"):
        locality_init(layout, "nearest")
    with pytest.raises(ValueError, match="'diagonal'"):
        locality_init(layout, normalize="diagonal")
    with pytest.raises(ValueError, match="layout or num_blocks"):
        MixingMatrix()


def test_clamp_after_optimizer_step_keeps_weights_in_unit_interval():
    layout = BlockLayout((4, 4), (2, 2))
    model = nn.ModuleDict({"a": MixingMatrix(layout), "b": nn.Sequential(MixingMatrix(num_blocks=3))})
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    loss = sum(((m.weight * torch.randn_like(m.weight)).sum()) for m in (model["a"], model["b"][0]))
    loss.backward()
    optimizer.step()
    assert any((p < 0).any() or (p > 1).any() for p in model.parameters())  # the step left [0, 1]
    assert clamp_mixing_(model) == 2
    for p in model.parameters():
        assert torch.all((p >= 0) & (p <= 1))
    # a copy of the weight, not the Parameter (offloading hooks swap weight.data after the call)
    weight = model["a"]()
    assert torch.equal(weight, model["a"].weight) and weight is not model["a"].weight
    assert model["a"].num_blocks == 4


def test_fixed_mixing_stays_at_its_init_through_training_and_save(tmp_path):
    """mixing_learnable=False (the paper's fixed-mixing ablation): no gradient reaches W, whatever the
    optimizer holds; the weights still save and load as a parameter."""
    from mhla_gen import MHLAConfig, install_mhla, load_transformer
    from mhla_gen.integration.install import mhla_processors
    from mhla_gen.testing import tiny_dit

    model = install_mhla(tiny_dit(), MHLAConfig(blocks=(2, 2), mixing_learnable=False))
    init = {k: p.mixing.weight.detach().clone() for k, p in mhla_processors(model).items()}
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)  # what train.trainable=all does
    opt = torch.optim.AdamW(params, lr=0.1)
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    out = model(x, timestep=torch.tensor([10, 20]), class_labels=torch.tensor([1, 2])).sample
    out.square().mean().backward()
    opt.step()
    for name, proc in mhla_processors(model).items():
        assert proc.mixing.weight.grad is None and torch.equal(proc.mixing.weight, init[name])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    model.save_pretrained(tmp_path)
    loaded = load_transformer(tmp_path)
    assert not loaded.mhla_config.mixing_learnable
    assert all(not p.mixing.learnable for p in mhla_processors(loaded).values())
