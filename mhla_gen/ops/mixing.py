"""The learnable M×M mixing matrix and its locality-biased initialisations.

``W[i, j]`` weights key block ``j``'s summary for query block ``i``. Distances are Euclidean between
block centres in block units. Rules (``d = dist(i, j)``, ``D_i = max_k dist(i, k)``):

    linear    1 - d / D_i                    (the paper)
    cos       cos(π/2 · d / D_i)
    exp       exp(-d / temperature)
    gaussian  exp(-d² / (2 · temperature²))
    local     1 if d <= temperature else 0   (self and neighbours within the radius)
    uniform   1                               (every block equally)
    identity  1 if i == j else 0              (independent linear attention per block)

Rows are then normalised to sum to 1 (``normalize="row"``, the paper). Weights are kept in [0, 1]
by :meth:`MixingMatrix.clamp_` after each optimizer step (see :func:`clamp_mixing_`).

``normalize="column"`` is the original release's rule (DAGroup-PKU/MHLA, ``BlockDistanceConv`` /
``BlockDistanceConv3D._apply_transform``), reproduced exactly, not just its normalisation. With
``D = max_{i,k} dist(i, k)``, the largest distance over the whole matrix (not per row):

    linear    1 - d / D,  columns normalised
    cos       cos(π/4 · d / D),  columns normalised         (π/4, as the release's code)
    exp       exp(-d / temperature),  columns normalised    (the release's exp_sigma, default 3)
    local     1 if d <= temperature,  columns normalised    (the release's local_thres, default 1.5)
    gaussian  exp(-d² / (2 σ²)), σ = D / 3, not normalised  (temperature unused, as the release)
    uniform, identity (not in the release): columns normalised
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .layout import BlockLayout

INIT_RULES = ("linear", "cos", "exp", "gaussian", "local", "uniform", "identity")


def locality_init(
    layout: BlockLayout, rule: str = "linear", normalize: str = "row", temperature: float = 1.0
) -> torch.Tensor:
    """Initial mixing matrix ``(M, M)`` in float32 (computed in float64)."""
    if rule not in INIT_RULES:
        raise ValueError(f"unknown mixing init rule {rule!r}; choose one of {INIT_RULES}")
    if normalize not in ("row", "column", "none"):
        raise ValueError(f"normalize must be 'row', 'column' or 'none', got {normalize!r}")
    centers = layout.block_centers  # (M, ndim) float64
    dist = torch.cdist(centers, centers)  # (M, M)
    if normalize == "column":
        return _release_init(dist, rule, temperature).float()
    farthest = dist.amax(dim=1, keepdim=True).clamp_min(1e-12)  # D_i; M = 1 gives 0 -> guarded
    w = _shape(dist, rule, temperature, farthest, math.pi / 2)
    w = w.clamp_min(0)
    if normalize == "row":
        w = w / w.sum(dim=1, keepdim=True)
    return w.float()


def _shape(dist: torch.Tensor, rule: str, temperature: float, farthest, cos_scale: float) -> torch.Tensor:
    """Unnormalised weights ``(M, M)`` from distances; ``farthest`` scales linear / cos."""
    if rule == "linear":
        return 1 - dist / farthest
    if rule == "cos":
        return torch.cos(cos_scale * dist / farthest)
    if rule == "exp":
        return torch.exp(-dist / temperature)
    if rule == "gaussian":
        return torch.exp(-(dist**2) / (2 * temperature**2))
    if rule == "local":
        return (dist <= temperature + 1e-9).double()
    if rule == "uniform":
        return torch.ones_like(dist)
    return torch.eye(len(dist), dtype=dist.dtype)


def _release_init(dist: torch.Tensor, rule: str, temperature: float) -> torch.Tensor:
    """The original release's init (module docstring): global max distance, π/4 for cos, columns
    normalised, gaussian with σ = D / 3 and no normalisation."""
    farthest = dist.max().clamp_min(1e-12)  # one block: every distance is 0
    if rule == "gaussian":
        sigma = farthest / 3
        return torch.exp(-(dist**2) / (2 * sigma**2))
    w = _shape(dist, rule, temperature, farthest, math.pi / 4)
    return w / w.sum(dim=0, keepdim=True)


class MixingMatrix(nn.Module):
    """Learnable ``(M, M)`` mixing weights, initialised by :func:`locality_init`.

    ``learnable=False`` keeps the weights at their init (the paper's fixed-mixing ablation, Tab. 7a): the
    weight stays a parameter, so checkpoints and MHLA-only files are the same, but no gradient reaches it
    (``forward`` returns a detached copy), whatever an optimizer is given."""

    def __init__(self, layout: BlockLayout | None = None, rule="linear", normalize="row", temperature=1.0,
                 num_blocks: int | None = None, learnable: bool = True):
        super().__init__()
        self.learnable = learnable
        if layout is not None:
            init = locality_init(layout, rule, normalize, temperature)
        elif num_blocks is not None:  # shape only; weights come from a checkpoint
            init = torch.eye(num_blocks)
        else:
            raise ValueError("MixingMatrix needs a layout or num_blocks")
        self.weight = nn.Parameter(init, requires_grad=learnable)

    @property
    def num_blocks(self) -> int:
        return self.weight.shape[0]

    def forward(self) -> torch.Tensor:
        # A copy, not the Parameter: offloading hooks swap ``weight.data`` right after this call returns
        # (diffusers' leaf-level group offloading to disk leaves ``torch.empty_like`` behind), which would
        # change a returned Parameter under the caller's feet. M x M is tiny; the copy is differentiable.
        weight = self.weight.clone()
        return weight if self.learnable else weight.detach()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Project back onto [0, 1] (the paper's constraint), in place."""
        self.weight.clamp_(0.0, 1.0)

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}" + ("" if self.learnable else ", learnable=False")


@torch.no_grad()
def clamp_mixing_(model: nn.Module) -> int:
    """Clamp every :class:`MixingMatrix` inside ``model`` to [0, 1]; returns how many were clamped.

    Call it right after ``optimizer.step()``.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, MixingMatrix):
            module.clamp_()
            count += 1
    return count
