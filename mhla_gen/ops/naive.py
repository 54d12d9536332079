"""Plain references for MHLA (the test oracles). Slow on purpose; never used on a hot path.

* ``mhla_dense``: materialises ``A[t, s] = W[b(t), b(s)] · φ(q_t)·φ(k_s)`` (``N × N``), masks it
  for causal, and normalises by its row sums. Run it in float64 for an oracle.
* ``mhla_block_loop``: Python loops over query and key blocks with boolean token masks, written
  straight from the summary equations, no block-major reshapes.
"""

from __future__ import annotations

import torch

from .checks import check_inputs
from .feature_maps import get_feature_map
from .layout import BlockLayout


def mhla_dense_weights(q, k, layout: BlockLayout, mixing, feature_map="relu", causal=False) -> torch.Tensor:
    """Unnormalised MHLA attention weights ``(B, H, N, N)``."""
    phi = get_feature_map(feature_map)
    blocks = layout.block_index.to(q.device)
    block_mix = mixing.to(q.dtype)[blocks][:, blocks]  # W[b(t), b(s)]: (N, N)
    weights = (phi(q) @ phi(k).transpose(-1, -2)) * block_mix
    if causal:
        n = q.shape[-2]
        weights = weights * torch.ones(n, n, dtype=q.dtype, device=q.device).tril()
    return weights


def mhla_dense(q, k, v, layout, mixing, feature_map="relu", normalize=True, causal=False, eps=1e-6):
    """Dense oracle, ``(B, H, N, e)`` in the inputs' dtype (no upcasting: pass float64)."""
    check_inputs(q, k, v, layout, mixing, causal)
    weights = mhla_dense_weights(q, k, layout, mixing, feature_map, causal)
    out = weights @ v
    if normalize:
        out = out / (weights.sum(dim=-1, keepdim=True) + eps)
    return out


def mhla_block_loop(q, k, v, layout, mixing, feature_map="relu", normalize=True, causal=False, eps=1e-6):
    """Block-by-block reference straight from the summary equations (``docs/operator.md``)."""
    check_inputs(q, k, v, layout, mixing, causal)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q), phi(k)
    blocks = layout.block_index.to(q.device)
    m = layout.num_blocks
    members = [(blocks == j).nonzero().squeeze(-1) for j in range(m)]
    summaries = [fk[:, :, idx].transpose(-1, -2) @ v[:, :, idx] for idx in members]  # S_j (B, H, d, e)
    norms = [fk[:, :, idx].sum(dim=-2) for idx in members]  # z_j (B, H, d)
    out = torch.zeros(*v.shape[:2], v.shape[2], v.shape[3], dtype=v.dtype, device=v.device)
    for i, idx in enumerate(members):
        if causal:  # earlier chunks through their summaries, the own chunk through exact prefix sums
            local_kv = torch.cumsum(fk[:, :, idx, :, None] * v[:, :, idx, None, :], dim=2)  # (B, H, L, d, e)
            local_z = torch.cumsum(fk[:, :, idx], dim=2)  # (B, H, L, d)
            kv = mixing[i, i] * local_kv + sum(mixing[i, j] * summaries[j][:, :, None] for j in range(i))
            z = mixing[i, i] * local_z + sum(mixing[i, j] * norms[j][:, :, None] for j in range(i))
            num = torch.einsum("bhld,bhlde->bhle", fq[:, :, idx], kv)
            den = (fq[:, :, idx] * z).sum(-1, keepdim=True)
        else:
            kv = sum(mixing[i, j] * summaries[j] for j in range(m))
            z = sum(mixing[i, j] * norms[j] for j in range(m))
            num = fq[:, :, idx] @ kv
            den = fq[:, :, idx] @ z.unsqueeze(-1)
        out[:, :, idx] = num / (den + eps) if normalize else num
    return out


def linear_attention(q, k, v, feature_map="relu", normalize=True, eps=1e-6):
    """Plain (global) linear attention, the baseline and the one-block special case. ``(B, H, N, e)``."""
    phi = get_feature_map(feature_map)
    fq, fk = phi(q), phi(k)
    out = fq @ (fk.transpose(-1, -2) @ v)
    if normalize:
        out = out / (fq @ fk.sum(dim=-2).unsqueeze(-1) + eps)
    return out
