"""Attention-map statistics for small N: rank and mean row entropy (the paper's Fig. 3b measures).

All three attention kinds are written as row-stochastic ``(B, H, N, N)`` matrices:

    softmax   softmax(q kᵀ / sqrt(d))
    linear    φ(q)·φ(k), rows normalised
    mhla      W[b(t), b(s)] · φ(q_t)·φ(k_s), rows normalised (``mhla_dense_weights``)
"""

from __future__ import annotations

import torch

from ..ops.feature_maps import get_feature_map
from ..ops.layout import BlockLayout
from ..ops.naive import mhla_dense_weights

ATTENTION_KINDS = ("softmax", "linear", "mhla")


def attention_matrix(q, k, kind="mhla", layout: BlockLayout | None = None, mixing=None, feature_map="relu",
                     eps: float = 1e-12) -> torch.Tensor:
    """Row-stochastic attention ``(B, H, N, N)`` for q, k ``(B, H, N, d)`` (computed in float64)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {ATTENTION_KINDS}")
    q, k = q.double(), k.double()
    if kind == "softmax":
        return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    if kind == "linear":
        phi = get_feature_map(feature_map)
        weights = phi(q) @ phi(k).transpose(-1, -2)
    else:
        if layout is None or mixing is None:
            raise ValueError("kind='mhla' needs a layout and a mixing matrix")
        weights = mhla_dense_weights(q, k, layout, mixing.double(), feature_map)
    return weights / (weights.sum(dim=-1, keepdim=True) + eps)


def attention_rank(attn: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Numerical rank of each ``(N, N)`` map: singular values above ``rtol · σ_max``.

    Returns a LongTensor ``(B, H)``.
    """
    return torch.linalg.matrix_rank(attn.double(), rtol=rtol)


def row_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy (nats) of the rows of each map. ``(B, H)`` float64."""
    p = attn.double().clamp_min(0)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=-1)
    return ent.mean(dim=-1)


def mirror_mass(attn: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """Mean attention each query puts on the key at its mirror image across the grid's vertical axis
    (same row, last axis reversed: token ``(.., r, c)`` -> ``(.., r, W-1-c)``), per map: ``(B, H)``.

    The uniform map scores ``1 / N``; a map that copies from the mirror position scores 1. It measures
    whether a layer can route the exact token the shapes' mirror symmetry needs.
    """
    n = attn.shape[-1]
    refusal = f"mirror_mass needs a 2D or 3D token grid with N = {n} tokens, got grid {grid}"
    mirror = _mirror_index(grid, n, refusal)
    index = mirror.to(attn.device).view(n, 1).expand(*attn.shape[:-1], 1)  # (B, H, N, 1)
    return attn.double().gather(-1, index).squeeze(-1).mean(-1)


def mirror_block_share(mixing: torch.Tensor, blocks: tuple[int, ...]) -> float:
    """Mean share of each query block's mixing row on its mirrored key block (:func:`mirror_mass` at
    block level): ``mixing`` ``(M, M)`` over a row-major block grid ``blocks``. Uniform rows score
    ``1 / M``; rows that take only the mirrored block score 1."""
    m = mixing.shape[-1]
    refusal = f"mirror_block_share needs a 2D or 3D block grid of M = {m} blocks, got {blocks}"
    mirror = _mirror_index(blocks, m, refusal).view(m, 1)
    rows = mixing.double()
    return (rows.gather(-1, mirror.to(mixing.device)).squeeze(-1) / rows.sum(-1)).mean().item()


def _mirror_index(grid: tuple[int, ...], n: int, refusal: str) -> torch.Tensor:
    """``(n,)``: the row-major index of each cell's mirror across ``grid``'s vertical axis (last axis
    reversed); ValueError(``refusal``) unless ``grid`` is 2D / 3D with ``n`` cells."""
    if len(grid) < 2 or torch.Size(grid).numel() != n:
        raise ValueError(refusal)
    return torch.arange(n).reshape(grid).flip(-1).reshape(n)


def compare_attention(q, k, layout: BlockLayout, mixing, feature_map="relu") -> dict[str, dict[str, float]]:
    """Rank and entropy of softmax, linear and MHLA maps built from the same q, k (averaged over B, H)."""
    stats = {}
    for kind in ATTENTION_KINDS:
        attn = attention_matrix(q, k, kind, layout, mixing, feature_map)
        stats[kind] = {
            "rank": attention_rank(attn).double().mean().item(),
            "entropy": row_entropy(attn).mean().item(),
        }
    return stats
